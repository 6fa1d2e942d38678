"""Read tensors from a safetensors file straight into their final storage, one at a time.

Format (https://huggingface.co/docs/safetensors, "Format"):

    [8 bytes]  N, little-endian uint64: size of the header
    [N bytes]  JSON: {name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]},
                      "__metadata__": {str: str}}      (offsets relative to byte 8 + N)
    [rest]     raw little-endian tensor data

Why not ``safe_open(...).get_tensor``: on CPU it returns tensors that alias a
private memory map of the file (the mapping outlives the ``with`` block). Loading
then looks free, but the bytes are read at first touch, inside the first
training step, and the weights depend on the file staying intact: a checkpoint
truncated or rewritten in place under a running job turns pages not yet read
into SIGBUS or into different weights. Here each tensor is allocated once with
``torch.empty`` and filled with ``readinto``: when loading returns, the model
owns its memory (``benchmarks/bench_load.py``: peak RSS 1.00x the weights) and
the files may be replaced. Every offset is checked against the file size first,
so a truncated or corrupt file fails with its name and the tensor.

Header checks (those of the reference reader, safetensors 0.8): header length at most
100,000,000 bytes and inside the file; a JSON object whose ``__metadata__`` maps strings to
strings; every dtype the format defines; shapes and offsets non-negative integers; sorted by
offset, the tensors tile the data exactly (first at 0, each where the previous ends, the last at
the end of the file), each span holding exactly ``prod(shape) * bits / 8`` bytes.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys

import torch

__all__ = ["SafetensorsReader"]

# Every dtype the format defines (safetensors 0.8): name -> (torch dtype or None, bits per element).
# F4 is stored two to a byte and read as torch's packed ``float4_e2m1fn_x2`` (last dim halved), as
# the reference loader does; F6 has no torch dtype: its entries are checked but cannot be read.
_DTYPES: dict[str, tuple[torch.dtype | None, int]] = {
    "BOOL": (torch.bool, 8), "U8": (torch.uint8, 8), "I8": (torch.int8, 8),
    "F8_E5M2": (torch.float8_e5m2, 8), "F8_E4M3": (torch.float8_e4m3fn, 8),
    "F8_E8M0": (getattr(torch, "float8_e8m0fnu", None), 8),
    "F8_E4M3FNUZ": (getattr(torch, "float8_e4m3fnuz", None), 8),
    "F8_E5M2FNUZ": (getattr(torch, "float8_e5m2fnuz", None), 8),
    "I16": (torch.int16, 16), "U16": (getattr(torch, "uint16", None), 16),
    "F16": (torch.float16, 16), "BF16": (torch.bfloat16, 16),
    "I32": (torch.int32, 32), "U32": (getattr(torch, "uint32", None), 32), "F32": (torch.float32, 32),
    "C64": (torch.complex64, 64), "F64": (torch.float64, 64),
    "I64": (torch.int64, 64), "U64": (getattr(torch, "uint64", None), 64),
    "F4": (getattr(torch, "float4_e2m1fn_x2", None), 4),
    "F6_E2M3": (None, 6), "F6_E3M2": (None, 6),
}
_MAX_HEADER = 100_000_000  # the reference implementation's limit (bytes)


def _is_count(x) -> bool:
    """A JSON value the reference parses as ``usize``: a non-negative integer (not a bool or a float)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class SafetensorsReader:
    """Open one file; ``keys()``, ``shape(name)``, ``dtype(name)``, ``read(name)``, ``read_rows(name, i, j)``;
    use as a context manager."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if sys.byteorder != "little":
            raise RuntimeError(f"{self.path}: reading safetensors needs a little-endian host")
        self._f = open(self.path, "rb")  # noqa: SIM115 -- closed in close()/__exit__
        try:
            self._parse_header()
        except BaseException:
            self._f.close()
            raise

    def _corrupt(self, why: str) -> ValueError:
        return ValueError(f"{self.path}: corrupt or truncated safetensors file: {why}")

    def _parse_header(self) -> None:
        size = os.fstat(self._f.fileno()).st_size
        head = self._f.read(8)
        if len(head) < 8:
            raise self._corrupt(f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise self._corrupt(f"header length {n} is above the format's limit of {_MAX_HEADER} bytes")
        if 8 + n > size:
            raise self._corrupt(f"header length {n} does not fit in a file of {size} bytes")
        try:
            header = json.loads(self._f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise self._corrupt(f"header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._corrupt("header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise self._corrupt(f"__metadata__ must map strings to strings, got {meta!r}")
        self.metadata = meta
        self._start, data_size = 8 + n, size - 8 - n
        entries = []
        for name, e in header.items():
            try:
                dtype, bits = _DTYPES[e["dtype"]]
                shape, offsets = e["shape"], e["data_offsets"]
            except (KeyError, TypeError):
                raise self._corrupt(f"bad header entry for tensor {name!r}: {e!r}") from None
            if not (isinstance(shape, list) and all(_is_count(s) for s in shape)):
                raise self._corrupt(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(x) for x in offsets)):
                raise self._corrupt(f"tensor {name!r}: data_offsets {offsets!r} are not two non-negative integers")
            numel = 1
            for s in shape:
                numel *= s
            if numel * bits % 8:
                raise self._corrupt(f"tensor {name!r}: {shape} {e['dtype']} does not end on a byte boundary")
            entries.append((tuple(offsets), name, e["dtype"], dtype, tuple(shape), numel * bits // 8))
        # the reference rule: sorted by offsets, the tensors tile the data exactly -- the first starts at
        # 0, each starts where the previous ends (no gap, no overlap) and the last ends at the file's end
        entries.sort(key=lambda x: x[0])
        self._entries = {}
        pos = 0
        for (begin, end), name, dname, dtype, shape, nbytes in entries:
            if begin != pos or end < begin:
                why = "overlaps the previous tensor" if begin < pos else (
                    f"leaves a gap after byte {pos}" if begin > pos else "ends before it starts")
                raise self._corrupt(f"tensor {name!r}: offsets {begin}..{end} {why}")
            if end - begin != nbytes:
                raise self._corrupt(f"tensor {name!r}: offsets {begin}..{end} do not hold {shape} {dname}")
            if end > data_size:
                raise self._corrupt(f"tensor {name!r} ends at byte {end} of data, file holds {data_size}")
            pos = end
            self._entries[name] = (dname, dtype, shape, begin)
        if pos != data_size:
            raise self._corrupt(f"the tensors cover {pos} bytes of data, the file holds {data_size}")

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][2]

    def dtype(self, name: str) -> torch.dtype | None:
        """The torch dtype ``name`` is stored in (None for a format dtype this torch cannot hold)."""
        return self._entries[name][1]

    def _layout(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int]:
        dname, dtype, shape, begin = self._entries[name]
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {dname}, which this torch cannot hold")
        if dname == "F4":  # two values per byte: torch's packed dtype, last dim halved (as the reference)
            if not shape or shape[-1] % 2:
                raise ValueError(f"{self.path}: tensor {name!r} is F4 {shape}: torch's packed float4 dtype "
                                 "needs an even last dim")
            shape = shape[:-1] + (shape[-1] // 2,)
        return dtype, shape, begin

    def _read_into(self, name: str, t: torch.Tensor, offset: int) -> torch.Tensor:
        buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes
        self._f.seek(self._start + offset)
        done = 0
        while done < len(buf):
            got = self._f.readinto(buf[done:])
            if not got:
                raise self._corrupt(f"tensor {name!r}: file ended while reading")
            done += got
        return t

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as a new CPU tensor in its stored dtype (one allocation, one read)."""
        dtype, shape, begin = self._layout(name)
        return self._read_into(name, torch.empty(shape, dtype=dtype), begin)

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name`` (dim 0), read from the file and nothing else.

        A row-major tensor's rows i..j-1 are the one byte range ``[i, j) * row_bytes`` of its data,
        so a rank that owns row chunk r reads exactly its chunk (no memory map, no whole tensor).
        ``out``: a contiguous CPU tensor of the stored dtype and the rows' shape to read into
        (else a new one). A 0-d tensor has one "row" (``start=0, stop=1`` reads it).
        """
        dtype, shape, begin = self._layout(name)
        rows = shape[0] if shape else 1
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= rows):
            raise ValueError(f"{self.path}: tensor {name!r} has {rows} rows, asked for rows {start}:{stop}")
        row_shape = tuple(shape[1:])
        row_bytes = math.prod(row_shape) * dtype.itemsize
        want = (stop - start,) + row_shape if shape else ()
        if out is None:
            out = torch.empty(want, dtype=dtype)
        elif (tuple(out.shape) != want or out.dtype != dtype or out.device.type != "cpu"
              or not out.is_contiguous()):
            raise ValueError(f"{self.path}: tensor {name!r}: out must be a contiguous CPU {dtype} {want}, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        return self._read_into(name, out, begin + start * row_bytes)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
