"""On-device token augmentation: synonym table, POS lexicon, and the ``augment`` step of a loop.

Text augmentation usually runs on the CPU before tokenization, giving the same noisy copy every
epoch. Here it runs on the token batch already on the device, fresh at every step, in one
memory-bound pass (``ftlib.kernels.augment``: a Triton kernel with a bit-identical PyTorch
reference). Per token, with probability ``swap_prob`` and a tag in ``swap_tags`` it becomes a
uniformly chosen synonym; otherwise with probability ``mask_prob`` and a tag in ``mask_tags`` it
becomes the mask token. Padding, special tokens and (by default) prompt tokens (label -100)
never change. Labels either keep the original targets (denoising) or follow the new tokens;
masked positions can be dropped from the loss. The random numbers come from Philox keyed by
(seed, step, flat token index), so a run reproduces on any device and resumes exactly.

Tables (built once on the host, moved to the device once with ``.to(device)``):

- ``SynonymTable``: per-token CSR lists over the vocabulary, ``offsets`` int32 [V + 1] and
  ``candidates`` int32 [nnz]. ``build_synonym_table`` maps word -> synonyms data through a
  tokenizer: only words whose form is a single token count, for each variant a word takes in
  running text (bare ``word``, and after a space: byte-level BPE's ``Ġword``, SentencePiece's
  ``▁word``; optionally Title-case), and a synonym replaces a token of the same variant, so
  spacing and case survive a swap. ``coverage`` says what was kept and what was dropped, why.
- ``PosLexicon``: a tag id per token id (uint8 [V]; 0 = unknown, ``PROTECTED_TAG`` = special
  token), from word -> tag data (``build_pos_lexicon``) or a tagging function over the
  vocabulary (``pos_lexicon_from_function``).
- ``read_synonyms_tsv`` / ``read_pos_tsv`` load plain TSV files (``word<TAB>synonym<TAB>...``,
  ``word<TAB>TAG``; ``#`` comments); ``load_lexicon_dir`` reads ``synonyms.tsv`` + ``pos.tsv``.

Use in a loop, after the batch reaches the device::

    syn, lex = load_lexicon_dir(tok, "lexicon/", vocab_size=model.config.vocab_size)
    print(syn.coverage.summary()); syn, lex = syn.to(device), lex.to(device)
    cfg = AugmentConfig(swap_prob=0.1, mask_prob=0.05, mask_token_id=tok.unk_token_id)
    for step, batch in enumerate(loader):
        batch = {k: v.to(device) for k, v in batch.items()}
        batch = augment(batch, syn, lex, cfg, seed=seed + rank, step=step)

Synonym swapping as augmentation: Wei & Zou 2019 (EDA); token masking as noise: Devlin et al.
2019 (BERT), Lewis et al. 2020 (BART's token masking).
"""

from __future__ import annotations

import gzip
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .kernels.augment import MAX_TAG, PROTECTED_TAG, AugmentParams, augment_tokens, probability_threshold

__all__ = [
    "AugmentConfig",
    "CoverageReport",
    "PROTECTED_TAG",
    "PosLexicon",
    "SynonymTable",
    "augment",
    "build_pos_lexicon",
    "build_synonym_table",
    "load_lexicon_dir",
    "pos_lexicon_from_function",
    "read_pos_tsv",
    "read_synonyms_tsv",
    "resolve_token_id",
    "special_token_ids",
]

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
    def from_lists(cls, vocab_size: int, synonyms: Mapping[int, Iterable[int]]) -> SynonymTable:
        """A table from ``{token_id: [synonym ids]}`` (order kept, duplicates removed)."""
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        lists: dict[int, list[int]] = {}
        for tok, syns in synonyms.items():
            tok = int(tok)
            if not 0 <= tok < vocab_size:
                raise ValueError(f"SynonymTable.from_lists: token id {tok} is outside the vocabulary [0, {vocab_size})")
            lists[tok] = list(dict.fromkeys(int(s) for s in syns))
        return cls(*_csr(vocab_size, lists))


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


