"""Cut an over-long text before tokenizing it, when the truncation policy will drop the rest anyway.

Tokenizing costs time and memory in proportion to the text (a 10 MB record took ~1.7 GB and
~44 s with ``tokenizers`` BPE, to keep 64 tokens of it). With ``max_length = L`` set, the
``right`` and ``prompt_left`` policies keep the first ``L`` tokens of a ``text`` record and
``head_tail`` keeps at most ``L`` from its head and ``L`` from its tail, so only those ends need
tokenizing.

The bound. A text of at most ``(L + 64) * CHARS_PER_TOKEN`` characters is tokenized whole, as
before: the result is exact. A longer one is cut: only its first ``c`` characters (and, for
``head_tail``, its last ``c``) are tokenized, ``c`` starting at half the bound (the full bound
for head-only policies) and growing 4x until each kept end gives more than ``L + 16`` tokens,
so the kept tokens never run short, and the 16 tokens nearest each cut (where a word split by
the cut tokenizes differently) are never among those kept for ordinary text. Within the
tokens kept, the result equals tokenizing the whole record except where a single pre-token
(a "word" of the tokenizer's pre-tokenizer) spans more than 16 tokens across the cut.

Counted in the formatter's ``stats`` (summed into the cache's): ``n_cut_before_tokenizing``
(records cut) and ``n_cut_chars`` (characters never tokenized). Such records are also counted in
``n_truncated``; their ``n_truncated_tokens`` covers only the part that was tokenized.
"""

from __future__ import annotations

__all__ = ["CHARS_PER_TOKEN", "encode_bounded"]

CHARS_PER_TOKEN = 32  # a bound, not an average: BPE vocabularies average ~4 characters per token
_GUARD = 16  # tokens next to a cut that are never kept


def encode_bounded(tokenizer, text: str, config, stats: dict) -> list[int]:
    """Token ids of ``text`` (no special tokens), only its kept ends when it is over the bound.

    ``config`` is a ``FormatConfig`` (``max_length``, ``truncation``); cuts are added to ``stats``.
    """
    L = config.max_length
    bound = None if L is None else (L + 64) * CHARS_PER_TOKEN
    if bound is None or len(text) <= bound:
        return tokenizer.encode(text, add_special_tokens=False).ids
    tail = config.truncation == "head_tail"
    c = bound // 2 if tail else bound
    while (2 * c if tail else c) < len(text):
        head_ids = tokenizer.encode(text[:c], add_special_tokens=False).ids
        tail_ids = tokenizer.encode(text[-c:], add_special_tokens=False).ids if tail else []
        if len(head_ids) > L + _GUARD and (not tail or len(tail_ids) > L + _GUARD):
            stats["n_cut_before_tokenizing"] = stats.get("n_cut_before_tokenizing", 0) + 1
            stats["n_cut_chars"] = stats.get("n_cut_chars", 0) + len(text) - (2 * c if tail else c)
            return head_ids[: len(head_ids) - _GUARD] + tail_ids[_GUARD:]
        c *= 4
    return tokenizer.encode(text, add_special_tokens=False).ids
