"""Arrow token cache: tokenize a corpus once in N processes, then read it memory-mapped, zero-copy.

Layout of a cache directory::

    manifest.json                 settings + ordered list of shard keys (written last)
    shards/<key>.arrow            Arrow IPC file, one record batch with two columns
                                  input_ids: large_list<uint16|uint32>, loss_mask: large_list<uint8>
    shards/<key>.json             shard metadata: source, counts, skip report, size, hashes

One cache shard per source shard; ``key = sha256(source fingerprint, tokenizer JSON, format
settings)``, so a second build with the same inputs is a hit, and adding source shards
tokenizes only the new ones. Token ids are stored as uint16 when the vocabulary has at most
65536 entries, else uint32. The large_list offsets are the per-document offsets: document i of
a shard is ``values[offsets[i]:offsets[i+1]]``, a NumPy view into the memory map.

Crash safety and integrity. Each file is written to ``.<name>.tmp-<pid>``, fsynced and
``os.replace``d into place (``ftlib._atomic``); the metadata is written after its Arrow file
and the manifest after all shards, so an interrupted build never leaves a cache that opens
as valid. The metadata records the file's
size, its full SHA-256 and the sampled fingerprint of ``sources.shard_fingerprint``; opening
checks the size and the sampled hash (``verify="sample"``, ~3 MiB read per shard) or the full
hash (``verify="full"``) and raises :class:`CacheError` naming the file on any mismatch.

Tokenization runs in ``num_proc`` worker processes (``multiprocessing``; the tokenizer travels
as its JSON string, ``Tokenizer.to_str`` / ``from_str``, and each worker sets
``TOKENIZERS_PARALLELISM=false`` so the Rust thread pool does not oversubscribe the cores). The
reader streams raw lines to the workers in ~1 MiB chunks with a bounded in-flight window; workers
decode, parse, format and tokenize, and return ids already in the cache dtype. A shard's chunks
are held until its last one, joined and streamed into the Arrow file (no in-memory copy of the
file), so host memory peaks near twice the shard's cache size (3 bytes/token with uint16), not
at int64 copies of it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing as mp
import os
import sys
from dataclasses import asdict
from typing import Any

import numpy as np
import pyarrow as pa

from .._atomic import atomic_write
from .formatting import FormatConfig, Formatter
from .sources import SkipReport, decode_item, iter_raw, list_shards, shard_fingerprint

__all__ = ["CacheError", "TokenCache", "build_cache", "open_cache"]

CACHE_VERSION = 1
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


def _approx_nbytes(obj) -> int:
    """Size of a raw item's payload: bytes as is, a decoded record by its strings (chunking only)."""
    if isinstance(obj, (bytes, str)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(_approx_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_approx_nbytes(v) for v in obj)
    return 8


# ---- worker side ------------------------------------------------------------------------------
_W: dict[str, Any] = {}


def _formatter(config, tokenizer):
    """Formatter hook: a config with ``formatter(tokenizer)`` brings its own formatter (preference
    pairs, ``ftlib.data.pairs``). A config may declare ``columns`` (names): each document then
    carries one int per name in its ``extra`` dict, stored as an int64 column (``cache.columns``)."""
    make = getattr(config, "formatter", None)
    return make(tokenizer) if make is not None else Formatter(tokenizer, config)


def _worker_init(tok_json: str, cfg, strict: bool, dtype: str = "uint32", in_worker: bool = True) -> None:
    if in_worker:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    config = FormatConfig(**cfg) if isinstance(cfg, dict) else cfg
    _W["fmt"] = _formatter(config, Tokenizer.from_str(tok_json))
    _W["columns"] = tuple(getattr(config, "columns", ()))
    _W["strict"] = strict
    _W["dtype"] = np.dtype(dtype)


def _work(task):
    """(shard_idx, items, nbytes, last) -> (shard_idx, last, ids, mask, lengths, report, n_trunc, nbytes, columns)."""
    shard_idx, items, nbytes, last = task
    fmt: Formatter = _W["fmt"]
    report = SkipReport(strict=_W["strict"])
    n0 = fmt.n_truncated
    ids, masks, lens = [], [], []
    cols: dict[str, list[int]] = {c: [] for c in _W["columns"]}
    for item in items:
        rec = decode_item(item, report)
        if rec is None:
            continue
        doc = fmt(rec, item[1], report)
        if doc is None:
            continue
        ids.append(doc.input_ids)
        masks.append(doc.loss_mask)
        lens.append(len(doc.input_ids))
        for c in cols:
            cols[c].append(int(doc.extra[c]))
    # ids leave the worker in the cache's dtype: a shard waits in the parent until its last chunk,
    # and int64 there would take 4x (uint16) the memory of the finished cache
    dtype = _W["dtype"]
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    if len(flat) and (flat.min() < 0 or flat.max() > np.iinfo(dtype).max):
        raise ValueError(f"{items[0][1]} (chunk starting here): token id {int(flat.max())} does not fit the "
                         f"cache dtype {dtype}")
    masks_flat = np.concatenate(masks).astype(np.uint8, copy=False) if masks else np.zeros(0, np.uint8)
    return (shard_idx, last, flat.astype(dtype), masks_flat, np.asarray(lens, np.int64),
            report.to_dict(), fmt.n_truncated - n0, nbytes, {c: np.asarray(v, np.int64) for c, v in cols.items()})


# ---- writer -----------------------------------------------------------------------------------
def _write_shard(shards_dir: str, key: str, meta: dict, ids: np.ndarray, mask: np.ndarray,
                 lengths: np.ndarray, dtype: np.dtype, columns: dict | None = None) -> dict:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    off = pa.array(offsets, type=pa.int64())
    batch = pa.record_batch(  # pa.array of a NumPy array without nulls wraps its buffer (no copy)
        [pa.LargeListArray.from_arrays(off, pa.array(ids.astype(dtype, copy=False))),
         pa.LargeListArray.from_arrays(off, pa.array(mask))]
        + [pa.array(v, type=pa.int64()) for v in (columns or {}).values()],
        names=["input_ids", "loss_mask", *(columns or {})],
    )
    arrow_path = os.path.join(shards_dir, key + ".arrow")
    written = {}

    def write(tmp):  # streamed to the temporary file (no in-memory copy of the shard), then hashed
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as w:
            w.write_batch(batch)
        written.update(size=os.path.getsize(tmp), sha=_sha256_file(str(tmp)), sampled=shard_fingerprint(str(tmp)))

    atomic_write(arrow_path, write)
    size, sha, sampled = written["size"], written["sha"], written["sampled"]
    meta = dict(meta, n_docs=int(len(lengths)), n_tokens=int(offsets[-1]), size=size, sha256=sha, sampled=sampled)
    atomic_write(os.path.join(shards_dir, key + ".json"), lambda tmp: tmp.write_bytes(json.dumps(meta, indent=1).encode()))
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
    """Metadata of an already-built shard if it is present and intact, else None."""
    mpath = os.path.join(shards_dir, key + ".json")
    try:
        with open(mpath) as f:
            meta = json.load(f)
        _check_file(os.path.join(shards_dir, key + ".arrow"), meta, "sample")
        return meta
    except (OSError, ValueError, KeyError, CacheError):
        return None


def build_cache(sources, tokenizer, config: FormatConfig, cache_dir: str, *, num_proc: int = 1,
                strict: bool = True, progress: bool = True, full_hash: bool = False,
                mp_context: str | None = None, verify: str = "sample") -> TokenCache:
    """Tokenize ``sources`` (see ``sources.list_shards``) into ``cache_dir`` and open it.

    Shards whose cache files already exist (same content, tokenizer, settings) are reused, except
    that a strict build re-reads a shard from which a lenient build skipped records (so it raises).
    ``strict=False`` skips bad records and reports them in ``cache.report``. ``mp_context``:
    multiprocessing start method (default: ``fork`` on Linux, the platform default elsewhere).
    """
    shards = list_shards(sources)
    tok_json = tokenizer.to_str()
    tok_hash = hashlib.sha256(tok_json.encode()).hexdigest()
    fmt_fp = config.fingerprint()
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 65536 else np.uint32)
    _formatter(config, tokenizer)  # validate settings (special tokens etc.) before any work
    shards_dir = os.path.join(cache_dir, "shards")
    os.makedirs(shards_dir, exist_ok=True)

    keys, metas, todo = [], {}, []
    for i, sh in enumerate(shards):
        fp = shard_fingerprint(sh.path, full_hash)
        key = hashlib.sha256(f"{CACHE_VERSION}|{fp}|{tok_hash}|{fmt_fp}|{dtype}".encode()).hexdigest()[:32]
        keys.append(key)
        meta = _reusable(shards_dir, key)
        if meta is not None and strict and meta["skipped"]["counts"]:
            meta = None  # a lenient build dropped records here: strict mode re-reads it to raise on the first
        if meta is not None:
            metas[i] = meta
        else:
            todo.append((i, sh, fp))

    report = SkipReport(strict=strict)

    def tasks():
        for i, sh, _ in todo:
            items, nbytes = [], 0
            for item in iter_raw(sh, report):
                items.append(item)
                nbytes += _approx_nbytes(item[0])  # Parquet rows arrive as dicts: measure them too
                if nbytes >= _CHUNK_BYTES or len(items) >= _CHUNK_ITEMS:
                    yield i, items, nbytes, False
                    items, nbytes = [], 0
            yield i, items, nbytes, True

    if todo:
        from tqdm.auto import tqdm

        total = sum(os.path.getsize(sh.path) for _, sh, _ in todo)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not progress)
        acc: dict[int, list] = collections.defaultdict(list)
        info = {i: (sh, fp) for i, sh, fp in todo}

        def handle(res):
            i, last, ids, mask, lens, rep, ntr, nbytes, cols = res
            acc[i].append((ids, mask, lens, rep, ntr, cols))
            bar.update(nbytes)
            if not last:
                return
            parts = acc.pop(i)
            srep = SkipReport(strict=False)
            for p in parts:
                srep.merge(p[3])
            report.merge(srep)
            sh, fp = info[i]
            meta = {"source": sh.path, "source_fingerprint": fp, "skipped": srep.to_dict(),
                    "n_truncated": int(sum(p[4] for p in parts))}
            ids, mask, lens = (np.concatenate([p[j] for p in parts]) for j in range(3))
            cols = {c: np.concatenate([p[5][c] for p in parts]) for c in parts[0][5]}
            del parts  # the chunks are copied: free them before writing
            metas[i] = _write_shard(shards_dir, keys[i], meta, ids, mask, lens, dtype, cols)

        cfg = asdict(config) if isinstance(config, FormatConfig) else config
        if num_proc <= 1:
            _worker_init(tok_json, cfg, strict, dtype.name, in_worker=False)
            for t in tasks():
                handle(_work(t))
        else:
            method = mp_context or ("fork" if sys.platform.startswith("linux") else None)
            ctx = mp.get_context(method)
            with ctx.Pool(num_proc, initializer=_worker_init, initargs=(tok_json, cfg, strict, dtype.name)) as pool:
                pending: collections.deque = collections.deque()
                for t in tasks():  # bounded window keeps memory flat and results in order
                    pending.append(pool.apply_async(_work, (t,)))
                    while len(pending) >= 4 * num_proc:
                        handle(pending.popleft().get())
                while pending:
                    handle(pending.popleft().get())
        bar.close()

    manifest = {
        "version": CACHE_VERSION, "tokenizer_sha256": tok_hash, "format_config": asdict(config),
        "format_fingerprint": fmt_fp, "columns": list(getattr(config, "columns", ())), "dtype": dtype.name,
        "vocab_size": vocab,
        "fingerprint_mode": "sha256" if full_hash else "sampled-sha256",
        "shards": [{"source": sh.path, "key": k} for sh, k in zip(shards, keys)],
        "n_docs": int(sum(metas[i]["n_docs"] for i in range(len(shards)))),
        "n_tokens": int(sum(metas[i]["n_tokens"] for i in range(len(shards)))),
    }
    atomic_write(os.path.join(cache_dir, "manifest.json"), lambda tmp: tmp.write_bytes(json.dumps(manifest, indent=1).encode()))
    cache = TokenCache(cache_dir, verify=verify)
    cache.n_built = len(todo)
    return cache


