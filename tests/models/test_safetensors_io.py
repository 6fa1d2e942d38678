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


def _entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# (header, data) pairs written by hand: valid files with every dtype the format defines, and
# headers the reference reader refuses (overlap, gap, not from 0, trailing bytes, bad dims ...)
HEADERS = {
    "u16": ({"a": _entry("U16", [2], 0, 4)}, b"\1\0\2\0"),
    "u32": ({"a": _entry("U32", [1], 0, 4)}, b"\1\0\0\0"),
    "u64": ({"a": _entry("U64", [1], 0, 8)}, b"\1" + b"\0" * 7),
    "f8_e8m0": ({"a": _entry("F8_E8M0", [2], 0, 2)}, b"\x7f\x80"),
    "f8_fnuz": ({"a": _entry("F8_E4M3FNUZ", [1], 0, 1), "b": _entry("F8_E5M2FNUZ", [1], 1, 2)}, b"\1\2"),
    "c64": ({"a": _entry("C64", [1], 0, 8)}, b"\0\0\x80\x3f\0\0\0\x40"),
    "f4_packed": ({"a": _entry("F4", [2, 2], 0, 2)}, b"\x21\x43"),
    "out_of_order": ({"a": _entry("F32", [1], 4, 8), "b": _entry("F32", [1], 0, 4)}, b"\0" * 8),
    "empty_between": ({"a": _entry("F32", [1], 0, 4), "z": _entry("F32", [0], 4, 4), "b": _entry("I8", [4], 4, 8)},
                      b"\0" * 8),
    "no_tensors": ({"__metadata__": {"format": "pt"}}, b""),
    "overlap": ({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [1], 4, 8)}, b"\0" * 8),
    "same_span": ({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 0, 8)}, b"\0" * 8),
    "gap": ({"a": _entry("F32", [1], 0, 4), "b": _entry("F32", [1], 8, 12)}, b"\0" * 12),
    "not_from_zero": ({"a": _entry("F32", [1], 4, 8)}, b"\0" * 8),
    "trailing_bytes": ({"a": _entry("F32", [2], 0, 8)}, b"\0" * 12),
    "end_before_begin": ({"a": _entry("F32", [0], 8, 0)}, b"\0" * 8),
    "negative_dims": ({"a": _entry("F32", [-1, -2], 0, 8)}, b"\0" * 8),
    "float_dim": ({"a": _entry("F32", [2.0], 0, 8)}, b"\0" * 8),
    "bool_offset": ({"a": _entry("U8", [1], False, True)}, b"\0"),
    "f4_half_byte": ({"a": _entry("F4", [3], 0, 2)}, b"\0\0"),
    "metadata_not_str": ({"__metadata__": {"n": 1}, "a": _entry("F32", [2], 0, 8)}, b"\0" * 8),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_reader_agrees_with_the_reference_reader(tmp_path, case):
    """Invariant: a file the reference reader (safetensors' safe_open) loads, this reader loads to
    the same dtype, shape and bytes; a file it refuses, this reader refuses with the file's name."""
    from safetensors import SafetensorError, safe_open

    header, data = HEADERS[case]
    path = tmp_path / f"{case}.safetensors"
    _write_raw(path, header, data)
    try:
        with safe_open(str(path), framework="pt") as f:
            ref = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError:
        ref = None
    if ref is None:
        with pytest.raises(ValueError, match=f"{case}.safetensors: corrupt or truncated safetensors file"):
            with SafetensorsReader(path) as r:
                [r.read(k) for k in r.keys()]
        return
    with SafetensorsReader(path) as r:
        got = {k: r.read(k) for k in r.keys()}
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def test_reader_header_limits_and_unreadable_dtypes(tmp_path):
    path = tmp_path / "big.safetensors"
    path.write_bytes(struct.pack("<Q", 100_000_001) + b"{}")
    with pytest.raises(ValueError, match="above the format's limit of 100000000 bytes"):
        SafetensorsReader(path)
    # F6 is a dtype of the format without a torch dtype: the header is valid, reading names the tensor
    _write_raw(path, {"a": _entry("F6_E2M3", [4], 0, 3)}, b"\1\2\3")
    with SafetensorsReader(path) as r:
        assert r.shape("a") == (4,)
        with pytest.raises(ValueError, match="tensor 'a' has dtype F6_E2M3"):
            r.read("a")


def test_read_rows_reads_only_its_byte_range(tmp_path):
    """Rows i:j of a row-major tensor are one byte range: read_rows returns exactly them, reading
    (j - i) * row_bytes bytes, into a given buffer too; a bad range names the file and tensor."""
    t = torch.arange(7 * 5 * 3, dtype=torch.float32).reshape(7, 5, 3)
    b = torch.arange(9, dtype=torch.bfloat16)
    path = tmp_path / "x.safetensors"
    save_file({"a": t, "b": b, "s": torch.tensor(2.5)}, str(path))
    with SafetensorsReader(path) as f:
        for i, j in [(0, 7), (2, 5), (6, 7), (3, 3)]:
            assert torch.equal(f.read_rows("a", i, j), t[i:j])
        assert torch.equal(f.read_rows("b", 4, 9), b[4:])
        out = torch.empty(2, 5, 3)
        assert f.read_rows("a", 1, 3, out=out) is out and torch.equal(out, t[1:3])
        assert f.read_rows("s", 0, 1).item() == 2.5
        with pytest.raises(ValueError, match=r"x.safetensors: tensor 'a' has 7 rows, asked for rows 5:8"):
            f.read_rows("a", 5, 8)
        with pytest.raises(ValueError, match="out must be a contiguous CPU torch.float32"):
            f.read_rows("a", 0, 2, out=torch.empty(3, 5, 3))
        sizes = []

        class Counting:  # the open file, counting the bytes asked for
            def __init__(self, raw):
                self.raw = raw

            def seek(self, pos):
                return self.raw.seek(pos)

            def readinto(self, buf):
                sizes.append(len(buf))
                return self.raw.readinto(buf)

            def close(self):
                self.raw.close()

        f._f = Counting(f._f)
        assert torch.equal(f.read_rows("a", 2, 4), t[2:4])
        assert sum(sizes) == 2 * 5 * 3 * 4
