"""Arrow token cache: tokenize a corpus once in N processes, then read it memory-mapped, zero-copy.

Layout of a cache directory::

    manifest.json                 settings + ordered list of shard keys (written last)
    shards/<key>.arrow            Arrow IPC file, one record batch with the columns
                                  input_ids: large_list<uint16|uint32>, loss_mask: large_list<uint8>,
                                  and one int64 per document for each extra column (see below)
    shards/<key>.json             shard metadata: source, counts, skip report, stats, size, hashes

One cache shard per source shard; ``key = sha256(source fingerprint, tokenizer JSON, format
settings, read limits when not the default)``, so a second build with the same inputs is a hit,
and adding source shards tokenizes only the new ones.

What the cache checks about a source (``full_hash``). Sources are recognised by content, never
by name or modification time. By default (``full_hash=False``) the fingerprint is the file's
size plus a SHA-256 of every byte for files up to 3 MiB, and of 18 sampled blocks (~3 MiB) for
larger ones (``shards.shard_fingerprint``): an in-place edit of a larger file that keeps its
size and touches no sampled block is *not* noticed, and the old tokens are reused.
``full_hash=True`` (``python -m ftlib.data build --full-hash``) hashes every byte of every source
at each build (one full read of the corpus) and notices any change. The manifest records which
(``fingerprint_mode``: ``sampled-sha256`` | ``sha256``), and ``python -m ftlib.data info`` prints it. Token ids are stored as uint16 when the vocabulary has at most
65536 entries, else uint32. The large_list offsets are the per-document offsets: document i of
a shard is ``values[offsets[i]:offsets[i+1]]``, a NumPy view into the memory map.

Skips. Each shard has one :class:`~ftlib.data.report.SkipReport`, fed by the reader (a cut
gzip or tar, a corrupt Parquet file, a refused tar member) and by the workers (malformed
records, missing fields); it is stored in the shard's metadata and the cache's report is their
sum (``cache.report``), so ``build --lenient`` prints every skip. A strict build never reuses a
shard whose report is not empty: it reads the source again, and raises at the first problem.

Formatter hook. ``config`` is any frozen dataclass with ``fingerprint() -> str`` and
``formatter(tokenizer) -> callable``; the callable maps ``(record, location, report)`` to a
:class:`~ftlib.data.formatting.FormattedDoc`, a list of them (one record giving several
documents, e.g. the two sides of a preference pair), or None. A config may declare
``columns`` (a tuple of names): each document then carries one int per name in
``FormattedDoc.extra`` (a pair id, a side), stored as an int64 column and read back as
``cache.columns[name]`` (n_docs,). A formatter's ``stats`` dict of int counters (truncations)
is summed per shard into the metadata and over shards into ``cache.stats``.

Crash safety and integrity. Each file is written to ``.<name>.tmp-<pid>``, fsynced and
``os.replace``d into place (``ftlib._atomic``); the metadata is written after its Arrow file
and the manifest after all shards, so an interrupted build never leaves a cache that opens
as valid. A write that fails (a full disk) raises :class:`CacheError` naming the file and the source
shard it was for. The metadata records the file's size, its full SHA-256 and the sampled fingerprint of
``shards.shard_fingerprint``; opening checks the size and the sampled hash
(``verify="sample"``, ~3 MiB read per shard) or the full hash (``verify="full"``) and raises
:class:`CacheError` naming the file on any mismatch, and naming the file and field when a
manifest or metadata file is cut short or lacks a field.

One builder at a time. ``build_cache`` holds ``<cache_dir>/.lock`` (an exclusive ``flock``, with the
holder's pid, host and start time written in it) from listing the sources to opening the finished
cache: a second build of the same directory (another process, or the same command started twice)
prints that it waits, naming the holder, and starts when the first is done, reusing what it wrote.
Without the lock two builders both exited 0 and one's summary described a manifest the other had
replaced. The kernel releases the lock when its holder exits, killed or not, so no stale lock is
left behind. Readers take no lock: the manifest is replaced atomically and shard files are never
removed.

Tokenization runs in ``num_proc`` worker processes (``multiprocessing``; the tokenizer travels
as its JSON string, ``Tokenizer.to_str`` / ``from_str``, and each worker sets
``TOKENIZERS_PARALLELISM=false`` so the Rust thread pool does not oversubscribe the cores). The
reader streams raw lines to the workers in ~1 MiB chunks with a bounded in-flight window; workers
decode, parse and format a chunk (a formatter with ``format_batch(records, report)``, such as
``FormatConfig``'s, tokenizes the whole chunk in one batch), and return ids already in the cache dtype. A shard's chunks
are held until its last one, joined and streamed into the Arrow file (no in-memory copy of the
file), so host memory peaks near twice the shard's cache size (3 bytes/token with uint16), not
at int64 copies of it.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import socket
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

try:
    import fcntl
except ImportError:  # not POSIX: builds of one directory are not serialised there
    fcntl = None

from .._atomic import atomic_write
from .._dist import from_rank0, get_rank, get_world_size
from .formatting import FormatConfig
from .readers import ReadLimits, decode_item, item_nbytes, iter_raw
from .report import DataError, SkipReport
from .shards import Shard, list_shards, shard_fingerprint

__all__ = ["CacheError", "TokenCache", "build_cache", "open_cache", "prepare_cache"]

CACHE_VERSION = 2  # 2: shard metadata carries the reader's skips and the formatter's stats
_CHUNK_BYTES = 1 << 20
_CHUNK_ITEMS = 4096


class CacheError(RuntimeError):
    """A missing, truncated or altered cache file; the message names it."""


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---- worker side ------------------------------------------------------------------------------
_W: dict[str, Any] = {}


@dataclass
class _Chunk:
    """What a worker returns for one chunk of a shard's raw items."""

    shard: int  # index into the build's shard list
    last: bool  # the shard's last chunk
    ids: np.ndarray  # (n_tokens,) in the cache dtype
    mask: np.ndarray  # (n_tokens,) uint8
    lengths: np.ndarray  # (n_docs,) int64
    columns: dict[str, np.ndarray]  # name -> (n_docs,) int64
    report: dict  # SkipReport.to_dict() of this chunk
    stats: dict[str, int]  # formatter counters added by this chunk
    nbytes: int  # raw bytes read (progress)


