"""Raw record sources: JSONL (+ .gz), Parquet, plain text, tar shards, hub dataset repos.

A *shard* is one file on disk (a .jsonl, .jsonl.gz, .parquet, .txt or .tar file); the token
cache tokenizes and stores each shard separately, so adding shards to a corpus only tokenizes
the new ones. ``list_shards(spec)`` expands a path, a directory (recursively, sorted), a glob,
or ``hf://datasets/owner/name[@revision][/path or glob]`` into shards; ``iter_raw(shard)`` streams the shard's
*raw items* — undecoded bytes for line/text formats, dicts for Parquet — each with a location
string ``file:line`` (``file!member:line`` inside a tar). ``decode_item`` turns a raw item into a
record dict; it is split from reading so that decoding and JSON parsing run in the tokenizer
worker processes, not in the reader.

Formats
    ``*.jsonl``, ``*.jsonl.gz``   one JSON object per line (blank lines are skipped)
    ``*.parquet``                 one record per row (read in row groups with pyarrow)
    ``*.txt``                     the whole file is one document: ``{"text": ...}``
    ``*.tar``, ``*.tar.gz``, ``*.tgz``  streamed with ``tarfile`` mode ``r|*`` (never extracted to
                                  disk); members ``.jsonl`` / ``.txt`` as above. A member with
                                  an absolute path or a ``..`` component, or a link, is refused.

Errors. Every problem (malformed JSON, invalid UTF-8, unsafe tar member, unreadable or
truncated file; missing fields and empty documents are found by the formatter) is reported
through a :class:`SkipReport`: in strict mode the first one raises :class:`DataError` naming the
file, line and reason; in lenient mode the record is skipped and counted by reason, with the
first few locations kept. Nothing is dropped silently.

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
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

__all__ = [
    "DataError",
    "SkipReport",
    "Shard",
    "list_shards",
    "iter_raw",
    "decode_item",
    "iter_records",
    "resolve_hub_dataset",
    "shard_fingerprint",
]

LINE_EXTS = (".jsonl", ".jsonl.gz")
TEXT_EXTS = (".txt",)
PARQUET_EXTS = (".parquet",)
TAR_EXTS = (".tar", ".tar.gz", ".tgz")
SUPPORTED_EXTS = LINE_EXTS + TEXT_EXTS + PARQUET_EXTS + TAR_EXTS


class DataError(ValueError):
    """A bad record or file; the message names the location (file:line) and the reason."""


@dataclass
class SkipReport:
    """Counts of skipped records per reason, with the first ``keep`` locations of each.

    ``strict=True`` turns the first :meth:`add` into a :class:`DataError`.
    """

    strict: bool = True
    keep: int = 5
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, location: str, detail: str = "") -> None:
        msg = f"{location}: {reason}" + (f": {detail}" if detail else "")
        if self.strict:
            raise DataError(msg + " (use lenient mode to skip and count such records)")
        self.counts[reason] = self.counts.get(reason, 0) + 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < self.keep:
            ex.append(msg)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def merge(self, other: SkipReport | dict) -> None:
        d = other.to_dict() if isinstance(other, SkipReport) else other
        for reason, n in d.get("counts", {}).items():
            self.counts[reason] = self.counts.get(reason, 0) + n
        for reason, ex in d.get("examples", {}).items():
            mine = self.examples.setdefault(reason, [])
            mine.extend(ex[: max(0, self.keep - len(mine))])

    def to_dict(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "examples": {k: list(v) for k, v in self.examples.items()}}

    def __str__(self) -> str:
        if not self.counts:
            return "no records skipped"
        lines = [f"{self.total} records skipped:"]
        for reason, n in sorted(self.counts.items()):
            lines.append(f"  {reason}: {n}")
            lines.extend(f"    {e}" for e in self.examples.get(reason, []))
        return "\n".join(lines)


@dataclass(frozen=True)
class Shard:
    """One source file; ``kind`` is ``jsonl`` | ``text`` | ``parquet`` | ``tar``."""

    path: str
    kind: str


def _kind_of(path: str) -> str | None:
    p = path.lower()
    if p.endswith(LINE_EXTS):
        return "jsonl"
    if p.endswith(TEXT_EXTS):
        return "text"
    if p.endswith(PARQUET_EXTS):
        return "parquet"
    if p.endswith(TAR_EXTS):
        return "tar"
    return None


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


def list_shards(spec: str | os.PathLike | list, hub_cache_dir: str | None = None) -> list[Shard]:
    """Expand a source spec into shards, in a stable sorted order.

    ``spec``: a file, a directory (searched recursively), a glob pattern,
    ``hf://datasets/owner/name[@revision][/path]``, or a list of these. Without a path the whole
    repo is read, every split together; a path (file, directory or glob inside the repo, e.g.
    ``data/train-*.parquet``) selects one, and only its files are downloaded.
    """
    if isinstance(spec, (list, tuple)):
        out: list[Shard] = []
        for s in spec:
            out.extend(list_shards(s, hub_cache_dir))
        return out
    spec = os.fspath(spec)
    if spec.startswith("hf://datasets/"):
        owner, _, rest = spec[len("hf://datasets/") :].partition("/")
        name_rev, _, sub = rest.partition("/")
        name, _, rev = name_rev.partition("@")
        local = resolve_hub_dataset(f"{owner}/{name}", rev or None, hub_cache_dir, sub or None)
        spec = os.path.join(local, sub) if sub else local
    if os.path.isdir(spec):
        files = []
        for root, dirs, names in os.walk(spec, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            files.extend(os.path.join(root, n) for n in names if _kind_of(n) and not n.startswith("."))
        files.sort()
        if not files:
            raise DataError(f"{spec}: directory holds no supported files ({', '.join(SUPPORTED_EXTS)})")
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


# A raw item is (payload, location, is_text_doc): payload is bytes (a JSON line or a whole text
# document) or an already-decoded dict (Parquet row).
RawItem = tuple[Any, str, bool]


def _iter_lines(stream: io.BufferedIOBase, where: str) -> Iterator[RawItem]:
    for lineno, line in enumerate(stream, 1):
        if line.strip():
            yield line, f"{where}:{lineno}", False


def _safe_member(name: str) -> bool:
    parts = name.replace("\\", "/").split("/")
    return not (name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":") or ".." in parts)


def iter_raw(shard: Shard, report: SkipReport) -> Iterator[RawItem]:
    """Stream a shard's raw items (undecoded) with their locations; see the module docstring.

    A file that cannot be read to its end (truncated gzip or tar, corrupt Parquet) is reported as
    ``unreadable_file`` at the last location reached; the items before it are kept.
    """
    where = shard.path
    try:
        for item in _iter_raw(shard, report):
            where = item[1]
            yield item
    except (OSError, EOFError, zlib.error, tarfile.TarError, pa.ArrowException) as e:
        report.add("unreadable_file", f"{where} (after this point)" if where != shard.path else where,
                   f"{type(e).__name__}: {e}")


def _iter_raw(shard: Shard, report: SkipReport) -> Iterator[RawItem]:
    path = shard.path
    if shard.kind == "jsonl":
        opener = gzip.open if path.lower().endswith(".gz") else open
        with opener(path, "rb") as f:
            yield from _iter_lines(f, path)
    elif shard.kind == "text":
        with open(path, "rb") as f:
            yield f.read(), f"{path}:1", True
    elif shard.kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        row = 0
        for batch in pf.iter_batches(batch_size=4096):
            for rec in batch.to_pylist():
                row += 1
                yield rec, f"{path}:row {row}", False
    elif shard.kind == "tar":
        with tarfile.open(path, mode="r|*") as tf:  # stream mode: members are read in order, never extracted
            for member in tf:
                where = f"{path}!{member.name}"
                if member.issym() or member.islnk():
                    report.add("unsafe_tar_member", where, "links inside tar shards are refused")
                    continue
                if not member.isfile():
                    continue
                if not _safe_member(member.name):
                    report.add("unsafe_tar_member", where, "absolute path or '..' in member name; refused")
                    continue
                kind = _kind_of(member.name)
                if kind not in ("jsonl", "text"):
                    continue
                f = tf.extractfile(member)
                if member.name.lower().endswith(".gz"):
                    f = gzip.GzipFile(fileobj=f)
                if kind == "jsonl":
                    yield from _iter_lines(f, where)
                else:
                    yield f.read(), f"{where}:1", True
    else:
        raise DataError(f"{path}: unknown shard kind {shard.kind!r}")


def decode_item(item: RawItem, report: SkipReport) -> dict | None:
    """Decode one raw item into a record dict, or report it and return None."""
    payload, where, is_text = item
    if isinstance(payload, dict):
        return payload
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as e:
        report.add("invalid_utf8", where, f"byte {e.start}: {e.reason}")
        return None
    if is_text:
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
