"""The direct safetensors reader agrees with the safetensors library and rejects broken files."""

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from ftlib.models._safetensors_io import SafetensorsReader

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool]


@settings(max_examples=30, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=1, max_size=4),
       dtypes=st.lists(st.sampled_from(DTYPES), min_size=4, max_size=4), seed=st.integers(0, 1000))
def test_reader_matches_safetensors(tmp_path_factory, shapes, dtypes, seed):
    # invariant: every tensor read equals what the reference library reads, dtype and bits
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, (shape, dt) in enumerate(zip(shapes, dtypes)):
        x = torch.randn(shape, generator=g) * 50
        tensors[f"t{i}"] = x > 0 if dt == torch.bool else x.to(dt)
    path = tmp_path_factory.mktemp("st") / "x.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    ref = load_file(path)
    with SafetensorsReader(path) as f:
        assert sorted(f.keys()) == sorted(ref) and f.metadata == {"format": "pt"}
        for k, v in ref.items():
            got = f.read(k)
            assert f.shape(k) == tuple(v.shape) and got.dtype == v.dtype and torch.equal(got, v), k


def _write_raw(path, header, data=b""):
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


@pytest.mark.parametrize("header,data,why", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "ends at byte 8 of data, file holds 4"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "do not hold (3,) F32"),
    ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "bad header entry for tensor 'a'"),
    ({"a": {"shape": [2]}}, b"", "bad header entry"),
])
def test_reader_rejects_inconsistent_headers(tmp_path, header, data, why):
    path = tmp_path / "bad.safetensors"
    _write_raw(path, header, data)
    with pytest.raises(ValueError, match="bad.safetensors: corrupt or truncated safetensors file: .*" + why.replace(
            "(", r"\(").replace(")", r"\)")):
        SafetensorsReader(path)


def test_reader_rejects_broken_header_bytes(tmp_path):
    path = tmp_path / "b.safetensors"
    path.write_bytes(b"\1\2")
    with pytest.raises(ValueError, match="shorter than the 8-byte header length"):
        SafetensorsReader(path)
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(ValueError, match="header length 1000 does not fit"):
        SafetensorsReader(path)
    path.write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(ValueError, match="header is not JSON"):
        SafetensorsReader(path)
