"""Data pipeline: sources -> formatting (chat template, loss mask) -> Arrow token cache ->
packing (best-fit decreasing) or dynamic padding -> resumable, rank-aware loader; skipped
records are counted in one report per cache (``report.py``).

    from ftlib.data import FormatConfig, build_cache, TokenLoader
    cfg = FormatConfig(kind="chat", chat_template="chatml", eos_token="<|im_end|>", max_length=4096)
    cache = build_cache("data/train/", tokenizer, cfg, "cache/train", num_proc=8)
    loader = TokenLoader(cache, batch_size=8, seq_len=4096, pad_id=0, seed=0)

Preference pairs take the same path: ``PairConfig`` / ``build_pair_cache`` (``pairs.py``) ->
``PairLoader`` (``pair_batches.py``, packed or padded pair batches) -> ``MarginFilter``. Both
loaders are fronts of one core, ``UnitLoader`` (``loader.py``). Chat templates are rendered by
one function, ``render_chat(messages, template)``.

Records come in the layouts people have (``layouts.py``: OpenAI-style ``messages`` with tool calls,
ShareGPT, TRL prompt/completion, Alpaca). Several sources mix by weight (``mixture.py``:
``MixedDocs`` + ``TokenLoader(..., weights=...)``).

Pre-tokenize from the shell: ``python -m ftlib.data build --help``.
"""

from .cache import CacheError, TokenCache, build_cache, open_cache, prepare_cache
from .collate import collate_packed, length_grouped_batches, pad_collate, padding_fraction
from .formatting import (
    BUILTIN_TEMPLATES,
    CHAT_ROLES,
    FormatConfig,
    FormattedDoc,
    Formatter,
    TemplateLimitError,
    detect_turn_end,
    render_chat,
)
from .loader import TokenLoader, UnitLoader
from .mixture import MixedDocs, parse_mixture
from .packing import PackPlan, PackStats, bfd_assign, cpp_available, pack
from .pair_batches import (
    MarginFilter,
    PairLoader,
    collate_pairs_packed,
    collate_pairs_padded,
    collate_unpaired,
    pair_tokens,
    select_pairs,
)
from .pairs import (
    CHOSEN_BIT,
    LOSS_BIT,
    REJECTED_BIT,
    PairCache,
    PairConfig,
    PairDoc,
    PairFormatter,
    build_pair_cache,
    open_pair_cache,
)
from .readers import ReadLimits, decode_item, iter_raw, iter_records
from .report import DataError, SkipReport
from .shards import Shard, list_shards, parse_hub_spec, resolve_hub_dataset, shard_fingerprint
from .sharegpt import chat_turns
from .split import DocSubset, heldout_split
from .templates import ChatTemplate, resolve_chat_template

__all__ = [
    "BUILTIN_TEMPLATES",
    "CHAT_ROLES",
    "CHOSEN_BIT",
    "CacheError",
    "ChatTemplate",
    "DataError",
    "DocSubset",
    "FormatConfig",
    "FormattedDoc",
    "Formatter",
    "LOSS_BIT",
    "MarginFilter",
    "MixedDocs",
    "PackPlan",
    "PackStats",
    "PairCache",
    "PairConfig",
    "PairDoc",
    "PairFormatter",
    "PairLoader",
    "REJECTED_BIT",
    "ReadLimits",
    "Shard",
    "SkipReport",
    "TemplateLimitError",
    "TokenCache",
    "TokenLoader",
    "UnitLoader",
    "bfd_assign",
    "build_cache",
    "build_pair_cache",
    "chat_turns",
    "collate_packed",
    "collate_pairs_packed",
    "collate_pairs_padded",
    "collate_unpaired",
    "cpp_available",
    "decode_item",
    "detect_turn_end",
    "heldout_split",
    "iter_raw",
    "iter_records",
    "length_grouped_batches",
    "list_shards",
    "open_cache",
    "open_pair_cache",
    "pack",
    "pad_collate",
    "padding_fraction",
    "pair_tokens",
    "parse_hub_spec",
    "parse_mixture",
    "prepare_cache",
    "render_chat",
    "resolve_chat_template",
    "resolve_hub_dataset",
    "select_pairs",
    "shard_fingerprint",
]
