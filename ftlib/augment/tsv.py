"""The plain-text lexicon files: ``synonyms.tsv`` and ``pos.tsv``.

One record per line, UTF-8 (a leading BOM is dropped), fields separated by tabs and stripped;
blank lines and lines starting with ``#`` are skipped; a ``.gz`` name is read through gzip.

- synonyms: ``word<TAB>synonym[<TAB>synonym...]``; a word on several lines gets the union.
- POS tags: ``word<TAB>TAG``; the same word with another tag is a conflict.

A malformed line is an error naming the file and line (``strict=True``, the default); with
``strict=False`` it is skipped, and all skips of a file are reported in one warning. The readers
return plain dicts; ``lexicon.py`` turns them into tables through a tokenizer.
"""

from __future__ import annotations

import gzip
import os
import warnings
from collections.abc import Callable
from pathlib import Path

__all__ = ["read_pos_tsv", "read_synonyms_tsv"]


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
