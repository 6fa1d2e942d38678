"""The two tables of token augmentation and the report of how they were built.

- ``SynonymTable``: per-token synonym lists over a vocabulary of V ids in CSR form, ``offsets``
  int32 [V + 1] and ``candidates`` int32 [nnz]; the synonyms of token v are
  ``candidates[offsets[v]:offsets[v + 1]]`` (the layout of scipy's CSR rows, one row per token).
- ``PosLexicon``: a tag id per token id, ``tags`` uint8 [V]; 0 = unknown (``UNKNOWN_TAG``), 1..
  ``MAX_TAG`` named by ``tag_names``, ``PROTECTED_TAG`` (255) = a special token, never changed.
- ``CoverageReport``: what a builder (``lexicon.py``) kept and dropped, with the reason per drop.

Both tables are checked once on the host when built (every id inside the vocabulary, no token its
own synonym, tag ids named) and moved to the device once with ``.to(device)``; the kernel
(``ftlib.kernels.augment_ref``, whose docstring has the math) reads them as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from ..kernels.augment_ref import MAX_TAG, PROTECTED_TAG

__all__ = ["CoverageReport", "PosLexicon", "SynonymTable", "UNKNOWN_TAG"]

UNKNOWN_TAG = "UNK"  # the name of tag id 0


# ----------------------------------------------------------------------------------------------
# Coverage report
# ----------------------------------------------------------------------------------------------

@dataclass
class CoverageReport:
    """What a table builder kept and dropped. ``dropped`` maps a reason to every item it dropped."""

    kind: str  # "synonyms" or "pos"
    words: int = 0  # distinct head words in the data
    words_kept: int = 0  # words that gave at least one table entry
    tokens: int = 0  # token ids that received an entry (a synonym list, or a tag)
    entries: int = 0  # synonym candidates in the table, or tagged token ids
    variants: dict[str, int] = field(default_factory=dict)  # entries per word variant ("space", "bare", ...)
    dropped: dict[str, list[str]] = field(default_factory=dict)

    def drop(self, reason: str, item: str) -> None:
        self.dropped.setdefault(reason, []).append(item)

    def summary(self, max_examples: int = 5) -> str:
        """A few lines: counts, then each drop reason with its count and first examples."""
        what = "synonym candidates" if self.kind == "synonyms" else "tagged tokens"
        if self.kind == "pos-function":
            lines = [f"pos coverage (tagging function): {self.tokens}/{self.words} ordinary tokens tagged"]
        else:
            lines = [f"{self.kind} coverage: {self.words_kept}/{self.words} words kept -> {self.tokens} token ids, "
                     f"{self.entries} {what}"]
        if self.variants:
            head = "  by tag: " if self.kind == "pos-function" else "  by variant: "
            lines.append(head + ", ".join(f"{k} {v}" for k, v in self.variants.items()))
        for reason, items in self.dropped.items():
            ex = ", ".join(items[:max_examples]) + (", ..." if len(items) > max_examples else "")
            lines.append(f"  dropped {len(items)} ({reason}): {ex}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class SynonymTable:
    """CSR synonym lists over a vocabulary of ``vocab_size`` ids.

    The synonyms of token v are ``candidates[offsets[v]:offsets[v + 1]]`` (possibly empty). Built
    on the host and checked once at construction (offsets non-decreasing from 0 to nnz, every
    candidate inside the vocabulary and different from its token); ``to(device)`` moves it.
    """

    offsets: torch.Tensor  # int32 [V + 1]
    candidates: torch.Tensor  # int32 [nnz]
    coverage: CoverageReport | None = None

    def __post_init__(self):
        off, cand = self.offsets, self.candidates
        if not (torch.is_tensor(off) and off.dim() == 1 and off.numel() >= 1 and not off.is_floating_point()):
            raise ValueError(f"SynonymTable.offsets must be a 1-D integer tensor of V + 1 entries, got {off!r}")
        if not (torch.is_tensor(cand) and cand.dim() == 1 and not cand.is_floating_point()):
            raise ValueError("SynonymTable.candidates must be a 1-D integer tensor")
        if cand.numel() >= 2**31 or off.numel() > 2**31:
            raise ValueError("SynonymTable: more than 2^31 - 1 ids or candidates does not fit int32")
        if off.device != cand.device:
            raise ValueError(f"SynonymTable: offsets on {off.device}, candidates on {cand.device}")
        if off.dtype != torch.int32 or cand.dtype != torch.int32:
            object.__setattr__(self, "offsets", off.to(torch.int32))
            object.__setattr__(self, "candidates", cand.to(torch.int32))
        if getattr(self, "_checked", False):
            return
        o = off.cpu().long()
        c = cand.cpu().long()
        vocab = o.numel() - 1
        if int(o[0]) != 0 or int(o[-1]) != c.numel():
            raise ValueError(f"SynonymTable.offsets must start at 0 and end at len(candidates)={c.numel()}, "
                             f"got {int(o[0])} .. {int(o[-1])}")
        bad = torch.nonzero(o[1:] < o[:-1])
        if bad.numel():
            raise ValueError(f"SynonymTable.offsets decreases at token {int(bad[0])}")
        out = torch.nonzero((c < 0) | (c >= vocab))
        if out.numel():
            i = int(out[0])
            tok = int(torch.searchsorted(o, torch.tensor(i), right=True)) - 1
            raise ValueError(f"SynonymTable: synonym id {int(c[i])} of token {tok} is outside the vocabulary "
                             f"[0, {vocab}) ({out.numel()} such candidates)")
        owner = torch.repeat_interleave(torch.arange(vocab), o[1:] - o[:-1])
        selfref = torch.nonzero(c == owner)
        if selfref.numel():
            raise ValueError(f"SynonymTable: token {int(owner[selfref[0]])} lists itself as a synonym")

    @property
    def vocab_size(self) -> int:
        return self.offsets.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    @property
    def num_candidates(self) -> int:
        return self.candidates.numel()

    def synonyms_of(self, token_id: int) -> list[int]:
        o = self.offsets
        return self.candidates[int(o[token_id]):int(o[token_id + 1])].tolist()

    def to(self, device) -> SynonymTable:
        """The same table on ``device`` (call once, before the loop)."""
        return _unchecked(SynonymTable, offsets=self.offsets.to(device), candidates=self.candidates.to(device),
                          coverage=self.coverage)

    @classmethod
    def from_lists(cls, vocab_size: int, synonyms: Mapping[int, Iterable[int]],
                   coverage: CoverageReport | None = None) -> SynonymTable:
        """A table from ``{token_id: [synonym ids]}`` (order kept, duplicates removed)."""
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        lists: dict[int, list[int]] = {}
        for tok, syns in synonyms.items():
            tok = int(tok)
            if not 0 <= tok < vocab_size:
                raise ValueError(f"SynonymTable.from_lists: token id {tok} is outside the vocabulary [0, {vocab_size})")
            lists[tok] = list(dict.fromkeys(int(s) for s in syns))
        return cls(*_csr(vocab_size, lists), coverage=coverage)


def _csr(vocab_size: int, lists: Mapping[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for tok, syns in lists.items():
        counts[tok] = len(syns)
    offsets = np.zeros(vocab_size + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    cand = np.zeros(int(offsets[-1]), dtype=np.int64)
    for tok, syns in lists.items():
        cand[offsets[tok]:offsets[tok + 1]] = syns
    return torch.from_numpy(offsets.astype(np.int32)), torch.from_numpy(cand.astype(np.int32))


def _unchecked(cls, **kw):
    """Construct a table whose contents were already checked (a device copy of a checked table)."""
    obj = cls.__new__(cls)
    object.__setattr__(obj, "_checked", True)
    for k, v in kw.items():
        object.__setattr__(obj, k, v)
    obj.__post_init__()
    return obj


@dataclass(frozen=True, eq=False)
class PosLexicon:
    """A tag id per token id: ``tags`` uint8 [V], 0 = unknown, ``PROTECTED_TAG`` (255) = never touched.

    ``tag_names[i]`` names tag id i (``tag_names[0] == "UNK"``); at most ``MAX_TAG`` + 1 = 63 tags.
    """

    tags: torch.Tensor  # uint8 [V]
    tag_names: tuple[str, ...] = (UNKNOWN_TAG,)
    coverage: CoverageReport | None = None

    def __post_init__(self):
        t = self.tags
        if not (torch.is_tensor(t) and t.dim() == 1 and t.numel() >= 1 and not t.is_floating_point()):
            raise ValueError(f"PosLexicon.tags must be a 1-D integer tensor over the vocabulary, got {t!r}")
        names = tuple(self.tag_names)
        if not names or names[0] != UNKNOWN_TAG:
            raise ValueError(f"PosLexicon.tag_names[0] must be {UNKNOWN_TAG!r} (tag id 0 = unknown), got {names[:1]}")
        if len(names) > MAX_TAG + 1:
            raise ValueError(f"PosLexicon: {len(names) - 1} tags, at most {MAX_TAG} fit (ids 1..{MAX_TAG})")
        if len(set(names)) != len(names):
            raise ValueError(f"PosLexicon.tag_names has duplicates: {names}")
        object.__setattr__(self, "tag_names", names)
        if getattr(self, "_checked", False):
            return
        tc = t.cpu().long()
        bad = torch.nonzero((tc < 0) | ((tc >= len(names)) & (tc != PROTECTED_TAG)))
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"PosLexicon: token {i} has tag id {int(tc[i])}, but there are only {len(names)} tags "
                             f"{list(names)} (and {PROTECTED_TAG} = protected)")
        if t.dtype != torch.uint8:
            object.__setattr__(self, "tags", t.to(torch.uint8))

    @property
    def vocab_size(self) -> int:
        return self.tags.numel()

    @property
    def device(self) -> torch.device:
        return self.tags.device

    def tag_id(self, name: str) -> int:
        try:
            return self.tag_names.index(name)
        except ValueError:
            raise ValueError(f"unknown tag {name!r}; the lexicon has tags {list(self.tag_names)}") from None

    def tag_of(self, token_id: int) -> str:
        t = int(self.tags[token_id])
        return "PROTECTED" if t == PROTECTED_TAG else self.tag_names[t]

    def protect(self, token_ids: Iterable[int]) -> PosLexicon:
        """A copy in which ``token_ids`` are protected (never swapped or masked)."""
        ids = sorted({int(i) for i in token_ids})
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"PosLexicon.protect: ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        tags = self.tags.clone()
        if ids:
            tags[torch.tensor(ids, device=tags.device)] = PROTECTED_TAG
        return _unchecked(PosLexicon, tags=tags, tag_names=self.tag_names, coverage=self.coverage)

    def to(self, device) -> PosLexicon:
        """The same lexicon on ``device`` (call once, before the loop)."""
        return _unchecked(PosLexicon, tags=self.tags.to(device), tag_names=self.tag_names, coverage=self.coverage)

    @classmethod
    def blank(cls, vocab_size: int, special_ids: Iterable[int] = ()) -> PosLexicon:
        """Every token unknown (tag 0) except ``special_ids`` (protected): for swap-only setups."""
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        return cls(torch.zeros(vocab_size, dtype=torch.uint8)).protect(special_ids)
