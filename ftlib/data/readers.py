"""Record readers: a shard's raw items (JSONL, JSON, Parquet, plain text, each optionally gzipped; tar
shards incl. webdataset samples) and their decoding into record dicts.

``iter_raw(shard, report)`` streams the shard's *raw items* (shards: ``ftlib.data.shards``) —
undecoded bytes for line and text formats, dicts for Parquet rows and JSON documents — each with a
location string ``file:line`` (``file!member:line`` inside a tar). ``decode_item`` turns a raw item
into a record dict; it is split from reading so that decoding and JSON parsing of JSON Lines run in
the tokenizer worker processes, not in the reader. ``iter_records(spec)`` does both for a spec.
The formats and how a tar is read: ``ftlib.data.shards``.

Encoding. Text is UTF-8. A UTF-8 byte order mark (BOM) at the start of a file or tar member
(after gzip decompression) is removed, the same for every format; one anywhere else is content
(in JSON, outside a string, it is malformed JSON).

Empty files. A data file (or tar member read as a file, or a tar shard) that holds no record
— zero bytes, only whitespace, ``[]``, zero Parquet rows — is reported as ``empty_file``
(counted per file; it lost no records); in strict mode it raises like any other problem.

Bounds (:class:`ReadLimits`). No record is read into memory whole past a bound:
``max_record_bytes`` (default 16 MiB) for one JSON Lines line, one ``.txt`` document, one
webdataset member (after decompression) and one Parquet row (its strings; pyarrow reads a row
group whole, so there the bound keeps the row from the tokenizer, not from memory);
``max_file_bytes`` (default 1 GiB) for what must be parsed whole (a ``.json`` document, a
Parquet tar member). A record over its bound is reported
as ``record_too_large`` (its bytes are read past and dropped, never held), a document over its
bound as ``file_too_large``; raise the bound to keep them. A gzip bomb stops at the bound.

Errors. Every problem (malformed JSON, invalid UTF-8, a refused tar member, a file that cannot
be read to its end; missing fields and empty documents are found by the formatter) goes to a
:class:`~ftlib.data.report.SkipReport`: in strict mode the first one raises
:class:`~ftlib.data.report.DataError` naming the file, line and reason; in lenient mode it is
counted with the number of records it cost — known for a bad record, a refused member (its
records are counted, not read as data) or a corrupt Parquet file (its footer gives the row
count); unknown for a gzip, tar or JSON stream cut short, where the report states how many
records were read before the cut. Nothing is dropped silently. A record holding a lone UTF-16
surrogate (``"\ud800"``: no UTF-8 for it, the tokenizer would fail on its whole batch) is an
``invalid_unicode`` skip, JSON nested past Python's recursion limit a ``malformed_json`` one (in a
``.json`` document as a cut: where it ends is unknown), and any other exception a record raises
while it is formatted or encoded a ``format_error`` (``ftlib.data.cache`` formats that chunk record
by record to find it): each at its file:line, the other records kept.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from .report import DataError, SkipReport
from .shards import KIND_EXTS, Shard, list_shards, shard_kind

__all__ = [
    "RawItem",
    "ReadLimits",
    "decode_item",
    "item_nbytes",
    "iter_raw",
    "iter_records",
]

_MEMBER_KINDS = ("jsonl", "json", "text", "parquet")  # what a tar member may hold
_UNREADABLE = (OSError, EOFError, zlib.error, tarfile.TarError, pa.ArrowException)


_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class ReadLimits:
    """The most bytes read into memory for one record / one whole-parsed document (module docstring)."""

    max_record_bytes: int = 16 << 20
    max_file_bytes: int = 1 << 30

    def __post_init__(self):
        for name in ("max_record_bytes", "max_file_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ReadLimits.{name} must be a positive int (bytes), got {v!r}")


_DEFAULT_LIMITS = ReadLimits()


# ---- readers ------------------------------------------------------------------------------------
# A raw item is (payload, location, form): form "line" (bytes of one JSON object), "text" (bytes of
# a whole text document) or "record" (an already-decoded dict: a Parquet row, a JSON document).
RawItem = tuple[Any, str, str]
_WS = re.compile(r"[ \t\n\r]*")
# a JSON escape of a UTF-16 surrogate: only text holding one can decode to a lone surrogate (a valid pair
# decodes to one code point)
_SURROGATE_ESCAPE = re.compile(r"\\[uU][dD][89a-fA-F]")
_SURROGATE_ESCAPE_B = re.compile(rb"\\[uU][dD][89a-fA-F]")


def _lone_surrogate(obj, path: str = "") -> str | None:
    """Where in a decoded record a string holds a lone surrogate (no UTF-8 for it: the tokenizer would
    fail on the whole batch), e.g. ``field 'messages'[1]['content'] (U+D800)``; None when nowhere.
    Iterative, so a deeply nested record cannot overflow the stack."""
    stack = [(obj, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                return f"field {p} (U+{ord(v[e.start]):04X} at character {e.start})"
        elif isinstance(v, dict):
            stack.extend((x, f"{p}[{k!r}]" if p else repr(k)) for k, x in v.items())
            stack.extend((k, f"{p} key") for k in v if isinstance(k, str))
        elif isinstance(v, list):
            stack.extend((x, f"{p}[{i}]") for i, x in enumerate(v))
    return None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.4g} MiB"


def _read_at_most(stream, limit: int) -> bytes | None:
    """All of ``stream`` if it holds at most ``limit`` bytes, else None (reading stops at limit + 1)."""
    data = stream.read(limit + 1)
    return None if len(data) > limit else data


def _too_large(report: SkipReport, where: str, what: str, limits: ReadLimits, record: bool) -> None:
    field = "max_record_bytes" if record else "max_file_bytes"
    bound = getattr(limits, field)
    report.add("record_too_large" if record else "file_too_large", where,
               f"{what} is over ReadLimits.{field}={bound} ({_mib(bound)}); not read. Raise the bound "
               f"(--{field.replace('_', '-')}) to keep it", n=1 if record else None)


def _iter_lines(stream, where: str, report: SkipReport, limits: ReadLimits) -> Iterator[RawItem]:
    """Non-blank lines; a line over ``max_record_bytes`` is read past in 1 MiB steps, never held."""
    limit, lineno = limits.max_record_bytes, 0
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        lineno += 1
        if lineno == 1 and line.startswith(_BOM):
            line = line[len(_BOM):]
        if len(line) > limit and not line.endswith(b"\n"):
            n = len(line)
            while line and not line.endswith(b"\n"):
                line = stream.readline(1 << 20)
                n += len(line)
            _too_large(report, f"{where}:{lineno}", f"a line of {n} bytes", limits, record=True)
        elif line.strip():
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
    surrogates = _SURROGATE_ESCAPE.search(text) is not None

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
        except RecursionError:  # where it ends is unknown: as a cut
            cut(pos, "JSON nested too deep to parse (a value inside arrays/objects thousands of levels deep)")
            return
        loc = at(pos)
        bad = _lone_surrogate(obj) if isinstance(obj, dict) and surrogates else None
        if bad:
            report.add("invalid_unicode", loc, f"a lone UTF-16 surrogate in {bad}: not text")
        elif isinstance(obj, dict):
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


def item_nbytes(obj) -> int:
    """Size of a raw item's payload: bytes as is, a decoded record by its strings (8 per other value).
    Iterative: a deeply nested record cannot overflow the stack."""
    n, stack = 0, [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, (bytes, str)):
            n += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        else:
            n += 8
    return n


def _iter_parquet(source, where: str, report: SkipReport, limits: ReadLimits) -> Iterator[RawItem]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(source)  # a corrupt footer raises here: the row count is unknown
    md, start = pf.metadata, 0
    for g in range(md.num_row_groups):  # group by group: a corrupt one costs its own rows only
        n_g, got = md.row_group(g).num_rows, 0
        try:
            for batch in pf.iter_batches(batch_size=4096, row_groups=[g]):
                for rec in batch.to_pylist():
                    got += 1
                    if item_nbytes(rec) > limits.max_record_bytes:  # kept from the tokenizer like a long line
                        _too_large(report, f"{where}:row {start + got}", f"a row of {item_nbytes(rec)} bytes",
                                   limits, record=True)
                        continue
                    yield rec, f"{where}:row {start + got}", "record"
        except (OSError, pa.ArrowException) as e:  # the footer counts the rows: the loss is known
            report.add("unreadable_file", f"{where}:rows {start + got + 1}-{start + n_g} (row group {g})",
                       f"{type(e).__name__}: {e}".replace("\n", " ").strip(), n=n_g - got)
        start += n_g


def _marks(report: SkipReport) -> tuple:
    """What ``report`` has counted so far (to tell whether a reader reported anything)."""
    return report.total, report.n_unknown, sum(report.notes.values())


def _nonempty(items: Iterator[RawItem], where: str, report: SkipReport) -> Iterator[RawItem]:
    """``items``, and ``empty_file`` reported for ``where`` if there were none and nothing else was reported."""
    before, n = _marks(report), 0
    for item in items:
        n += 1
        yield item
    if n == 0 and _marks(report) == before:
        report.add("empty_file", where, "it holds no records (empty, only whitespace, [] or 0 rows)", n=0)


def _iter_file(f, name: str, where: str, kind: str, report: SkipReport,
               limits: ReadLimits = _DEFAULT_LIMITS) -> Iterator[RawItem]:
    """Items of one data file (on disk or a tar member) given as a path or a binary file object."""
    yield from _nonempty(_iter_file_items(f, name, where, kind, report, limits), where, report)


def _iter_file_items(f, name, where, kind, report, limits) -> Iterator[RawItem]:
    if kind == "parquet":
        yield from _iter_parquet(f if isinstance(f, str) else pa.BufferReader(f.read()), where, report, limits)
        return
    if isinstance(f, str):
        f = open(f, "rb")  # closed by the with below
    with f:
        stream = gzip.GzipFile(fileobj=f) if name.lower().endswith(".gz") else f
        if kind == "jsonl":
            yield from _iter_lines(stream, where, report, limits)
        elif kind == "json":
            data = _read_at_most(stream, limits.max_file_bytes)
            if data is None:
                _too_large(report, where, "the JSON document", limits, record=False)
                return
            yield from _iter_json(data, where, report)  # utf-8-sig: a leading BOM is dropped there
        elif kind == "text":
            data = _read_at_most(stream, limits.max_record_bytes)
            if data is None:
                _too_large(report, f"{where}:1", "the text document", limits, record=True)
            elif data.strip():  # a whitespace-only document is an empty file (reported by _nonempty)
                yield data[len(_BOM):] if data.startswith(_BOM) else data, f"{where}:1", "text"
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


def _count_records(data: bytes, name: str, kind: str, limits: ReadLimits) -> int | None:
    """How many records a refused member holds (read from memory, never used); None if unreadable."""
    try:
        return sum(1 for _ in _iter_file(io.BytesIO(data), name, name, kind, SkipReport(strict=False), limits))
    except Exception:
        return None


class _Sample:
    """The members of one webdataset sample, buffered until its key changes."""

    def __init__(self, path: str, limits: ReadLimits):
        self.path, self.key, self.members = path, None, []  # members: (name, ext, kind, bytes)
        self.limits = limits

    def flush(self, report: SkipReport) -> Iterator[RawItem]:
        members, self.members, self.key = self.members, [], None
        if len(members) == 1:  # a lone member is a file of its own (a .json may hold an array)
            name, _, kind, data = members[0]
            yield from _iter_file(io.BytesIO(data), name, f"{self.path}!{name}", kind, report, self.limits)
        elif members:
            yield from self._merge(members, report)

    def _merge(self, members, report: SkipReport) -> Iterator[RawItem]:
        key = _wds_key(members[0][0])[0]
        where = f"{self.path}!{key}.{{{','.join(m[1] for m in members)}}}"
        rec: dict[str, Any] = {}
        for name, ext, kind, data in members:
            try:
                if name.lower().endswith(".gz"):  # bounded: a gzip bomb stops at the bound
                    data = _read_at_most(gzip.GzipFile(fileobj=io.BytesIO(data)), self.limits.max_record_bytes)
                    if data is None:
                        _too_large(report, f"{where} ({name})", "the decompressed member", self.limits, record=True)
                        return
                text = data.decode("utf-8-sig")  # a leading BOM is dropped, as in every reader
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
                except RecursionError:
                    report.add("malformed_json", f"{where} ({name})", "nested too deep to parse")
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


def _iter_tar(path: str, report: SkipReport, limits: ReadLimits) -> Iterator[RawItem]:
    sample = _Sample(path, limits)
    data_exts = ", ".join(e for k in _MEMBER_KINDS for e in KIND_EXTS[k])
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
            kind = shard_kind(name)
            if not _safe_member(name):
                n = (_count_records(tf.extractfile(member).read(), name, kind, limits)
                     if kind in _MEMBER_KINDS and member.size <= limits.max_file_bytes else None)
                report.add("unsafe_tar_member", where, "absolute path or '..' in member name; refused", n=n)
                continue
            if kind not in _MEMBER_KINDS:
                report.add("unsupported_tar_member", where, f"not a data member (data members: {data_exts})", n=None)
                continue
            key = _wds_key(name)[0]
            if sample.members and key != sample.key:
                yield from sample.flush(report)
            # what is read whole into memory: a .txt is one record, a .json (a lone one may hold an
            # array) and a Parquet member are parsed whole; jsonl members are streamed line by line
            record = kind == "text"
            if kind != "jsonl" and member.size > (limits.max_record_bytes if record else limits.max_file_bytes):
                _too_large(report, where, f"a member of {member.size} bytes", limits, record=record)
                continue
            if kind in ("json", "text"):  # may be one field of a webdataset sample: buffer it
                sample.key = key
                sample.members.append((name, _wds_key(name)[1], kind, tf.extractfile(member).read()))
                continue
            yield from sample.flush(report)
            f = tf.extractfile(member)
            try:
                yield from _iter_file(f, name, where, kind, report, limits)
            except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # this member's own gzip layer is broken
                report.add("unreadable_file", f"{where} (after the last record read from it)",
                           f"{type(e).__name__}: {e}; the rest of the member is lost (how many records is unknown)",
                           n=None)
        yield from sample.flush(report)


def iter_raw(shard: Shard, report: SkipReport, limits: ReadLimits | None = None) -> Iterator[RawItem]:
    """Stream a shard's raw items (undecoded) with their locations; see the module docstring.

    A file that cannot be read to its end (truncated gzip or tar, corrupt Parquet) is reported as
    ``unreadable_file`` at the last location reached, with the number of records read before it;
    the items before it are kept. ``limits`` bound what one record may take (default
    :class:`ReadLimits`).
    """
    limits = limits if limits is not None else _DEFAULT_LIMITS
    where, n = shard.path, 0
    try:
        if shard.kind == "tar":
            items = _nonempty(_iter_tar(shard.path, report, limits), shard.path, report)
        else:
            items = _iter_file(shard.path, shard.path, shard.path, shard.kind, report, limits)
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
    except RecursionError:
        report.add("malformed_json", where, "nested too deep to parse (arrays/objects thousands of levels deep)")
        return None
    if not isinstance(rec, dict):
        report.add("malformed_json", where, f"expected a JSON object, got {type(rec).__name__}")
        return None
    if _SURROGATE_ESCAPE_B.search(payload):
        bad = _lone_surrogate(rec)
        if bad:
            report.add("invalid_unicode", where, f"a lone UTF-16 surrogate in {bad}: not text")
            return None
    return rec


def iter_records(spec, report: SkipReport | None = None,
                 limits: ReadLimits | None = None) -> Iterator[tuple[dict, str]]:
    """Yield ``(record, location)`` for every decodable record of every shard of ``spec``."""
    report = report if report is not None else SkipReport(strict=True)
    for shard in list_shards(spec):
        for item in iter_raw(shard, report, limits):
            rec = decode_item(item, report)
            if rec is not None:
                yield rec, item[1]
