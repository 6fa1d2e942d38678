"""Best-fit-decreasing packing of documents into rows of ``seq_len`` tokens.

Items. A document of length L <= seq_len is one item. A longer one is either split
(``overflow="split"``: chunks ``[0, T), [T, 2T), ...``, the last one shorter; every chunk is its
own item and its own attention segment) or truncated (``overflow="truncate"``: the first T
tokens; the cut tokens are counted in the stats).

Best-fit decreasing (Johnson 1973; at most 11/9 OPT + 6/9 rows, Dósa 2007). Items are placed
in order of length decreasing; **ties are broken by item index ascending** (items are numbered
document by document, chunks in order, i.e. a stable sort on ``-length``). Each item goes into
the open row with the *least* remaining room that still fits; **among rows with equal room the
lowest row id wins**; when none fits a new row is opened (ids in opening order). Within a row,
pieces appear in placement order. The C++ kernel (``csrc/bfd_pack.cpp``, built on first use with
the system C++ compiler into ``$FTLIB_CACHE_DIR/csrc`` (default ``~/.cache/ftlib/csrc``) and
called through ctypes: this plain shared library built in 1.3 s where a one-function
``torch.utils.cpp_extension.load_inline`` module took 77 s, on the same loaded 2-core CPU, as it
compiles the torch headers) and the NumPy path below follow exactly these rules, so
their outputs are identical. ``FTLIB_PACK_BACKEND=auto|cpp|numpy`` forces one; forcing ``cpp``
without a compiler is an error.

Rows become a batch in ``ftlib.data.collate.collate_packed`` (the batch contract is stated
there); it is re-exported here for existing imports.
"""

from __future__ import annotations

import bisect
import ctypes
import heapq
from dataclasses import dataclass

import numpy as np

from .._backends import backend_choice
from .._cbuild import load_library
from .collate import collate_packed  # re-export: packed rows -> batch lives beside pad_collate

__all__ = ["PackPlan", "PackStats", "bfd_assign", "collate_packed", "cpp_available", "pack"]

_FN: list = []  # [ctypes function or None] once tried


def _build_cpp():
    """csrc/bfd_pack.cpp's function (built once per source hash by ``_cbuild``), or None."""
    if not _FN:
        lib = load_library("bfd_pack.cpp")
        fn = None
        if lib is not None:
            fn = lib.ftlib_bfd_assign
            fn.restype = ctypes.c_int64
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        _FN.append(fn)
    return _FN[0]


def cpp_available() -> bool:
    return _build_cpp() is not None


