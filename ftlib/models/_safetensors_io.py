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
"""

from __future__ import annotations

import json
import os
import struct
import sys

import torch

__all__ = ["SafetensorsReader"]

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 2**20  # the reference implementation's limit


class SafetensorsReader:
    """Open one file; ``keys()``, ``shape(name)``, ``read(name)``; use as a context manager."""

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
        if n > _MAX_HEADER or 8 + n > size:
            raise self._corrupt(f"header length {n} does not fit in a file of {size} bytes")
        try:
            header = json.loads(self._f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise self._corrupt(f"header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._corrupt("header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self._start, data_size = 8 + n, size - 8 - n
        self._entries = {}
        for name, e in header.items():
            try:
                dtype = _DTYPES[e["dtype"]]
                shape = tuple(int(s) for s in e["shape"])
                begin, end = (int(x) for x in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._corrupt(f"bad header entry for tensor {name!r}: {e!r}") from None
            numel = 1
            for s in shape:
                numel *= s
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            if end - begin != nbytes or begin < 0:
                raise self._corrupt(f"tensor {name!r}: offsets {begin}..{end} do not hold {shape} {e['dtype']}")
            if end > data_size:
                raise self._corrupt(f"tensor {name!r} ends at byte {end} of data, file holds {data_size}")
            self._entries[name] = (dtype, shape, begin)

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as a new CPU tensor in its stored dtype (one allocation, one read)."""
        dtype, shape, begin = self._entries[name]
        t = torch.empty(shape, dtype=dtype)
        buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes
        self._f.seek(self._start + begin)
        done = 0
        while done < len(buf):
            got = self._f.readinto(buf[done:])
            if not got:
                raise self._corrupt(f"tensor {name!r}: file ended while reading")
            done += got
        return t

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
