"""Cut an over-long text before tokenizing it, when the truncation policy will drop the rest anyway.

Tokenizing costs time and memory in proportion to the text (a 10 MB record took ~1.7 GB and
~44 s with ``tokenizers`` BPE, to keep 64 tokens of it). With ``max_length = L`` set, a policy
keeps at most ``L`` tokens from one or both ends of a text, so only those ends need tokenizing:
the SFT formatter's ``text`` kind (``right`` and ``prompt_left`` keep the head, ``head_tail``
head and tail; ``formatting.py``) and the pair formatter's ``text`` kind (the prompt keeps its
tail, each response its head; ``pairs.py``). Chat records are rendered whole (their size is
bounded by the reader, ``readers.ReadLimits``).

The bound. A text of at most ``(L + 64) * CHARS_PER_TOKEN`` characters is tokenized whole, as
before: the result is exact. A longer one is cut: only its first and/or last ``c`` characters
are tokenized, ``c`` starting at the bound divided by the number of ends kept and growing 4x
until each kept end gives more than ``L + 16`` tokens, so the kept tokens never run short, and
the 16 tokens nearest each cut (where a word split by the cut tokenizes differently) are dropped.
Within the tokens kept, the result equals tokenizing the whole record except where a single
pre-token (a "word" of the tokenizer's pre-tokenizer) spans more than 16 tokens across the cut.

A pair whose two responses differ only past the cut is reported as ``identical_responses``
(rather than ``identical_after_truncation``); it is skipped either way.

Counted in the formatter's ``stats`` (summed into the cache's): ``n_cut_before_tokenizing``
(records cut) and ``n_cut_chars`` (characters never tokenized). Such records are also counted in
``n_truncated``; their ``n_truncated_tokens`` covers only the part that was tokenized.
"""

from __future__ import annotations

__all__ = ["CHARS_PER_TOKEN", "encode_bounded"]

CHARS_PER_TOKEN = 32  # a bound, not an average: BPE vocabularies average ~4 characters per token
_GUARD = 16  # tokens next to a cut that are never kept


def encode_bounded(tokenizer, text: str, max_length: int | None, keep: str, stats: dict) -> list[int]:
    """Token ids of ``text`` (no special tokens), only its kept ends when it is over the bound.

    ``keep``: ``"head"`` (the policy keeps at most the first ``max_length`` tokens), ``"tail"``
    (the last ones) or ``"both"`` (head and tail); cuts are added to ``stats``.
    """
    if keep not in ("head", "tail", "both"):
        raise ValueError(f"keep must be head|tail|both, got {keep!r}")
    L = max_length
    bound = None if L is None else (L + 64) * CHARS_PER_TOKEN
    if bound is None or len(text) <= bound:
        return tokenizer.encode(text, add_special_tokens=False).ids
    n_ends = 2 if keep == "both" else 1
    c = bound // n_ends
    while n_ends * c < len(text):
        head_ids = tokenizer.encode(text[:c], add_special_tokens=False).ids if keep != "tail" else []
        tail_ids = tokenizer.encode(text[-c:], add_special_tokens=False).ids if keep != "head" else []
        if all(len(ids) > L + _GUARD for ids, used in ((head_ids, keep != "tail"), (tail_ids, keep != "head")) if used):
            stats["n_cut_before_tokenizing"] = stats.get("n_cut_before_tokenizing", 0) + 1
            stats["n_cut_chars"] = stats.get("n_cut_chars", 0) + len(text) - n_ends * c
            return head_ids[: max(0, len(head_ids) - _GUARD)] + tail_ids[_GUARD:]
        c *= 4
    return tokenizer.encode(text, add_special_tokens=False).ids
