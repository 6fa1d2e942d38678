"""Raw record sources: JSONL, JSON, Parquet, plain text (each optionally gzipped), tar shards
(incl. webdataset samples), hub dataset repos.

A *shard* is one file on disk; the token cache tokenizes and stores each shard separately, so
adding shards to a corpus only tokenizes the new ones. ``list_shards(spec)`` expands a path, a
directory (recursively, sorted), a glob, or ``hf://datasets/owner/name[@revision][/path or glob]``
into shards; ``iter_raw(shard, report)`` streams the shard's *raw items* — undecoded bytes for
line and text formats, dicts for Parquet rows and JSON documents — each with a location string
``file:line`` (``file!member:line`` inside a tar). ``decode_item`` turns a raw item into a record
dict; it is split from reading so that decoding and JSON parsing of JSON Lines run in the
tokenizer worker processes, not in the reader.

Formats (by file name; ``.gz`` after any of the first three means gzip)
    ``*.jsonl``     one JSON object per line (blank lines are skipped)
    ``*.json``      a JSON array of objects, one object, or a sequence of objects (JSON Lines
                    named ``.json``); parsed in the reader, each object located by its line
    ``*.txt``       the whole file is one document: ``{"text": ...}``
    ``*.parquet``   one record per row (read in row groups with pyarrow)
    ``*.tar``, ``*.tar.gz``, ``*.tgz``  streamed with ``tarfile`` mode ``r|*`` (never extracted
                    to disk). Members of the formats above are read as files. Members ``.json``
                    / ``.txt`` are grouped into *webdataset samples*: adjacent members sharing a
                    key (the member path up to the first dot of its base name, e.g.
                    ``shard/000017`` for ``shard/000017.json`` and ``shard/000017.txt``). A key
                    with one member is read as that file; a key with several becomes one record:
                    the fields of its ``.json`` object(s) plus, per text member, a field named by
                    its extension (``txt`` -> ``"text"``, ``en.txt`` -> ``"en.txt"``). Parquet
                    members are read into memory (Parquet needs random access).
                    Refused (reported, never read as data): links, members with an absolute path
                    or a ``..`` component, non-regular members, members of any other type.

Directories hold data files of the types above; other files in them (README.md, ...) are listed
in a warning, hidden files and directories are not looked at.

Errors. Every problem (malformed JSON, invalid UTF-8, a refused tar member, a file that cannot
be read to its end; missing fields and empty documents are found by the formatter) goes to a
:class:`~ftlib.data.report.SkipReport`: in strict mode the first one raises
:class:`~ftlib.data.report.DataError` naming the file, line and reason; in lenient mode it is
counted with the number of records it cost — known for a bad record, a refused member (its
records are counted, not read as data) or a corrupt Parquet file (its footer gives the row
count); unknown for a gzip, tar or JSON stream cut short, where the report states how many
records were read before the cut. Nothing is dropped silently.

Fingerprint. :func:`shard_fingerprint` is the shard's size plus a SHA-256 over its first and
last MiB and 16 evenly spaced 64 KiB blocks. It costs ~3 MiB of reads per shard whatever the
shard size (a full hash of a 100 GB corpus would take minutes at every cache check), and it
ignores mtime on purpose, so a copied or re-downloaded identical file still hits the cache.
An edit that keeps the size and touches none of the sampled blocks is missed: pass
``full_hash=True`` (SHA-256 of every byte) when that matters.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import re
import tarfile
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import pyarrow as pa

from .report import DataError, SkipReport

__all__ = [
    "DataError",
    "SkipReport",
    "Shard",
    "list_shards",
    "iter_raw",
    "decode_item",
    "iter_records",
    "parse_hub_spec",
    "resolve_hub_dataset",
    "shard_fingerprint",
]

# kind -> file name endings (matched case-insensitively, longest first where they overlap)
_EXTS = {
    "jsonl": (".jsonl", ".jsonl.gz"),
    "json": (".json", ".json.gz"),
    "text": (".txt", ".txt.gz"),
    "parquet": (".parquet",),
    "tar": (".tar", ".tar.gz", ".tgz"),
}
SUPPORTED_EXTS = tuple(e for exts in _EXTS.values() for e in exts)
_MEMBER_KINDS = ("jsonl", "json", "text", "parquet")  # what a tar member may hold
_UNREADABLE = (OSError, EOFError, zlib.error, tarfile.TarError, pa.ArrowException)


@dataclass(frozen=True)
class Shard:
    """One source file; ``kind`` is ``jsonl`` | ``json`` | ``text`` | ``parquet`` | ``tar``."""

    path: str
    kind: str


def _kind_of(path: str) -> str | None:
    p = path.lower()
    for kind, exts in _EXTS.items():
        if p.endswith(exts):
            return kind
    return None


# ---- hub ----------------------------------------------------------------------------------------
# Revisions that contain '/' (the Hub's own refs). Any other revision ends at the first '/', unless
# written URL-quoted (``@my%2Fbranch``), as the Hub's own hf:// paths do.
_SPECIAL_REF = re.compile(r"(refs/convert/\w+|refs/pr/\d+)(?=/|$)")


def parse_hub_spec(spec: str) -> tuple[str, str | None, str | None]:
    """``hf://datasets/owner/name[@revision][/path]`` -> ``(repo_id, revision, path)``.

    ``revision`` may be a branch, tag or commit, one of the Hub's refs with slashes
    (``refs/convert/parquet``, ``refs/pr/3``), or URL-quoted (``feature%2Fx``).
    """
    prefix = "hf://datasets/"
    if not spec.startswith(prefix):
        raise DataError(f"{spec}: a hub dataset is written hf://datasets/owner/name[@revision][/path]")
    owner, _, rest = spec[len(prefix) :].partition("/")
    first = rest.split("/", 1)[0]
    rev = None
    if "@" in first:
        name, _, after = rest.partition("@")
        m = _SPECIAL_REF.match(after)
        if m:
            rev, sub = m.group(1), after[m.end() :].lstrip("/")
        else:
            rev, _, sub = after.partition("/")
            rev = unquote(rev)
        if not rev:
            raise DataError(f"{spec}: empty revision after '@'")
    else:
        name, _, sub = rest.partition("/")
    if not owner or not name:
        raise DataError(f"{spec}: a hub dataset is written hf://datasets/owner/name[@revision][/path]")
    return f"{owner}/{name}", rev, (sub.strip("/") or None)


def resolve_hub_dataset(repo_id: str, revision: str | None = None, cache_dir: str | None = None,
                        path: str | None = None) -> str:
    """Download (or find in the local hub cache) a dataset repo; return its local directory.

    Only data files are fetched (``allow_patterns`` on the supported extensions, under ``path``
    when given: a file, directory or glob inside the repo); no code that comes with the dataset
    is ever run.
    """
    from huggingface_hub import snapshot_download

    if path and _kind_of(path) is not None:  # a file or a glob of files: fetch exactly those
        patterns = [path]
    else:
        prefix = f"{path.rstrip('/')}/" if path else ""
        patterns = [f"{prefix}*{e}" for e in SUPPORTED_EXTS]
    return snapshot_download(
        repo_id=repo_id, repo_type="dataset", revision=revision, cache_dir=cache_dir, allow_patterns=patterns
    )


# ---- listing ------------------------------------------------------------------------------------
def list_shards(spec: str | os.PathLike | list, hub_cache_dir: str | None = None) -> list[Shard]:
    """Expand a source spec into shards, in a stable sorted order.

    ``spec``: a file, a directory (searched recursively), a glob pattern,
    ``hf://datasets/owner/name[@revision][/path]`` (see :func:`parse_hub_spec`), or a list of
    these. Without a path the whole repo is read, every split together; a path (file, directory
    or glob inside the repo, e.g. ``data/train-*.parquet``) selects one, and only its files are
    downloaded.
    """
    if isinstance(spec, (list, tuple)):
        out: list[Shard] = []
        for s in spec:
            out.extend(list_shards(s, hub_cache_dir))
        return out
    spec = os.fspath(spec)
    if spec.startswith("hf://datasets/"):
        repo_id, rev, sub = parse_hub_spec(spec)
        local = resolve_hub_dataset(repo_id, rev, hub_cache_dir, sub)
        spec = os.path.join(local, sub) if sub else local
    if os.path.isdir(spec):
        files, ignored = [], []
        for root, dirs, names in os.walk(spec, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for n in names:
                if not n.startswith("."):
                    (files if _kind_of(n) else ignored).append(os.path.join(root, n))
        files.sort()
        if not files:
            raise DataError(f"{spec}: directory holds no supported files ({', '.join(SUPPORTED_EXTS)})")
        if ignored:
            ignored.sort()
            shown = ", ".join(os.path.relpath(f, spec) for f in ignored[:5]) + (", ..." if len(ignored) > 5 else "")
            warnings.warn(f"{spec}: {len(ignored)} file(s) that are not data files were not read: {shown} "
                          f"(data files: {', '.join(SUPPORTED_EXTS)})", stacklevel=2)
    elif os.path.isfile(spec):
        files = [spec]
    else:
        files = sorted(glob.glob(spec, recursive=True))
        if not files:
            raise DataError(f"{spec}: no such file, directory or matching glob")
    shards = []
    for f in files:
        kind = _kind_of(f)
        if kind is None:
            raise DataError(f"{f}: unsupported file type (supported: {', '.join(SUPPORTED_EXTS)})")
        shards.append(Shard(os.path.abspath(f), kind))
    return shards


def shard_fingerprint(path: str, full_hash: bool = False) -> str:
    """Content fingerprint of a file (see the module docstring for what it covers and why)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(f"{size}:".encode())
    with open(path, "rb") as f:
        if full_hash or size <= 3 << 20:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            return f"sha256:{h.hexdigest()}"
        h.update(f.read(1 << 20))
        for i in range(16):
            f.seek((size - (64 << 10)) * (i + 1) // 17)
            h.update(f.read(64 << 10))
        f.seek(size - (1 << 20))
        h.update(f.read(1 << 20))
    return f"sampled-sha256:{h.hexdigest()}"


# ---- readers ------------------------------------------------------------------------------------
# A raw item is (payload, location, form): form "line" (bytes of one JSON object), "text" (bytes of
# a whole text document) or "record" (an already-decoded dict: a Parquet row, a JSON document).
RawItem = tuple[Any, str, str]
_WS = re.compile(r"[ \t\n\r]*")


def _iter_lines(stream, where: str) -> Iterator[RawItem]:
    for lineno, line in enumerate(stream, 1):
        if line.strip():
            yield line, f"{where}:{lineno}", "line"


def _iter_json(data: bytes, where: str, report: SkipReport) -> Iterator[RawItem]:
    """Objects of a JSON document: an array of objects, one object, or a sequence of objects."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        report.add("invalid_utf8", where, f"byte {e.start}: {e.reason}; the file's records are lost "
                   "(how many is unknown)", n=None)
        return
    dec = json.JSONDecoder()
    line, line_pos = 1, 0

    def at(pos):  # "where:line" of a character position (positions only move forward)
        nonlocal line, line_pos
        line += text.count("\n", line_pos, pos)
        line_pos = pos
        return f"{where}:{line}"

    n_read = 0

    def cut(pos, msg):
        report.add("malformed_json", at(pos), f"{msg}; {n_read} records read before it, the rest of the file "
                   "is lost (how many records is unknown)", n=None)

    pos = _WS.match(text).end()
    array = pos < len(text) and text[pos] == "["
    if array:
        pos = _WS.match(text, pos + 1).end()
    while pos < len(text):
        if array and text[pos] == "]":
            pos = _WS.match(text, pos + 1).end()
            if pos < len(text):
                cut(pos, "content after the closing ']' of the top-level array")
            return
        try:
            obj, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            cut(e.pos, f"{e.msg} at column {e.colno}")
            return
        loc = at(pos)
        if isinstance(obj, dict):
            n_read += 1
            yield obj, loc, "record"
        else:
            report.add("malformed_json", loc, f"expected a JSON object, got {type(obj).__name__}")
        pos = _WS.match(text, end).end()
        if array and pos < len(text):
            if text[pos] == ",":
                pos = _WS.match(text, pos + 1).end()
            elif text[pos] != "]":
                cut(pos, "expected ',' or ']' after an array element")
                return
    if array:
        cut(pos, "the top-level array is not closed (file cut short?)")


def _iter_parquet(source, where: str, report: SkipReport) -> Iterator[RawItem]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(source)  # a corrupt footer raises here: the row count is unknown
    md, start = pf.metadata, 0
    for g in range(md.num_row_groups):  # group by group: a corrupt one costs its own rows only
        n_g, got = md.row_group(g).num_rows, 0
        try:
            for batch in pf.iter_batches(batch_size=4096, row_groups=[g]):
                for rec in batch.to_pylist():
                    got += 1
                    yield rec, f"{where}:row {start + got}", "record"
        except (OSError, pa.ArrowException) as e:  # the footer counts the rows: the loss is known
            report.add("unreadable_file", f"{where}:rows {start + got + 1}-{start + n_g} (row group {g})",
                       f"{type(e).__name__}: {e}".replace("\n", " ").strip(), n=n_g - got)
        start += n_g


def _iter_file(f, name: str, where: str, kind: str, report: SkipReport) -> Iterator[RawItem]:
    """Items of one data file (on disk or a tar member) given as a binary file object."""
    if kind == "parquet":
        yield from _iter_parquet(f if isinstance(f, str) else pa.BufferReader(f.read()), where, report)
        return
    if isinstance(f, str):
        f = open(f, "rb")  # closed by the with below
    with f:
        stream = gzip.GzipFile(fileobj=f) if name.lower().endswith(".gz") else f
        if kind == "jsonl":
            yield from _iter_lines(stream, where)
        elif kind == "json":
            yield from _iter_json(stream.read(), where, report)
        elif kind == "text":
            yield stream.read(), f"{where}:1", "text"
        else:
            raise DataError(f"{where}: unknown data kind {kind!r}")


def _safe_member(name: str) -> bool:
    parts = name.replace("\\", "/").split("/")
    return not (name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":") or ".." in parts)


def _wds_key(name: str) -> tuple[str, str]:
    """webdataset's split of a member name: ``dir/000017.en.txt`` -> (``dir/000017``, ``en.txt``)."""
    d, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{d}/{stem}" if d else stem), ext


def _count_records(data: bytes, name: str, kind: str) -> int | None:
    """How many records a refused member holds (read from memory, never used); None if unreadable."""
    try:
        return sum(1 for _ in _iter_file(io.BytesIO(data), name, name, kind, SkipReport(strict=False)))
    except Exception:
        return None


class _Sample:
    """The members of one webdataset sample, buffered until its key changes."""

    def __init__(self, path: str):
        self.path, self.key, self.members = path, None, []  # members: (name, ext, kind, bytes)

    def flush(self, report: SkipReport) -> Iterator[RawItem]:
        members, self.members, self.key = self.members, [], None
        if len(members) == 1:  # a lone member is a file of its own (a .json may hold an array)
            name, _, kind, data = members[0]
            yield from _iter_file(io.BytesIO(data), name, f"{self.path}!{name}", kind, report)
        elif members:
            yield from self._merge(members, report)

    def _merge(self, members, report: SkipReport) -> Iterator[RawItem]:
        key = _wds_key(members[0][0])[0]
        where = f"{self.path}!{key}.{{{','.join(m[1] for m in members)}}}"
        rec: dict[str, Any] = {}
        for name, ext, kind, data in members:
            try:
                text = (gzip.decompress(data) if name.lower().endswith(".gz") else data).decode("utf-8")
            except UnicodeDecodeError as e:
                report.add("invalid_utf8", f"{where} ({name})", f"byte {e.start}: {e.reason}")
                return
            except (OSError, EOFError, zlib.error) as e:
                report.add("unreadable_file", f"{where} ({name})", f"{type(e).__name__}: {e}")
                return
            if kind == "json":
                try:
                    fields = json.loads(text)
                except json.JSONDecodeError as e:
                    report.add("malformed_json", f"{where} ({name}:{e.lineno})", f"{e.msg} at column {e.colno}")
                    return
                if not isinstance(fields, dict):
                    report.add("malformed_json", f"{where} ({name})",
                               f"a sample's .json must be one object, got {type(fields).__name__}")
                    return
            else:
                fld = ext[: -len(".gz")] if ext.lower().endswith(".gz") else ext
                fields = {"text" if fld == "txt" else fld: text}
            dup = sorted(set(fields) & set(rec))
            if dup:
                report.add("bad_field", where, f"field(s) {dup} given by more than one member of the sample")
                return
            rec.update(fields)
        yield rec, where, "record"


def _iter_tar(path: str, report: SkipReport) -> Iterator[RawItem]:
    sample = _Sample(path)
    data_exts = ", ".join(e for k in _MEMBER_KINDS for e in _EXTS[k])
    with tarfile.open(path, mode="r|*") as tf:  # stream mode: members are read in order, never extracted
        for member in tf:
            name = member.name
            where = f"{path}!{name}"
            if member.isdir():
                continue
            if member.issym() or member.islnk():
                report.add("unsafe_tar_member", where, "links inside tar shards are refused", n=None)
                continue
            if not member.isfile():
                report.add("unsupported_tar_member", where, f"not a regular file (tar type {member.type!r})", n=None)
                continue
            kind = _kind_of(name)
            if not _safe_member(name):
                n = _count_records(tf.extractfile(member).read(), name, kind) if kind in _MEMBER_KINDS else None
                report.add("unsafe_tar_member", where, "absolute path or '..' in member name; refused", n=n)
                continue
            if kind not in _MEMBER_KINDS:
                report.add("unsupported_tar_member", where, f"not a data member (data members: {data_exts})", n=None)
                continue
            key = _wds_key(name)[0]
            if sample.members and key != sample.key:
                yield from sample.flush(report)
            if kind in ("json", "text"):  # may be one field of a webdataset sample: buffer it
                sample.key = key
                sample.members.append((name, _wds_key(name)[1], kind, tf.extractfile(member).read()))
                continue
            yield from sample.flush(report)
            f = tf.extractfile(member)
            try:
                yield from _iter_file(f, name, where, kind, report)
            except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # this member's own gzip layer is broken
                report.add("unreadable_file", f"{where} (after the last record read from it)",
                           f"{type(e).__name__}: {e}; the rest of the member is lost (how many records is unknown)",
                           n=None)
        yield from sample.flush(report)


def iter_raw(shard: Shard, report: SkipReport) -> Iterator[RawItem]:
    """Stream a shard's raw items (undecoded) with their locations; see the module docstring.

    A file that cannot be read to its end (truncated gzip or tar, corrupt Parquet) is reported as
    ``unreadable_file`` at the last location reached, with the number of records read before it;
    the items before it are kept.
    """
    where, n = shard.path, 0
    try:
        if shard.kind == "tar":
            items = _iter_tar(shard.path, report)
        else:
            items = _iter_file(shard.path, shard.path, shard.path, shard.kind, report)
        for item in items:
            where, n = item[1], n + 1
            yield item
    except _UNREADABLE as e:
        report.add("unreadable_file", f"{where} (after this point)" if n else where,
                   f"{type(e).__name__}: {e}; {n} records read before it, the rest of the file is lost "
                   "(how many records is unknown)", n=None)


def decode_item(item: RawItem, report: SkipReport) -> dict | None:
    """Decode one raw item into a record dict, or report it and return None."""
    payload, where, form = item
    if form == "record":
        return payload
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as e:
        report.add("invalid_utf8", where, f"byte {e.start}: {e.reason}")
        return None
    if form == "text":
        return {"text": text}
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        report.add("malformed_json", where, f"{e.msg} at column {e.colno}")
        return None
    if not isinstance(rec, dict):
        report.add("malformed_json", where, f"expected a JSON object, got {type(rec).__name__}")
        return None
    return rec


def iter_records(spec, report: SkipReport | None = None) -> Iterator[tuple[dict, str]]:
    """Yield ``(record, location)`` for every decodable record of every shard of ``spec``."""
    report = report if report is not None else SkipReport(strict=True)
    for shard in list_shards(spec):
        for item in iter_raw(shard, report):
            rec = decode_item(item, report)
            if rec is not None:
                yield rec, item[1]