def _worker_init(tok_json: str, config, strict: bool, dtype: str = "uint32", in_worker: bool = True) -> None:
    if in_worker:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    with warnings.catch_warnings():  # the parent already warned once about the settings
        warnings.simplefilter("ignore")
        _W["fmt"] = config.formatter(Tokenizer.from_str(tok_json))
    _W["columns"] = tuple(getattr(config, "columns", ()))
    _W["strict"] = strict
    _W["dtype"] = np.dtype(dtype)


def _work(task) -> _Chunk:
    """Decode, format and tokenize one chunk ``(shard_idx, items, nbytes, last)``."""
    shard_idx, items, nbytes, last = task
    fmt, cols, dtype = _W["fmt"], _W["columns"], _W["dtype"]
    report = SkipReport(strict=_W["strict"])
    stats0 = dict(getattr(fmt, "stats", {}))
    ids, masks, lens = [], [], []
    extra: dict[str, list[int]] = {c: [] for c in cols}

    def records():
        for item in items:
            rec = decode_item(item, report)
            if rec is not None:
                yield rec, item[1]

    batch = getattr(fmt, "format_batch", None)  # one encode_batch per chunk (formatting.Formatter)
    try:
        outs = batch(records(), report) if batch is not None else [(where, fmt(rec, where, report))
                                                                   for rec, where in records()]
    except DataError:
        raise
    except Exception:  # a record the formatter or tokenizer fails on: find it, keep the others
        report = SkipReport(strict=_W["strict"])
        if isinstance(getattr(fmt, "stats", None), dict):
            fmt.stats.update(stats0)
        outs = []
        for rec, where in records():
            try:
                outs.append((where, fmt(rec, where, report)))
            except DataError:
                raise
            except Exception as e:  # strict: one line naming file:line; lenient: skipped and counted there
                report.add("format_error", where, f"{type(e).__name__}: {e}".replace("\n", " ")[:300])
    for where, out in outs:
        for doc in [] if out is None else out if isinstance(out, list) else [out]:
            got = tuple(sorted(doc.extra)) if doc.extra else ()
            if got != tuple(sorted(cols)):
                raise ValueError(f"{where}: the formatter gave columns {list(got)}, the config declares "
                                 f"{list(cols)}")
            ids.append(doc.input_ids)
            masks.append(doc.loss_mask)
            lens.append(len(doc.input_ids))
            for c in cols:
                extra[c].append(int(doc.extra[c]))
    # ids leave the worker in the cache's dtype: a shard waits in the parent until its last chunk,
    # and int64 there would take 4x (uint16) the memory of the finished cache
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    if len(flat) and (flat.min() < 0 or flat.max() > np.iinfo(dtype).max):
        raise ValueError(f"{items[0][1]} (chunk starting here): token id {int(flat.max())} does not fit the "
                         f"cache dtype {dtype}")
    masks_flat = np.concatenate(masks).astype(np.uint8, copy=False) if masks else np.zeros(0, np.uint8)
    stats = {k: v - stats0.get(k, 0) for k, v in getattr(fmt, "stats", {}).items()}
    return _Chunk(shard_idx, last, flat.astype(dtype), masks_flat, np.asarray(lens, np.int64),
                  {c: np.asarray(v, np.int64) for c, v in extra.items()}, report.to_dict(), stats, nbytes)


