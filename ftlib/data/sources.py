"""Deprecated: ``ftlib.data.sources`` was split into ``ftlib.data.shards`` (listing, hub specs,
fingerprints) and ``ftlib.data.readers`` (record readers); every public name is at ``ftlib.data``.

Kept one release so ``from ftlib.data.sources import ReadLimits`` (named in earlier READMEs) still
runs; importing it warns.
"""

import warnings

from .readers import ReadLimits, decode_item, item_nbytes, iter_raw, iter_records
from .shards import Shard, list_shards, parse_hub_spec, resolve_hub_dataset, shard_fingerprint

__all__ = ["ReadLimits", "Shard", "decode_item", "item_nbytes", "iter_raw", "iter_records", "list_shards",
           "parse_hub_spec", "resolve_hub_dataset", "shard_fingerprint"]

warnings.warn("ftlib.data.sources is deprecated: import from ftlib.data (or ftlib.data.shards / ftlib.data.readers)",
              DeprecationWarning, stacklevel=2)