# ----------------------------------------------------------------------------------------------
# Tokenizer helpers
# ----------------------------------------------------------------------------------------------

def _hf_tokenizer(tokenizer):
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` (itself, or ftlib's PretrainedTokenizer)."""
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    if not (hasattr(inner, "encode_batch") and hasattr(inner, "get_vocab_size")):
        raise TypeError(f"expected a tokenizers.Tokenizer or ftlib PretrainedTokenizer, got {type(tokenizer).__name__}")
    return inner


def special_token_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens (added tokens marked special, and bos/eos/pad/unk)."""
    tok = _hf_tokenizer(tokenizer)
    ids = {i for i, t in tok.get_added_tokens_decoder().items() if getattr(t, "special", False)}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        i = getattr(tokenizer, name, None)
        if isinstance(i, int):
            ids.add(i)
    unk = getattr(getattr(tok, "model", None), "unk_token", None)
    if isinstance(unk, str) and tok.token_to_id(unk) is not None:
        ids.add(tok.token_to_id(unk))
    return ids


def resolve_token_id(tokenizer, token: str | int, vocab_size: int | None = None) -> int:
    """The id of ``token`` (a token string such as ``"<mask>"``, or an id), checked to exist."""
    tok = _hf_tokenizer(tokenizer)
    size = vocab_size or tok.get_vocab_size(with_added_tokens=True)
    if isinstance(token, int) and not isinstance(token, bool):
        if not 0 <= token < size:
            raise ValueError(f"token id {token} does not exist: the vocabulary has {size} ids")
        return token
    i = tok.token_to_id(token)
    if i is None:
        specials = sorted(tok.id_to_token(j) for j in special_token_ids(tokenizer))
        raise ValueError(f"token {token!r} is not in the tokenizer's vocabulary; its special tokens are "
                         f"{specials[:20]}{' ...' if len(specials) > 20 else ''}")
    return i


def _vocab_size(tok, vocab_size: int | None) -> int:
    n = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size is None:
        return n
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < n:
        raise ValueError(f"vocab_size={vocab_size!r} is smaller than the tokenizer's {n} ids (pass the model's "
                         "embedding size, config.vocab_size, or leave it None)")
    return vocab_size


def _title(w: str) -> str:
    return w[:1].upper() + w[1:]


def _form(word: str, prefix: str, title: bool) -> str:
    return prefix + (_title(word) if title else word)


def _forms(word: str, variants) -> list[str]:
    """The strings ``word`` is looked up as (Title-cased forms only for lower-case words)."""
    return [_form(word, p, t) for _, p, t in variants if not (t and not word[:1].islower())]


def _variants(title_case: bool) -> list[tuple[str, str, bool]]:
    """(name, prefix, title-cased) for each form a word takes in running text."""
    out = [("space", " ", False), ("bare", "", False)]
    if title_case:
        out += [("Title space", " ", True), ("Title bare", "", True)]
    return out


class _Encoder:
    """Single-token lookups of many strings at once (``encode_batch``), cached."""

    def __init__(self, tok, vocab: int, special: set[int]):
        self.tok, self.vocab, self.special = tok, vocab, special
        self.cache: dict[str, list[int]] = {}

    def prime(self, strings: Iterable[str]) -> None:
        todo = [s for s in dict.fromkeys(strings) if s not in self.cache]
        for s, enc in zip(todo, self.tok.encode_batch(todo, add_special_tokens=False)):
            self.cache[s] = enc.ids

    def single(self, s: str) -> tuple[int | None, str]:
        """(token id, "") when ``s`` is exactly one ordinary token, else (None, why)."""
        ids = self.cache[s]
        if len(ids) != 1:
            return None, f"{len(ids)} tokens"
        if ids[0] in self.special:
            return None, "special"
        return ids[0], ""


# ----------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------

def build_synonym_table(tokenizer, synonyms: Mapping[str, Iterable[str]], *, vocab_size: int | None = None,
                        symmetric: bool = False, title_case: bool = True) -> SynonymTable:
    """Word -> synonyms data through ``tokenizer`` into a ``SynonymTable`` with a coverage report.

    For each variant (after a space, bare, and with ``title_case`` the Title-cased forms of
    lower-case words) where the word is exactly one ordinary token, each synonym in the same
    variant that is exactly one ordinary token becomes a candidate of that token. Special
    tokens, synonyms that map to the word's own token and multi-token forms are dropped and
    reported (``table.coverage``). ``symmetric`` adds y -> w for every w -> y. ``vocab_size``:
    the model's embedding rows (default: the tokenizer's size).
    """
    tok = _hf_tokenizer(tokenizer)
    vocab = _vocab_size(tok, vocab_size)
    special = special_token_ids(tokenizer)
    data: dict[str, list[str]] = {}
    for w, syns in synonyms.items():
        if isinstance(syns, str):
            raise TypeError(f"synonyms of {w!r} must be a list of words, got the string {syns!r}")
        data.setdefault(w, []).extend(syns)
    if symmetric:
        for w, y in [(w, y) for w, syns in data.items() for y in syns]:
            data.setdefault(y, []).append(w)
    data = {w: list(dict.fromkeys(y for y in syns if y != w)) for w, syns in data.items()}
    variants = _variants(title_case)
    enc = _Encoder(tok, vocab, special)
    enc.prime(_form(x, p, t) for w, syns in data.items() for x in [w, *syns] for _, p, t in variants)

    report = CoverageReport("synonyms", words=len(data))
    lists: dict[int, list[int]] = {}
    for w, syns in data.items():
        sources = 0
        kept_pairs: set[str] = set()
        why: dict[str, str] = {}
        for name, prefix, title in variants:
            if title and not w[:1].islower():
                continue
            src, _ = enc.single(_form(w, prefix, title))
            if src is None:
                continue
            sources += 1
            for y in syns:
                dst, reason = enc.single(_form(y, prefix, title))
                if dst is None:
                    if reason == "special":
                        why[y] = "special token"
                    else:
                        why.setdefault(y, "synonym not a single token")
                    continue
                if dst == src:
                    why.setdefault(y, "synonym is the same token as the word")
                    continue
                lst = lists.setdefault(src, [])
                if dst not in lst:
                    lst.append(dst)
                    report.variants[name] = report.variants.get(name, 0) + 1
                kept_pairs.add(y)
        if sources == 0:
            forms = _forms(w, variants)
            reason = ("special token" if any(enc.single(f)[1] == "special" for f in forms)
                      else "word not a single token")
            report.drop(reason, w)
            continue
        for y in syns:
            if y not in kept_pairs:
                report.drop(why.get(y, "synonym not a single token"), f"{w} -> {y}")
        if kept_pairs:
            report.words_kept += 1
        else:
            report.drop("no synonym left", w)
    offsets, cand = _csr(vocab, lists)
    report.tokens = sum(1 for v in lists.values() if v)
    report.entries = int(cand.numel())
    return SynonymTable(offsets, cand, coverage=report)


def _tag_names(used: Iterable[str], tag_names: Iterable[str] | None) -> tuple[str, ...]:
    used = set(used) - {UNKNOWN_TAG}
    if tag_names is None:
        names = sorted(used)
    else:
        names = [n for n in tag_names if n != UNKNOWN_TAG]
        missing = sorted(used - set(names))
        if missing:
            raise ValueError(f"tags {missing} are used but not in tag_names {names}")
    if len(names) > MAX_TAG:
        raise ValueError(f"{len(names)} distinct tags, at most {MAX_TAG} fit: {names[:10]} ...")
    return (UNKNOWN_TAG, *names)


def build_pos_lexicon(tokenizer, word_tags: Mapping[str, str], *, vocab_size: int | None = None,
                      title_case: bool = True, tag_names: Iterable[str] | None = None) -> PosLexicon:
    """Word -> tag data through ``tokenizer`` into a ``PosLexicon`` with a coverage report.

    Every variant of a word that is one ordinary token gets the word's tag (the forms written in
    the data first, then generated Title-case forms, which never override a written entry).
    Tag ids are 1.. in sorted name order unless ``tag_names`` fixes them. Special tokens are
    protected. Two words tagging the same token differently: the first keeps it (reported).
    """
    tok = _hf_tokenizer(tokenizer)
    vocab = _vocab_size(tok, vocab_size)
    special = special_token_ids(tokenizer)
    for w, t in word_tags.items():
        if not isinstance(t, str) or not t:
            raise ValueError(f"tag of {w!r} must be a non-empty string, got {t!r}")
    names = _tag_names(word_tags.values(), tag_names)
    tag_id = {n: i for i, n in enumerate(names)}
    variants = _variants(title_case)
    enc = _Encoder(tok, vocab, special)
    enc.prime(_form(w, p, t) for w in word_tags for _, p, t in variants)
    tags = np.zeros(vocab, dtype=np.uint8)
    owner: dict[int, str] = {}
    report = CoverageReport("pos", words=len(word_tags))
    kept: set[str] = set()
    conflicted: set[str] = set()
    reported: set[str] = set()
    for generated in (False, True):  # the forms written in the data first, then generated Title forms
        for w, tag in word_tags.items():
            for name, prefix, title in variants:
                if title != generated or (title and not w[:1].islower()):
                    continue
                tid, _ = enc.single(_form(w, prefix, title))
                if tid is None:
                    continue
                if tid in owner:
                    item = f"{w}/{tag} vs {owner[tid]}/{names[tags[tid]]}"
                    if tags[tid] != tag_id[tag] and not generated and item not in reported:
                        report.drop("conflicting tag, first kept", item)
                        reported.add(item)
                        conflicted.add(w)
                    continue
                tags[tid] = tag_id[tag]
                owner[tid] = w
                kept.add(w)
                report.variants[name] = report.variants.get(name, 0) + 1
    for w in word_tags:
        if w in kept or w in conflicted:
            continue
        forms = _forms(w, variants)
        if any(enc.single(f)[1] == "special" for f in forms):
            report.drop("special token", w)
        elif not any(enc.single(f)[0] is not None for f in forms):
            report.drop("word not a single token", w)
        else:
            report.drop("same tokens as an earlier word", w)
    report.words_kept = len(kept)
    report.tokens = report.entries = len(owner)
    tags_t = torch.from_numpy(tags)
    if special:
        tags_t[torch.tensor(sorted(special))] = PROTECTED_TAG
    return PosLexicon(tags_t, names, coverage=report)


def pos_lexicon_from_function(tokenizer, tag_fn: Callable[[str], str | None], *, vocab_size: int | None = None,
                              tag_names: Iterable[str] | None = None) -> PosLexicon:
    """A ``PosLexicon`` from ``tag_fn(token_text) -> tag name or None`` called on every ordinary token.

    ``token_text`` is the token decoded on its own (``" happy"`` for ``Ġhappy`` or ``▁happy``:
    strip it if the tagger wants bare words). Special tokens are protected and not passed.
    """
    tok = _hf_tokenizer(tokenizer)
    vocab = _vocab_size(tok, vocab_size)
    special = special_token_ids(tokenizer)
    n = tok.get_vocab_size(with_added_tokens=True)
    ids = [i for i in range(n) if i not in special]
    texts = tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
    got: dict[int, str] = {}
    for i, text in zip(ids, texts):
        t = tag_fn(text)
        if t is None or t == "" or t == UNKNOWN_TAG:
            continue
        if not isinstance(t, str):
            raise ValueError(f"tag_fn({text!r}) returned {t!r}; expected a tag name (str) or None")
        got[i] = t
    names = _tag_names(got.values(), tag_names)
    tag_id = {n: i for i, n in enumerate(names)}
    tags = torch.zeros(vocab, dtype=torch.uint8)
    report = CoverageReport("pos-function", words=len(ids), words_kept=len(got), tokens=len(got), entries=len(got))
    for i, t in got.items():
        tags[i] = tag_id[t]
        report.variants[t] = report.variants.get(t, 0) + 1
    if special:
        tags[torch.tensor(sorted(special))] = PROTECTED_TAG
    return PosLexicon(tags, names, coverage=report)


# ----------------------------------------------------------------------------------------------
# TSV loaders
# ----------------------------------------------------------------------------------------------

def _tsv_rows(path, strict: bool, check: Callable[[list[str]], str | None]):
    """Yield (line number, fields) of each record in file order; comments (#) and blank lines skipped.

    A malformed line raises (strict) or is skipped; the skips are reported in one warning at the end.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise ValueError(f"{path}: cannot be read: {e}") from None
    skipped: list[str] = []
    for lineno, line in enumerate(raw.split(b"\n"), 1):
        if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        try:
            text = line.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as e:
            why = f"not valid UTF-8 ({e.reason} at byte {e.start})"
            if strict:
                raise ValueError(f"{path}:{lineno}: {why}") from None
            skipped.append(f"line {lineno}: {why}")
            continue
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        fields = [x.strip() for x in text.split("\t")]
        why = check(fields)
        if why is not None:
            if strict:
                raise ValueError(f"{path}:{lineno}: {why}")
            skipped.append(f"line {lineno}: {why}")
            continue
        yield lineno, fields
    if skipped:
        warnings.warn(f"{path}: skipped {len(skipped)} malformed lines: " + "; ".join(skipped), stacklevel=3)


def _check_fields(fields: list[str], n: int | None) -> str | None:
    if n is not None and len(fields) != n:
        return f"expected {n} tab-separated fields (word<TAB>TAG), got {len(fields)}"
    if len(fields) < 2:
        return "expected word<TAB>synonym[<TAB>synonym...], got 1 field (no tab)"
    empty = [i + 1 for i, x in enumerate(fields) if not x]
    if empty:
        return f"field {empty[0]} is empty"
    return None


def read_synonyms_tsv(path: str | os.PathLike, *, strict: bool = True) -> dict[str, list[str]]:
    """``word<TAB>synonym[<TAB>synonym...]`` per line (UTF-8, ``#`` comments, ``.gz`` allowed).

    A word on several lines gets the union. A malformed line is an error naming file and line;
    with ``strict=False`` it is skipped and every skip is reported in one warning.
    """
    out: dict[str, list[str]] = {}
    for _, fields in _tsv_rows(path, strict, lambda f: _check_fields(f, None)):
        lst = out.setdefault(fields[0], [])
        lst.extend(y for y in fields[1:] if y not in lst)
    return out


def read_pos_tsv(path: str | os.PathLike, *, strict: bool = True) -> dict[str, str]:
    """``word<TAB>TAG`` per line. A word listed again with another tag is an error (strict) or
    skipped and reported (``strict=False``); the same pair twice is fine."""
    out: dict[str, str] = {}
    first: dict[str, int] = {}
    skipped: list[str] = []
    for lineno, (w, tag) in _tsv_rows(path, strict, lambda f: _check_fields(f, 2)):
        if w in out and out[w] != tag:
            why = f"{w!r} tagged {tag!r} here but {out[w]!r} on line {first[w]}"
            if strict:
                raise ValueError(f"{path}:{lineno}: {why}")
            skipped.append(f"line {lineno}: {why}")
            continue
        out.setdefault(w, tag)
        first.setdefault(w, lineno)
    if skipped:
        warnings.warn(f"{path}: skipped {len(skipped)} conflicting lines: " + "; ".join(skipped), stacklevel=2)
    return out


def load_lexicon_dir(tokenizer, path: str | os.PathLike, *, vocab_size: int | None = None,
                     symmetric: bool = False, title_case: bool = True,
                     strict: bool = True) -> tuple[SynonymTable, PosLexicon]:
    """``synonyms.tsv`` (required) and ``pos.tsv`` (optional: else every token is unknown) of a folder."""
    root = Path(path)
    syn_file, pos_file = root / "synonyms.tsv", root / "pos.tsv"
    if not syn_file.is_file():
        raise FileNotFoundError(f"{syn_file}: not found (a lexicon folder holds synonyms.tsv and optionally pos.tsv)")
    syn = build_synonym_table(tokenizer, read_synonyms_tsv(syn_file, strict=strict), vocab_size=vocab_size,
                              symmetric=symmetric, title_case=title_case)
    if pos_file.is_file():
        lex = build_pos_lexicon(tokenizer, read_pos_tsv(pos_file, strict=strict), vocab_size=vocab_size,
                                title_case=title_case)
    else:
        lex = PosLexicon.blank(syn.vocab_size, special_token_ids(tokenizer))
    return syn, lex


# ----------------------------------------------------------------------------------------------
# The operation
# ----------------------------------------------------------------------------------------------

_LABEL_MODES = ("keep", "follow")


def _check_tags(name: str, tags) -> str | tuple:
    if isinstance(tags, str):
        if tags != "all":
            raise ValueError(f"AugmentConfig.{name} must be 'all' or a list of tag names/ids, got {tags!r}")
        return tags
    try:
        out = tuple(tags)
    except TypeError:
        raise ValueError(f"AugmentConfig.{name} must be 'all' or a list of tag names/ids, got {tags!r}") from None
    for t in out:
        if isinstance(t, bool) or not isinstance(t, (str, int)):
            raise ValueError(f"AugmentConfig.{name}: {t!r} is neither a tag name nor a tag id")
    return out


@dataclass(frozen=True)
class AugmentConfig:
    """Settings of ``augment`` (see the module docstring).

    - ``swap_prob``, ``swap_tags``: a token whose tag is in ``swap_tags`` and that has synonyms
      becomes one of them, chosen uniformly, with probability ``swap_prob``.
    - ``mask_prob``, ``mask_tags``, ``mask_token_id``: otherwise a token whose tag is in
      ``mask_tags`` becomes ``mask_token_id`` with probability ``mask_prob``.
    - tag sets are ``"all"`` (every tag, unknown included; protected tokens never) or tag names
      / ids of the lexicon.
    - ``protect_prompt``: tokens without loss (label -100: prompts, padding) never change.
    - ``labels``: ``"keep"`` (targets stay the original tokens: denoising) or ``"follow"``
      (a changed token's target becomes the new token); ``drop_masked``: masked positions get
      label -100.
    - ``pad_id``: tokens equal to it never change (padding of packed rows without labels).
    """

    swap_prob: float = 0.1
    mask_prob: float = 0.0
    swap_tags: str | tuple = "all"
    mask_tags: str | tuple = "all"
    mask_token_id: int | None = None
    protect_prompt: bool = True
    labels: str = "keep"
    drop_masked: bool = False
    pad_id: int | None = None

    def __post_init__(self):
        for name in ("swap_prob", "mask_prob"):
            p = getattr(self, name)
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= float(p) <= 1.0:
                raise ValueError(f"AugmentConfig.{name} must be a probability in [0, 1], got {p!r}")
        object.__setattr__(self, "swap_tags", _check_tags("swap_tags", self.swap_tags))
        object.__setattr__(self, "mask_tags", _check_tags("mask_tags", self.mask_tags))
        if self.labels not in _LABEL_MODES:
            raise ValueError(f"AugmentConfig.labels must be one of {_LABEL_MODES}, got {self.labels!r}")
        for name in ("mask_token_id", "pad_id"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"AugmentConfig.{name} must be a non-negative token id or None, got {v!r}")
        if self.mask_prob > 0 and self.mask_token_id is None:
            raise ValueError("AugmentConfig: mask_prob > 0 needs a mask_token_id (e.g. resolve_token_id(tok, '<mask>'))")

    def tag_bits(self, lexicon: PosLexicon, which: str) -> int:
        """The int64 bit mask of ``swap_tags`` / ``mask_tags`` over ``lexicon``'s tag ids."""
        tags = getattr(self, which)
        if tags == "all":
            return (1 << (MAX_TAG + 1)) - 1
        bits = 0
        for t in tags:
            i = lexicon.tag_id(t) if isinstance(t, str) else t
            if not 0 <= i < len(lexicon.tag_names):
                raise ValueError(f"AugmentConfig.{which}: tag id {i} does not exist; the lexicon has ids "
                                 f"0..{len(lexicon.tag_names) - 1} ({list(lexicon.tag_names)})")
            bits |= 1 << i
        return bits

    def params(self, synonyms: SynonymTable, lexicon: PosLexicon, seed: int, step: int) -> AugmentParams:
        """The kernel scalars for one call, checked against the tables."""
        if lexicon.vocab_size != synonyms.vocab_size:
            raise ValueError(f"the POS lexicon covers {lexicon.vocab_size} ids but the synonym table "
                             f"{synonyms.vocab_size}: build both for the same vocabulary")
        vocab = synonyms.vocab_size
        for name in ("mask_token_id", "pad_id"):
            v = getattr(self, name)
            if v is not None and v >= vocab:
                raise ValueError(f"AugmentConfig.{name}={v} does not exist: the vocabulary has {vocab} ids")
        for name, v in (("seed", seed), ("step", step)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) < 2**64:
                raise ValueError(f"augment: {name} must be a Python int in [0, 2^64), got {v!r}")
        return AugmentParams(
            seed=int(seed), step=int(step),
            swap_threshold=probability_threshold(self.swap_prob),
            mask_threshold=probability_threshold(self.mask_prob) if self.mask_token_id is not None else 0,
            swap_tag_bits=self.tag_bits(lexicon, "swap_tags"), mask_tag_bits=self.tag_bits(lexicon, "mask_tags"),
            mask_token_id=-1 if self.mask_token_id is None else self.mask_token_id,
            pad_id=-1 if self.pad_id is None else self.pad_id,
            protect_unlabeled=self.protect_prompt, follow_labels=self.labels == "follow",
            drop_masked=self.drop_masked,
        )


def augment(batch: Mapping, synonyms: SynonymTable, lexicon: PosLexicon, config: AugmentConfig | None = None,
            seed: int = 0, step: int = 0) -> dict:
    """A new batch dict with augmented ``input_ids`` (and ``labels`` by ``config.labels``).

    ``batch`` follows the batch contract (``input_ids``, ``labels``; ``attention_mask`` for
    padded batches, whose zeros are never touched); other keys pass through. The tables must be
    on the batch's device (move them once). Same (seed, step) gives the same result on every
    device and backend; use a different step for every micro-batch and seed + rank per rank.
    """
    config = AugmentConfig() if config is None else config
    if not isinstance(synonyms, SynonymTable) or not isinstance(lexicon, PosLexicon):
        raise TypeError("augment(batch, synonyms, lexicon, ...): expected a SynonymTable and a PosLexicon, got "
                        f"{type(synonyms).__name__} and {type(lexicon).__name__}")
    if "input_ids" not in batch:
        raise ValueError(f"augment: the batch has no 'input_ids' (keys: {sorted(batch)})")
    labels = batch.get("labels")
    if labels is None and config.protect_prompt:
        raise ValueError("augment: protect_prompt=True needs the batch's 'labels' (-100 marks the prompt); "
                         "pass labels or set protect_prompt=False")
    params = config.params(synonyms, lexicon, seed, step)
    ids = batch["input_ids"]
    if torch.is_tensor(ids) and ids.device != synonyms.device:
        raise ValueError(f"augment: the synonym table is on {synonyms.device} but the batch is on {ids.device}; "
                         "move the tables once before the loop: synonyms, lexicon = synonyms.to(device), "
                         "lexicon.to(device)")
    new_ids, new_labels = augment_tokens(ids, labels, batch.get("attention_mask"), lexicon.tags,
                                         synonyms.offsets, synonyms.candidates, params)
    out = dict(batch)
    out["input_ids"] = new_ids
    if labels is not None:
        out["labels"] = new_labels
    return out