# ---- writer -----------------------------------------------------------------------------------
@dataclass
class _ShardBuild:
    """One shard being built: its single skip report (reader + workers), chunks and stats."""

    shard: Shard
    fingerprint: str
    report: SkipReport
    chunks: list[_Chunk] = field(default_factory=list)
    stats: collections.Counter = field(default_factory=collections.Counter)

    def add(self, chunk: _Chunk) -> None:
        self.report.merge(chunk.report)  # a strict worker has raised already; merging never does
        self.stats.update(chunk.stats)
        self.chunks.append(chunk)

    def write(self, shards_dir: str, key: str, columns: tuple, dtype: np.dtype) -> dict:
        parts, self.chunks = self.chunks, []
        ids, mask, lens = (np.concatenate([getattr(p, a) for p in parts]) for a in ("ids", "mask", "lengths"))
        cols = {c: np.concatenate([p.columns[c] for p in parts]) for c in columns}
        del parts  # the chunks are copied: free them before writing
        meta = {"source": self.shard.path, "source_fingerprint": self.fingerprint,
                "skipped": self.report.to_dict(), "stats": dict(self.stats), "columns": list(columns)}
        return _write_shard(shards_dir, key, meta, ids, mask, lens, cols, dtype)


def _write(path: str, write, what: str) -> None:
    """``atomic_write(path, write)``; an OSError (a full disk) becomes a CacheError naming ``path``."""
    try:
        atomic_write(path, write)
    except (OSError, pa.ArrowException) as e:
        raise CacheError(f"{path}: could not write {what}: {type(e).__name__}: {e} (disk full or not writable? "
                         "free space on that disk or build the cache elsewhere)") from e


def _write_shard(shards_dir: str, key: str, meta: dict, ids: np.ndarray, mask: np.ndarray,
                 lengths: np.ndarray, columns: dict[str, np.ndarray], dtype: np.dtype) -> dict:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    off = pa.array(offsets, type=pa.int64())
    batch = pa.record_batch(  # pa.array of a NumPy array without nulls wraps its buffer (no copy)
        [pa.LargeListArray.from_arrays(off, pa.array(ids.astype(dtype, copy=False))),
         pa.LargeListArray.from_arrays(off, pa.array(mask))] + [pa.array(v, type=pa.int64()) for v in columns.values()],
        names=["input_ids", "loss_mask", *columns],
    )
    arrow_path = os.path.join(shards_dir, key + ".arrow")
    written = {}

    def write(tmp):  # streamed to the temporary file (no in-memory copy of the shard), then hashed
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as w:
            w.write_batch(batch)
        written.update(size=os.path.getsize(tmp), sha=_sha256_file(str(tmp)), sampled=shard_fingerprint(str(tmp)))

    _write(arrow_path, write, f"the cache shard of {meta['source']}")
    size, sha, sampled = written["size"], written["sha"], written["sampled"]
    meta = dict(meta, n_docs=int(len(lengths)), n_tokens=int(offsets[-1]), size=size, sha256=sha, sampled=sampled)
    _write(os.path.join(shards_dir, key + ".json"), lambda tmp: tmp.write_bytes(json.dumps(meta, indent=1).encode()),
           f"the shard metadata of {meta['source']}")
    return meta


# ---- metadata files -----------------------------------------------------------------------------
_META_FIELDS = {"n_docs": int, "n_tokens": int, "size": int, "sha256": str, "sampled": str, "skipped": dict,
                "stats": dict, "columns": list}