# ---- reader -----------------------------------------------------------------------------------
class TokenCache:
    """A built cache, memory-mapped. ``cache[i] -> (input_ids, loss_mask)`` NumPy views.

    ``lengths`` (n_docs,) int64; ``n_tokens``; ``report`` (SkipReport of the build);
    ``n_truncated``; ``columns`` (a formatter hook's per-document int64 columns); ``dtype``. Pickles
    as its path, so DataLoader workers reopen it.
    """

    def __init__(self, cache_dir: str, verify: str = "sample"):
        if verify not in ("none", "size", "sample", "full"):
            raise ValueError(f"verify must be none|size|sample|full, got {verify!r}")
        self.path = cache_dir
        mpath = os.path.join(cache_dir, "manifest.json")
        if not os.path.exists(mpath):
            raise CacheError(f"{cache_dir}: no manifest.json (not a cache, or its build did not finish)")
        with open(mpath) as f:
            self.manifest = json.load(f)
        if self.manifest.get("version") != CACHE_VERSION:
            raise CacheError(f"{mpath}: cache version {self.manifest.get('version')}, expected {CACHE_VERSION}")
        self.dtype = np.dtype(self.manifest["dtype"])
        self.report = SkipReport(strict=False)
        self.n_truncated = 0
        self.n_built = 0
        self._ids, self._mask, self._off, self._maps = [], [], [], []
        cols: dict[str, list] = {c: [] for c in self.manifest.get("columns", [])}
        sdir = os.path.join(cache_dir, "shards")
        for s in self.manifest["shards"]:
            apath = os.path.join(sdir, s["key"] + ".arrow")
            try:
                with open(os.path.join(sdir, s["key"] + ".json")) as f:
                    meta = json.load(f)
            except (OSError, ValueError) as e:
                raise CacheError(f"{sdir}/{s['key']}.json: missing or unreadable shard metadata ({e})") from e
            if verify != "none":
                _check_file(apath, meta, verify)
            try:
                mm = pa.memory_map(apath, "r")
                batch = pa.ipc.open_file(mm).get_batch(0)
            except (OSError, pa.ArrowInvalid) as e:
                raise CacheError(f"{apath}: not a readable Arrow IPC file ({e}); delete it and rebuild") from e
            ids_col, mask_col = batch.column("input_ids"), batch.column("loss_mask")
            off = ids_col.offsets.to_numpy(zero_copy_only=True)
            ids = ids_col.values.to_numpy(zero_copy_only=True)
            mask = mask_col.values.to_numpy(zero_copy_only=True)
            if len(off) != meta["n_docs"] + 1 or int(off[-1]) != len(ids) or len(ids) != len(mask):
                raise CacheError(f"{apath}: inconsistent offsets/values (corrupt); delete it and rebuild")
            self._maps.append(mm)
            self._ids.append(ids)
            self._mask.append(mask)
            self._off.append(off)
            for c in cols:  # per-document int64 columns of a formatter hook
                cols[c].append(batch.column(c).to_numpy(zero_copy_only=True))
            self.report.merge(meta["skipped"])
            self.n_truncated += meta["n_truncated"]
        counts = np.array([len(o) - 1 for o in self._off], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self.lengths = (np.concatenate([np.diff(o) for o in self._off]) if self._off
                        else np.zeros(0, np.int64)).astype(np.int64)
        self.n_tokens = int(self.lengths.sum())
        self.columns = {c: np.concatenate(v) if v else np.zeros(0, np.int64) for c, v in cols.items()}

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

