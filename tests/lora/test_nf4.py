"""NF4 storage: codebook bound, bitsandbytes byte-compatibility, the frozen NF4Linear."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ftlib.lora.nf4 import (
    NF4_CODE,
    NF4Linear,
    dequantize_absmax,
    dequantize_nf4,
    double_quantize_absmax,
    dynamic_map,
    quantize_blockwise_8bit,
    quantize_nf4,
)

MAX_HALF_GAP = float((NF4_CODE[1:] - NF4_CODE[:-1]).max()) / 2


def _bnb():
    return pytest.importorskip("bitsandbytes.functional")


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 150), scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_round_trip_within_codebook_bound(rows, cols, scale, seed):
    # invariant: |w - deq(q(w))| <= absmax_block * max_gap / 2 for every element
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * scale
    codes, absmax = quantize_nf4(w, 64)
    back = dequantize_nf4(codes, absmax, w.shape)
    n = w.numel()
    per_elem_absmax = absmax.repeat_interleave(64)[:n].view_as(w)
    bound = per_elem_absmax * MAX_HALF_GAP * (1 + 1e-6) + 1e-30
    err = (w - back).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()} at {torch.argmax(err - bound).item()}"
    # each block's absmax is exact and the largest element is reproduced exactly
    assert torch.equal(back.abs().flatten().max(), w.abs().max())


def test_zero_block_and_odd_count():
    w = torch.zeros(3, 5)
    w[2, 4] = -2.5
    codes, absmax = quantize_nf4(w, 64)
    assert codes.numel() == 8 and absmax.tolist() == [2.5]
    assert torch.equal(dequantize_nf4(codes, absmax, w.shape), w)
    assert codes[-1].item() & 0xF == 7  # padding nibble is the code of 0.0


def test_codebooks_match_bitsandbytes():
    bnbf = _bnb()
    assert torch.equal(NF4_CODE, bnbf.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(dynamic_map(), bnbf.create_dynamic_map())


@pytest.mark.parametrize("shape", [(64, 128), (7, 13), (33, 65), (3, 1), (300, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_codes_bit_identical_to_bitsandbytes(shape, dtype):
    bnbf = _bnb()
    torch.manual_seed(sum(shape))
    w = (torch.randn(shape) * 0.05).to(dtype)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    codes, absmax = quantize_nf4(w, 64)
    assert torch.equal(codes, packed.view(-1)), "packed codes differ from bitsandbytes"
    assert torch.equal(absmax, state.absmax)
    # quantize with one, dequantize with the other: identical values
    assert torch.equal(dequantize_nf4(codes, absmax, shape, dtype), bnbf.dequantize_4bit(packed, state))


@pytest.mark.parametrize("shape", [(96, 200), (300, 576)])
def test_double_quant_matches_bitsandbytes(shape, monkeypatch):
    bnbf = _bnb()
    torch.manual_seed(1)
    w = torch.randn(shape) * 0.05
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    _, absmax = quantize_nf4(w, 64)
    q, absmax2, offset = double_quantize_absmax(absmax)
    assert torch.equal(offset.view(()), state.offset)
    assert torch.equal(absmax2, state.state2.absmax)
    # ftlib rounds to the exact nearest map value; bitsandbytes' CPU search sometimes returns another nearby code
    assert (q != state.absmax).float().mean() < 0.02
    code = dynamic_map().double()
    scaled = ((absmax.double() - offset.double()) / absmax2.double().repeat_interleave(256)[: absmax.numel()])
    mine, theirs = (scaled - code[q.long()]).abs(), (scaled - code[state.absmax.long()]).abs()
    assert (mine <= theirs + 1e-7).all()
    # a bitsandbytes state dequantizes identically in the pure-PyTorch path
    layer = NF4Linear.from_bnb(packed, state)
    assert torch.equal(layer.dequantize(torch.float32), bnbf.dequantize_4bit(packed, state))
    # and an ftlib state dequantizes identically through bitsandbytes
    mine_layer = NF4Linear.from_linear(_linear_with(w), double_quant=True)
    ref = mine_layer.dequantize(torch.float32)
    monkeypatch.setenv("FTLIB_NF4_BACKEND", "bnb")
    assert torch.equal(mine_layer.dequantize(torch.float32), ref)


def _linear_with(w, bias=None):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def test_blockwise_8bit_round_trip_is_nearest():
    torch.manual_seed(0)
    x = torch.randn(1000)
    q, absmax = quantize_blockwise_8bit(x)
    code = dynamic_map()
    scaled = x / absmax.repeat_interleave(256)[:1000]
    best = (scaled[:, None] - code[None, :]).abs().min(dim=1).values
    assert torch.allclose((scaled - code[q.long()]).abs(), best, atol=1e-7)
    qa, a2, off = double_quantize_absmax(x.abs())
    err = (dequantize_absmax(qa, a2, off) - x.abs()).abs()
    assert err.max() <= a2.max() * 0.05  # 8-bit dynamic map: coarse only near the block maximum


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_nf4_linear_forward_backward(double_quant, bias):
    torch.manual_seed(0)
    lin = nn.Linear(70, 9, bias=bias)
    layer = NF4Linear.from_linear(lin, double_quant=double_quant)
    assert all(not p.requires_grad for p in layer.parameters())
    assert layer.codes.dtype == torch.uint8 and layer.codes.ndim == 1
    w = layer.dequantize()
    x = torch.randn(2, 3, 70, requires_grad=True)
    y = layer(x)
    ref_x = x.detach().clone().requires_grad_(True)
    ref = F.linear(ref_x, w, lin.bias.detach() if bias else None)
    assert torch.allclose(y, ref, atol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    assert torch.allclose(x.grad, ref_x.grad, atol=1e-6)
    assert all(p.grad is None for p in layer.parameters())
    # quantization error of the layer output is bounded by the weight error
    assert (w - lin.weight).abs().max() <= lin.weight.abs().max() * MAX_HALF_GAP * 1.01


def test_nf4_linear_autocast_bf16():
    torch.manual_seed(0)
    layer = NF4Linear.from_linear(nn.Linear(64, 32))
    x = torch.randn(4, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    ref = F.linear(x, layer.dequantize(), layer.bias)
    assert torch.allclose(y.float(), ref, atol=0.05, rtol=0.02)


def test_to_linear_and_state_dict_round_trip():
    torch.manual_seed(0)
    layer = NF4Linear.from_linear(nn.Linear(40, 8), double_quant=True)
    other = NF4Linear(40, 8, double_quant=True)
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other.dequantize(), layer.dequantize())
    # no floating-point storage: casting the module (or FSDP2 mixed precision) cannot round the scales
    assert not any(p.is_floating_point() for n, p in layer.named_parameters() if n != "bias")
    cast = NF4Linear(40, 8, double_quant=True)
    cast.load_state_dict(layer.state_dict())
    cast.to(torch.bfloat16)
    assert torch.equal(cast.dequantize(torch.float32), layer.dequantize(torch.float32))
    assert cast.bias.dtype == torch.bfloat16
    lin = layer.to_linear(torch.bfloat16)
    assert isinstance(lin, nn.Linear) and lin.weight.dtype == torch.bfloat16
    assert torch.equal(lin.weight, layer.dequantize(torch.float32).to(torch.bfloat16))


def test_bad_input():
    with pytest.raises(ValueError, match="blocksize"):
        quantize_nf4(torch.randn(4, 4), blocksize=48)
    with pytest.raises(TypeError, match="fp32/fp16/bf16"):
        quantize_nf4(torch.randn(4, 4, dtype=torch.float64))
    codes, absmax = quantize_nf4(torch.randn(4, 4))
    with pytest.raises(ValueError, match="needs 32 code bytes"):
        dequantize_nf4(codes, absmax, (8, 8))
    # a NaN/Inf weight would turn its whole 64-value block into NaN/Inf after the round trip
    for bad in (float("nan"), float("inf")):
        w = torch.randn(4, 40)
        w[2, 7] = bad
        with pytest.raises(ValueError, match="non-finite.*index 87"):
            quantize_nf4(w)


def test_backend_choice(monkeypatch):
    from ftlib.lora.nf4 import nf4_backend

    monkeypatch.setenv("FTLIB_NF4_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="FTLIB_NF4_BACKEND"):
        nf4_backend(torch.device("cpu"))
    monkeypatch.setenv("FTLIB_NF4_BACKEND", "torch")
    assert nf4_backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv("FTLIB_NF4_BACKEND", "auto")
    assert nf4_backend(torch.device("cpu")) == "torch"