def _load_json(path: str, what: str) -> dict:
    """A metadata JSON object; CacheError naming the file when it is missing, cut or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise CacheError(f"{path}: {what} missing; rebuild the cache") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheError(f"{path}: {what} unreadable or cut short ({e}); delete the cache and rebuild") from None
    if not isinstance(d, dict):
        raise CacheError(f"{path}: {what} must be a JSON object, got {type(d).__name__}; delete the cache and rebuild")
    return d


def _require(d: dict, path: str, fields: dict) -> None:
    for k, t in fields.items():
        if k not in d:
            raise CacheError(f"{path}: field {k!r} missing (written by another version, or altered); "
                             "delete the cache and rebuild")
        if not isinstance(d[k], t) or isinstance(d[k], bool):
            raise CacheError(f"{path}: field {k!r} must be {t.__name__}, got {type(d[k]).__name__}; "
                             "delete the cache and rebuild")


def _load_meta(path: str) -> dict:
    meta = _load_json(path, "shard metadata")
    _require(meta, path, _META_FIELDS)
    return meta


def _check_file(path: str, meta: dict, verify: str) -> None:
    if not os.path.exists(path):
        raise CacheError(f"{path}: cache file missing; rebuild the cache")
    size = os.path.getsize(path)
    if size != meta["size"]:
        raise CacheError(f"{path}: cache file is {size} bytes, expected {meta['size']} "
                         "(truncated or altered); delete it and rebuild")
    if verify == "sample" and shard_fingerprint(path) != meta["sampled"]:
        raise CacheError(f"{path}: cache file content hash mismatch (altered); delete it and rebuild")
    if verify == "full" and _sha256_file(path) != meta["sha256"]:
        raise CacheError(f"{path}: cache file SHA-256 mismatch (altered); delete it and rebuild")


def _reusable(shards_dir: str, key: str) -> dict | None:
    """Metadata of an already-built shard if it is present and intact, else None (rebuilt)."""
    try:
        meta = _load_meta(os.path.join(shards_dir, key + ".json"))
        _check_file(os.path.join(shards_dir, key + ".arrow"), meta, "sample")
        return meta
    except (OSError, CacheError):
        return None


# ---- build ------------------------------------------------------------------------------------
LOCK = ".lock"


def _holder(fd: int) -> str:
    """The lock holder's record, as words."""
    try:
        d = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        d = {}
    if not isinstance(d, dict) or "pid" not in d:
        return "a build that has not written its name yet"
    return f"pid {d.get('pid')} on host {d.get('host')!r}, since {d.get('started')}"


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def _build_lock(cache_dir: str):
    """Hold ``<cache_dir>/.lock`` (module doc): wait, saying for whom, while another build holds it."""
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a read-only directory: the build's first write raises CacheError naming it
        yield
        return
    try:
        if fcntl is not None:
            t0, got = time.monotonic(), _try_flock(fd)
            while not got and time.monotonic() - t0 < 2.0:  # the ranks of one run reopening a finished
                time.sleep(0.05)  # cache hold it for a moment each: no message for that
                got = _try_flock(fd)
            if not got:
                print(f"{cache_dir}: another build holds this cache directory ({_holder(fd)}; lock file {path}); "
                      "waiting for it to finish", file=sys.stderr, flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)
                print(f"{cache_dir}: the other build finished after {time.monotonic() - t0:.1f}s; building",
                      file=sys.stderr, flush=True)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def prepare_cache(sources, tokenizer, config: FormatConfig, cache_dir: str, *, num_proc: int = 1,
                  strict: bool = True, progress: bool = True) -> TokenCache:
    """``build_cache`` for every rank of a job: rank 0 tokenizes, the other ranks open its cache.

    One process (no torch.distributed): ``build_cache(...)``. Under torch.distributed (collective:
    every rank calls it) rank 0 builds with ``num_proc`` processes and ``progress``; the others wait
    for it, then open the finished cache (``build_cache`` again, which reuses every shard). A build
    that fails on rank 0 fails on every rank with rank 0's message (a :class:`DataError`, or
    ``FileNotFoundError`` for a missing source), so no rank waits for a cache that never comes.
    """
    if get_world_size() == 1:
        return build_cache(sources, tokenizer, config, cache_dir, num_proc=num_proc, strict=strict, progress=progress)
    error = None
    if get_rank() == 0:
        try:
            build_cache(sources, tokenizer, config, cache_dir, num_proc=num_proc, strict=strict, progress=progress)
        except (DataError, FileNotFoundError) as e:
            error = [type(e).__name__, str(e)]
    error = from_rank0(error)  # also the barrier: the cache is whole when it returns
    if error is not None:
        raise (FileNotFoundError if error[0] == "FileNotFoundError" else DataError)(error[1])
    return build_cache(sources, tokenizer, config, cache_dir, num_proc=1, strict=strict, progress=False)


