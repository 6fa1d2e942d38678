"""Building the augmentation tables from words through a tokenizer, with a coverage report.

A table is over token ids, data is over words, so each word is looked up in every form it takes
in running text: bare ``word``, and after a space (byte-level BPE's ``Ġword``, SentencePiece's
``▁word``), optionally Title-cased for lower-case words. Only forms that are exactly one ordinary
token count; a synonym replaces a token of the same form, so spacing and case survive a swap.
Special tokens are never entries and are protected in the lexicon. Everything dropped is listed
in the table's ``coverage`` with its reason (``CoverageReport.summary()``).

- ``build_synonym_table(tokenizer, {word: [synonyms]})`` -> ``SynonymTable``
- ``build_pos_lexicon(tokenizer, {word: tag})`` -> ``PosLexicon``
- ``pos_lexicon_from_function(tokenizer, tag_fn)``: a tagging function over the vocabulary
- ``load_lexicon_dir(tokenizer, folder)``: ``synonyms.tsv`` + ``pos.tsv`` (``tsv.py``)
- ``special_token_ids``, ``resolve_token_id``: the tokenizer queries the builders (and a loop
  choosing a mask token) need.

Works with a ``tokenizers.Tokenizer`` or ftlib's ``PretrainedTokenizer`` (duck-typed: no import).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np
import torch

from ..kernels.augment_ref import MAX_TAG, PROTECTED_TAG
from .tables import UNKNOWN_TAG, CoverageReport, PosLexicon, SynonymTable
from .tsv import read_pos_tsv, read_synonyms_tsv

__all__ = [
    "build_pos_lexicon",
    "build_synonym_table",
    "load_lexicon_dir",
    "pos_lexicon_from_function",
    "resolve_token_id",
    "special_token_ids",
]


# ----------------------------------------------------------------------------------------------
# Tokenizer lookups
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
    report.tokens = sum(1 for v in lists.values() if v)
    report.entries = sum(len(v) for v in lists.values())
    return SynonymTable.from_lists(vocab, lists, coverage=report)


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
