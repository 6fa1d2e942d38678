"""Data pipeline: sources -> formatting (chat template, loss mask) -> Arrow token cache ->
packing (best-fit decreasing) or dynamic padding -> resumable, rank-aware loader; skipped
records are counted in one report per cache (``report.py``).

    from ftlib.data import FormatConfig, build_cache, TokenLoader
    cfg = FormatConfig(kind="chat", chat_template="chatml", eos_token="<|im_end|>", max_length=4096)
    cache = build_cache("data/train/", tokenizer, cfg, "cache/train", num_proc=8)
    loader = TokenLoader(cache, batch_size=8, seq_len=4096, pad_id=0, seed=0)

Pre-tokenize from the shell: ``python -m ftlib.data build --help``.
"""

from .cache import CacheError, TokenCache, build_cache, open_cache
from .collate import collate_packed, length_grouped_batches, pad_collate, padding_fraction
from .formatting import BUILTIN_TEMPLATES, FormatConfig, FormattedDoc, Formatter, detect_turn_end, render_chat
from .loader import TokenLoader
from .packing import PackPlan, PackStats, bfd_assign, cpp_available, pack
from .report import DataError, SkipReport
from .sources import (
    Shard,
    decode_item,
    iter_raw,
    iter_records,
    list_shards,
    parse_hub_spec,
    resolve_hub_dataset,
    shard_fingerprint,
)

__all__ = [
    "BUILTIN_TEMPLATES",
    "CacheError",
    "DataError",
    "FormatConfig",
    "FormattedDoc",
    "Formatter",
    "PackPlan",
    "PackStats",
    "Shard",
    "SkipReport",
    "TokenCache",
    "TokenLoader",
    "bfd_assign",
    "build_cache",
    "collate_packed",
    "cpp_available",
    "decode_item",
    "detect_turn_end",
    "iter_raw",
    "iter_records",
    "length_grouped_batches",
    "list_shards",
    "open_cache",
    "pack",
    "pad_collate",
    "parse_hub_spec",
    "padding_fraction",
    "render_chat",
    "resolve_hub_dataset",
    "shard_fingerprint",
]