def build_cache(sources, tokenizer, config: FormatConfig, cache_dir: str, *, num_proc: int = 1,
                strict: bool = True, progress: bool = True, full_hash: bool = False,
                mp_context: str | None = None, verify: str = "sample",
                limits: ReadLimits | None = None) -> TokenCache:
    """Tokenize ``sources`` (see ``shards.list_shards``) into ``cache_dir`` and open it.

    Shards whose cache files already exist (same content, tokenizer, settings) are reused, except
    that a strict build reads again a shard from which a lenient build skipped anything (so it
    raises). ``strict=False`` skips bad records and reports every skip, the reader's included,
    in ``cache.report``. ``config``: a :class:`FormatConfig` or another config following the
    formatter hook of the module docstring. ``mp_context``: multiprocessing start method
    (default: ``fork`` on Linux, the platform default elsewhere).

    ``full_hash``: what identifies a source. Default False: size + SHA-256 of the whole file up
    to 3 MiB, of ~3 MiB of sampled blocks above that (a same-size edit outside the samples is not
    noticed); True: SHA-256 of every byte (module docstring). ``limits``: the most bytes one
    record may take when read (``readers.ReadLimits``, default 16 MiB per record, 1 GiB per
    whole-parsed document); larger records are refused and reported.

    A build that gives no document at all raises :class:`~ftlib.data.report.DataError` naming the
    inputs (and what was skipped); no manifest is written then.

    One build per ``cache_dir`` at a time: while another holds ``<cache_dir>/.lock`` this one says
    so on stderr, naming the holder, and waits (module doc).
    """
    shards = list_shards(sources)
    config.formatter(tokenizer)  # validate settings (special tokens etc.) and warn once, before any work
    with _build_lock(cache_dir):
        return _build(sources, shards, tokenizer, config, cache_dir, num_proc=num_proc, strict=strict,
                      progress=progress, full_hash=full_hash, mp_context=mp_context, verify=verify, limits=limits)