def _assign_numpy(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    heaps: dict[int, list[int]] = {}  # remaining room -> min-heap of row ids
    rooms: list[int] = []  # sorted rooms with a non-empty heap
    out = np.empty(len(lengths), dtype=np.int64)
    n_bins = 0
    for i, L in enumerate(lengths.tolist()):
        j = bisect.bisect_left(rooms, L)
        if j == len(rooms):
            b, rem = n_bins, capacity - L
            n_bins += 1
        else:
            room = rooms[j]
            h = heaps[room]
            b = heapq.heappop(h)
            if not h:
                del rooms[j]
            rem = room - L
        out[i] = b
        if rem > 0:
            h = heaps.setdefault(rem, [])
            if not h:
                bisect.insort(rooms, rem)
            heapq.heappush(h, b)
    return out, n_bins


def bfd_assign(lengths: np.ndarray, capacity: int, backend: str | None = None) -> tuple[np.ndarray, int]:
    """Row id per item for items already in placement order; returns (rows (n,) int64, n_rows)."""
    lengths = np.asarray(lengths)
    if lengths.size and lengths.dtype.kind not in "iu":  # a float length was truncated to another one
        raise ValueError(f"lengths must be integers (tokens per item), got dtype {lengths.dtype}")
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        bad = int(np.flatnonzero((lengths < 1) | (lengths > capacity))[0])
        raise ValueError(f"item {bad} has length {int(lengths[bad])}, outside [1, {capacity}]")
    backend = backend or backend_choice("FTLIB_PACK_BACKEND")
    if backend not in ("auto", "cpp", "numpy"):
        raise ValueError(f"packing backend must be auto|cpp|numpy, got {backend!r}")
    fn = _build_cpp() if backend in ("auto", "cpp") else None
    if backend == "cpp" and fn is None:
        raise RuntimeError("packing backend 'cpp' forced, but csrc/bfd_pack.cpp could not be built "
                           "(no C++ compiler found; set CXX)")
    if fn is None:
        return _assign_numpy(lengths, capacity)
    out = np.empty(len(lengths), dtype=np.int64)
    n_bins = fn(lengths.ctypes.data, len(lengths), capacity, out.ctypes.data)
    if n_bins < 0:
        raise ValueError(f"bfd_assign: invalid input (code {n_bins})")
    return out, int(n_bins)


@dataclass
class PackStats:
    n_docs: int
    n_rows: int
    n_tokens: int  # tokens placed in rows
    fill_ratio: float  # n_tokens / (n_rows * seq_len)
    n_split_docs: int  # documents longer than seq_len that were split
    n_truncated_docs: int
    n_truncated_tokens: int


@dataclass
class PackPlan:
    """Rows as CSR over pieces: row r holds pieces ``row_ptr[r]:row_ptr[r+1]``, each a slice
    ``[start, start + length)`` of document ``doc``."""

    seq_len: int
    row_ptr: np.ndarray  # (n_rows + 1,) int64
    doc: np.ndarray  # (n_pieces,) int64
    start: np.ndarray  # (n_pieces,) int64
    length: np.ndarray  # (n_pieces,) int64
    stats: PackStats

    @property
    def n_rows(self) -> int:
        return len(self.row_ptr) - 1

    def row(self, r: int) -> list[tuple[int, int, int]]:
        a, b = int(self.row_ptr[r]), int(self.row_ptr[r + 1])
        return list(zip(self.doc[a:b].tolist(), self.start[a:b].tolist(), self.length[a:b].tolist()))


def pack(lengths, seq_len: int, overflow: str = "split", backend: str | None = None) -> PackPlan:
    """Pack documents of ``lengths`` (n_docs,) into rows of ``seq_len`` (see the module docstring)."""
    if overflow not in ("split", "truncate"):
        raise ValueError(f"overflow must be split|truncate, got {overflow!r}")
    if seq_len < 1:
        raise ValueError("seq_len must be >= 1")
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.min() < 1:
        raise ValueError(f"document {int(np.argmin(lengths))} is empty; empty documents cannot be packed")
    if overflow == "split":
        n_items = (lengths + seq_len - 1) // seq_len  # chunks per document
        doc = np.repeat(np.arange(len(lengths)), n_items)
        first = np.repeat(np.cumsum(n_items) - n_items, n_items)
        start = (np.arange(len(doc)) - first) * seq_len
        length = np.minimum(lengths[doc] - start, seq_len)
        n_trunc_docs, n_trunc_tok = 0, 0
    else:
        doc = np.arange(len(lengths))
        start = np.zeros(len(lengths), dtype=np.int64)
        length = np.minimum(lengths, seq_len)
        n_trunc_docs, n_trunc_tok = int((lengths > seq_len).sum()), int((lengths - length).sum())
    # placement order: length desc, ties by item index. A uint16 key lets NumPy's stable sort use
    # radix sort: 26 ms vs 157 ms for the int64 timsort on 1M items.
    key = (seq_len - length).astype(np.uint16) if seq_len < 65536 else -length
    order = np.argsort(key, kind="stable")
    rows, n_rows = bfd_assign(length[order], seq_len, backend)
    perm = np.argsort(rows, kind="stable")  # group by row, keep placement order inside a row
    items = order[perm]
    row_ptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=n_rows), out=row_ptr[1:])
    n_tok = int(length.sum())
    stats = PackStats(
        n_docs=len(lengths), n_rows=n_rows, n_tokens=n_tok,
        fill_ratio=n_tok / (n_rows * seq_len) if n_rows else 1.0,
        n_split_docs=int((lengths > seq_len).sum()) if overflow == "split" else 0,
        n_truncated_docs=n_trunc_docs, n_truncated_tokens=n_trunc_tok,
    )
    return PackPlan(seq_len, row_ptr, doc[items], start[items], length[items], stats)