def _build(sources, shards: list[Shard], tokenizer, config: FormatConfig, cache_dir: str, *, num_proc: int,
           strict: bool, progress: bool, full_hash: bool, mp_context: str | None, verify: str,
           limits: ReadLimits | None) -> TokenCache:
    """``build_cache`` once the sources are listed and the settings checked, holding the directory's lock."""
    tok_json = tokenizer.to_str()
    tok_hash = hashlib.sha256(tok_json.encode()).hexdigest()
    fmt_fp = config.fingerprint()
    fmt_class = f"{type(config).__module__}.{type(config).__qualname__}"
    columns = tuple(getattr(config, "columns", ()))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 65536 else np.uint32)
    shards_dir = os.path.join(cache_dir, "shards")
    os.makedirs(shards_dir, exist_ok=True)

    keys, metas, todo = [], {}, []
    limits = limits if limits is not None else ReadLimits()
    # the read limits decide which records are refused: part of the key, except the defaults (so
    # caches built before the limits existed stay valid)
    lim = "" if limits == ReadLimits() else f"|limits={limits.max_record_bytes},{limits.max_file_bytes}"
    for i, sh in enumerate(shards):
        fp = shard_fingerprint(sh.path, full_hash)
        key = hashlib.sha256(f"{CACHE_VERSION}|{fp}|{tok_hash}|{fmt_class}|{fmt_fp}|{dtype}{lim}".encode()).hexdigest()[:32]
        keys.append(key)
        meta = _reusable(shards_dir, key)
        if meta is not None and strict:
            skipped = SkipReport(strict=False)
            skipped.merge(meta["skipped"])
            if skipped:
                meta = None  # a lenient build lost records here: strict mode reads it again to raise on the first
        if meta is not None:
            metas[i] = meta
        else:
            todo.append((i, sh, fp))

    builds: dict[int, _ShardBuild] = {}

    def tasks():
        for i, sh, fp in todo:
            b = builds[i] = _ShardBuild(sh, fp, SkipReport(strict=strict))
            items, nbytes = [], 0
            for item in iter_raw(sh, b.report, limits):  # the reader's skips go to the shard's one report
                items.append(item)
                nbytes += item_nbytes(item[0])  # Parquet rows arrive as dicts: measure them too
                if nbytes >= _CHUNK_BYTES or len(items) >= _CHUNK_ITEMS:
                    yield i, items, nbytes, False
                    items, nbytes = [], 0
            yield i, items, nbytes, True

    if todo:
        from tqdm.auto import tqdm

        total = sum(os.path.getsize(sh.path) for _, sh, _ in todo)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not progress)

        def handle(chunk: _Chunk):
            b = builds[chunk.shard]
            b.add(chunk)
            bar.update(chunk.nbytes)
            if chunk.last:  # the reader finished this shard before its last chunk was sent
                metas[chunk.shard] = b.write(shards_dir, keys[chunk.shard], columns, dtype)
                del builds[chunk.shard]

        if num_proc <= 1:
            _worker_init(tok_json, config, strict, dtype.name, in_worker=False)
            for t in tasks():
                handle(_work(t))
        else:
            method = mp_context or ("fork" if sys.platform.startswith("linux") else None)
            ctx = mp.get_context(method)
            with ctx.Pool(num_proc, initializer=_worker_init, initargs=(tok_json, config, strict, dtype.name)) as pool:
                pending: collections.deque = collections.deque()
                for t in tasks():  # bounded window keeps memory flat and results in order
                    pending.append(pool.apply_async(_work, (t,)))
                    while len(pending) >= 4 * num_proc:
                        handle(pending.popleft().get())
                while pending:
                    handle(pending.popleft().get())
        bar.close()

    manifest = {
        "version": CACHE_VERSION, "tokenizer_sha256": tok_hash, "format_class": fmt_class,
        "format_config": asdict(config), "format_fingerprint": fmt_fp, "columns": list(columns),
        "dtype": dtype.name, "vocab_size": vocab,
        "fingerprint_mode": "sha256" if full_hash else "sampled-sha256",
        "shards": [{"source": sh.path, "key": k} for sh, k in zip(shards, keys)],
        "n_docs": int(sum(metas[i]["n_docs"] for i in range(len(shards)))),
        "n_tokens": int(sum(metas[i]["n_tokens"] for i in range(len(shards)))),
    }
    if manifest["n_docs"] == 0:
        skipped = SkipReport(strict=False)
        for i in range(len(shards)):
            skipped.merge(metas[i]["skipped"])
        names = ", ".join(sh.path for sh in shards[:5]) + (", ..." if len(shards) > 5 else "")
        src = sources if isinstance(sources, (str, os.PathLike)) else ", ".join(map(str, sources))
        raise DataError(f"{src}: the build gave 0 documents from {len(shards)} file(s) ({names}); no cache "
                        f"written to {cache_dir}. {skipped}")
    _write(os.path.join(cache_dir, "manifest.json"),
           lambda tmp: tmp.write_bytes(json.dumps(manifest, indent=1).encode()), "the cache manifest")
    for i, sh, _ in todo:  # fields the format does not read: said once per source, when it is tokenized
        unread = SkipReport(strict=False)
        unread.merge({"unread": metas[i]["skipped"].get("unread", {})})
        if unread.unread:
            warnings.warn(f"{sh.path}: {unread.unread_text()}", stacklevel=2)
    cache = TokenCache(cache_dir, verify=verify)
    cache.n_built = len(todo)
    return cache


# ---- reader -----------------------------------------------------------------------------------
class TokenCache:
    """A built cache, memory-mapped. ``cache[i] -> (input_ids, loss_mask)`` NumPy views.

    ``lengths`` (n_docs,) int64; ``n_tokens``; ``report`` (the build's SkipReport, every shard's
    skips); ``stats`` (formatter counters, e.g. ``n_truncated``, ``n_truncated_tokens``);
    ``n_truncated``; ``columns`` (extra per-document int64 columns); ``dtype``. Pickles as its
    path, so DataLoader workers reopen it.
    """

    def __init__(self, cache_dir: str, verify: str = "sample"):
        if verify not in ("none", "size", "sample", "full"):
            raise ValueError(f"verify must be none|size|sample|full, got {verify!r}")
        self.path = cache_dir
        mpath = os.path.join(cache_dir, "manifest.json")
        if not os.path.exists(mpath):
            raise CacheError(f"{cache_dir}: no manifest.json (not a cache, or its build did not finish)")
        self.manifest = _load_json(mpath, "cache manifest")
        if self.manifest.get("version") != CACHE_VERSION:
            raise CacheError(f"{mpath}: cache version {self.manifest.get('version')}, expected {CACHE_VERSION}; "
                             "build the cache again")
        _require(self.manifest, mpath, {"dtype": str, "shards": list, "columns": list})
        try:
            self.dtype = np.dtype(self.manifest["dtype"])
        except TypeError:
            raise CacheError(f"{mpath}: field 'dtype' is not a NumPy dtype: {self.manifest['dtype']!r}") from None
        names = list(self.manifest["columns"])
        self.report = SkipReport(strict=False)
        self.stats: collections.Counter = collections.Counter()
        self.n_built = 0
        self._ids, self._mask, self._off = [], [], []
        cols: dict[str, list] = {c: [] for c in names}
        sdir = os.path.join(cache_dir, "shards")
        for j, s in enumerate(self.manifest["shards"]):
            if not isinstance(s, dict) or not isinstance(s.get("key"), str):
                raise CacheError(f"{mpath}: field 'shards'[{j}] needs a string 'key'; delete the cache and rebuild")
            apath = os.path.join(sdir, s["key"] + ".arrow")
            meta = _load_meta(os.path.join(sdir, s["key"] + ".json"))
            if verify != "none":
                _check_file(apath, meta, verify)
            mm = None
            try:
                mm = pa.memory_map(apath, "r")
                batch = pa.ipc.open_file(mm).get_batch(0)
                ids_col, mask_col = batch.column("input_ids"), batch.column("loss_mask")
                extra = [batch.column(c).to_numpy(zero_copy_only=True) for c in names]
            except (OSError, KeyError, pa.ArrowException) as e:
                if mm is not None:
                    mm.close()
                raise CacheError(f"{apath}: not a readable Arrow IPC file of this cache ({e}); delete it and "
                                 "rebuild") from e
            off = ids_col.offsets.to_numpy(zero_copy_only=True)
            ids = ids_col.values.to_numpy(zero_copy_only=True)
            mask = mask_col.values.to_numpy(zero_copy_only=True)
            if (len(off) != meta["n_docs"] + 1 or int(off[-1]) != len(ids) or len(ids) != len(mask)
                    or any(len(x) != meta["n_docs"] for x in extra)):
                raise CacheError(f"{apath}: inconsistent offsets/values (corrupt); delete it and rebuild")
            # the arrays keep the mapping alive; the file handle goes now, so a cache of any number of shards
            # holds no open files (1,500 shards under ulimit -n 1024 open; each mapping is one memory region)
            mm.close()
            self._ids.append(ids)
            self._mask.append(mask)
            self._off.append(off)
            for c, x in zip(names, extra):
                cols[c].append(x)
            self.report.merge(meta["skipped"])
            self.stats.update(meta["stats"])
        self.columns = {c: np.concatenate(v) if v else np.zeros(0, np.int64) for c, v in cols.items()}
        counts = np.array([len(o) - 1 for o in self._off], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self.lengths = (np.concatenate([np.diff(o) for o in self._off]) if self._off
                        else np.zeros(0, np.int64)).astype(np.int64)
        self.n_tokens = int(self.lengths.sum())

    @property
    def n_truncated(self) -> int:
        return int(self.stats.get("n_truncated", 0))

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} out of range [0, {len(self)})")
        s = int(np.searchsorted(self._starts, i, side="right")) - 1
        j = i - int(self._starts[s])
        a, b = int(self._off[s][j]), int(self._off[s][j + 1])
        return self._ids[s][a:b], self._mask[s][a:b]

    def shard_arrays(self):
        """Per shard: (offsets, token ids, loss mask) zero-copy NumPy arrays."""
        return list(zip(self._off, self._ids, self._mask))

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"], verify="none")


def open_cache(cache_dir: str, verify: str = "sample") -> TokenCache:
    """Open a built cache (see :class:`TokenCache`); raises CacheError if it is incomplete or corrupt."""
    return TokenCache(cache_dir, verify=verify)
