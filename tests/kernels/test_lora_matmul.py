"""The fused LoRA matmul (Triton) against the float64 PyTorch reference; its dropout stream; dispatch.

Each check runs the kernels on fp32/fp16 inputs (bf16 on GPU only: the interpreter's bf16 dot is
broken) and the reference on the same values in float64, then compares y and the gradients of x,
A, B (and m for DoRA) for one random upstream gradient.

Tolerances are normwise, max|got - want| / max|want|, per dtype (u = unit roundoff):

- float32: 1e-5. The kernels compute in fp32 end to end (ieee dots); sums over <= 70 terms and a
  few fp32 roundings (u, v in fp32, the DoRA scale c) leave 0.8-2.3e-7 (observed).
- float16: 2e-3 (4u, u = 2^-11). The kernels round, like the unfused fp16 path: A and B to fp16,
  drop(x), s u and s v before their products, g c (DoRA) before the GEMM, and y / dX themselves:
  each an O(u) normwise error, observed 2.5e-4 .. 6.1e-4 (at most 1.25u).
- bfloat16 (GPU): 4u = 1.6e-2 for y, 8u = 3.2e-2 for gradients (their sums run over ~1000 tokens).

An indexing or masking bug (a missing tail tile, a wrong rank chunk, a dropped mask, a mask
from another counter) moves entries by O(1) of the scale, far above every tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ftlib.kernels import lora_backend, lora_matmul
from ftlib.kernels.lora import _choose
from ftlib.kernels.lora_ref import (
    dropout_mask_ref,
    dropout_threshold,
    lora_matmul_ref,
    philox4x32,
    uniform16_ref,
)
from ftlib.lora import NF4Linear

pytest.importorskip("triton")  # the kernel module needs it (installed on Linux x86-64)

from ftlib.kernels.lora_triton import dropout_mask_triton, lora_matmul_triton  # noqa: E402

TOL = {  # dtype -> (output, gradients), normwise
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 3.2e-2),
}
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _assert_close(name, got, want, tol):
    got = got.double()
    diff = (got - want).abs()
    scale = max(want.abs().max().item(), 1e-6)
    err = diff.max().item() / scale
    if not err <= tol:
        idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(f"{name}: normwise error {err:.3g} > {tol:.3g}; worst at {idx}: got {got[idx].item():.6g}, "
                             f"want {want[idx].item():.6g}")


def _problem(shape, dtype, *, bias, dora, nf4=None, seed=0, device=DEV):
    """Inputs of one case: x and W in `dtype`, adapters and magnitude fp32 (as LoRALinear holds them)."""
    *lead, k, n, r = shape
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)
    w = rnd(n, k) / math.sqrt(k)
    if nf4 is not None:  # (blocksize, double_quant): the reference gets the dequantized weight
        lin = nn.Linear(k, n, bias=False, dtype=dtype).requires_grad_(False)
        lin.weight.copy_(w.to(dtype))
        weight = NF4Linear.from_linear(lin, blocksize=nf4[0], double_quant=nf4[1]).to(device)
        w_ref = weight.dequantize(torch.float32).to(dtype).double()
    else:
        weight = w.to(device=device, dtype=dtype)
        w_ref = weight.double()
    a = (rnd(r, k) / math.sqrt(k)).to(device)
    b = (rnd(n, r) * 0.5).to(device)
    s = 2.0 / math.sqrt(r)
    x = rnd(*lead, k).to(device=device, dtype=dtype)
    gy = rnd(*lead, n).to(device=device, dtype=dtype)
    p = dict(x=x, weight=weight, A=a, B=b, s=s, gy=gy, w_ref=w_ref,
             bias=(rnd(n) * 0.3).to(device=device, dtype=dtype) if bias else None)
    if dora:
        norm = torch.linalg.vector_norm(w_ref + s * b.double() @ a.double(), dim=1)
        p["norm"] = norm.float()
        p["m"] = (norm * (1 + 0.3 * torch.rand(n, generator=g).to(device).double())).float()
    return p


def _run(fn, p, *, dropout_p=0.0, seed=0, offset=0, ref=False, grads=(True, True, True, True)):
    cast = (lambda t: t.double()) if ref else (lambda t: t)
    leaves = [cast(p["x"]).detach(), cast(p["A"]).detach(), cast(p["B"]).detach()]
    dora = "m" in p
    if dora:
        leaves.append(cast(p["m"]).detach())
    for t, need in zip(leaves, grads):
        t.requires_grad_(need)
    weight = p["w_ref"] if ref else p["weight"]
    y = fn(leaves[0], weight, leaves[1], leaves[2], p["s"],
           bias=None if p["bias"] is None else cast(p["bias"]), dropout_p=dropout_p, seed=seed, offset=offset,
           magnitude=leaves[3] if dora else None, weight_norm=cast(p["norm"]) if dora else None)
    y.backward(cast(p["gy"]))
    return y.detach(), [t.grad for t in leaves]


def _compare(p, dtype, **kw):
    got_y, got_g = _run(lora_matmul_triton, p, **kw)
    want_y, want_g = _run(lora_matmul_ref, p, ref=True, **kw)
    tol_y, tol_g = TOL[dtype]
    assert got_y.dtype == dtype and got_y.shape == want_y.shape
    _assert_close("y", got_y, want_y, tol_y)
    for name, got, want in zip(("dx", "dA", "dB", "dm"), got_g, want_g):
        if want is None:
            assert got is None, name
            continue
        assert got.dtype == (dtype if name == "dx" else torch.float32), name
        _assert_close(name, got, want, tol_g)


# (shape (..., K, N, R), dtype, bias, dropout p, DoRA): ragged M / K / N tails against the 16/32-wide
# interpreter tiles, r = 1, r not a power of two, r = 70 (two rank chunks of 64), 3-D input.
CASES = [
    ((37, 45, 29, 1), torch.float32, True, 0.0, False),
    ((37, 45, 29, 1), torch.float32, False, 0.25, False),
    ((2, 11, 70, 40, 5), torch.float32, True, 0.1, True),
    ((21, 70, 40, 5), torch.float32, False, 0.0, True),
    ((18, 33, 20, 70), torch.float32, True, 0.0, False),
    ((37, 45, 29, 3), torch.float16, True, 0.25, False),
    ((37, 45, 29, 1), torch.float16, False, 0.0, False),
    ((21, 70, 40, 5), torch.float16, True, 0.0, True),
    ((21, 70, 40, 5), torch.float16, False, 0.5, True),
    # few tokens: the down pass splits K (3 splits of 32) and the v pass N (2 of 64), partials summed
    ((5, 96, 70, 3), torch.float32, False, 0.1, False),
    ((5, 96, 70, 3), torch.float32, True, 0.1, True),
]


@pytest.mark.parametrize("shape,dtype,bias,p,dora", CASES)
def test_matches_float64_reference(shape, dtype, bias, p, dora):
    _compare(_problem(shape, dtype, bias=bias, dora=dora, seed=len(shape) + int(10 * p)), dtype,
             dropout_p=p, seed=1234567, offset=3 * 2**40)


def test_kernel_nf4_constants_are_the_nf4_table():
    # the kernels look NF4 codes up in 16 compile-time constants; they must be nf4_ref's table bit for bit
    from ftlib.kernels import _lora_kernels
    from ftlib.kernels.nf4_ref import NF4_CODE

    consts = torch.tensor([getattr(_lora_kernels, f"_NF4_{i}").value for i in range(16)], dtype=torch.float32)
    assert torch.equal(consts, NF4_CODE)


def test_autotune_keys_hold_the_token_bucket():
    # the tuned configuration follows the token count in powers of two, not the first call's M
    from ftlib.kernels import lora_triton

    for kind, keys in lora_triton._KEYS.items():
        assert "M_BUCKET" in keys and "M_BUCKET" in lora_triton.KERNELS[kind].arg_names, kind
    assert [lora_triton._pow2(m) for m in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]


@pytest.mark.parametrize("grads", [(False, True, True, True), (True, False, False, True), (False, False, False, True)])
def test_partial_gradients(grads):
    # the dX GEMM is skipped for an input that needs no grad (the first adapted layer); m alone trains
    p = _problem((21, 40, 24, 3), torch.float32, bias=False, dora=True, seed=3)
    _compare(p, torch.float32, dropout_p=0.2, seed=9, grads=grads)


def test_dora_norm_computed_when_not_given():
    # weight_norm=None: the kernel path uses dora_row_norm (W A^T by the kernel), the reference the direct norm
    p = _problem((19, 40, 24, 5), torch.float32, bias=True, dora=True, seed=4)
    del p["norm"]
    args = lambda ref: (p["x"].double() if ref else p["x"], p["w_ref"] if ref else p["weight"],
                        p["A"].double() if ref else p["A"], p["B"].double() if ref else p["B"], p["s"])
    got = lora_matmul_triton(*args(False), bias=p["bias"], magnitude=p["m"])
    want = lora_matmul_ref(*args(True), bias=p["bias"].double(), magnitude=p["m"].double())
    _assert_close("y", got, want, 1e-5)


# ---- NF4 base ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "shape,dtype,nf4,p,dora",
    [
        ((21, 128, 24, 4), torch.float32, (64, True), 0.0, False),  # K % blocksize == 0: packed code loads
        ((21, 96, 24, 4), torch.float32, (32, True), 0.0, False),  # dX tiles of two blocks, the last past K
        ((21, 45, 29, 3), torch.float32, (32, False), 0.0, False),  # odd N * K, blocks straddling rows
        ((21, 45, 29, 3), torch.float16, (64, True), 0.3, True),
        ((21, 128, 24, 4), torch.float16, (64, False), 0.0, True),
    ],
)
def test_nf4_matches_dequantize_then_matmul(shape, dtype, nf4, p, dora):
    prob = _problem(shape, dtype, bias=True, dora=dora, nf4=nf4, seed=5)
    _compare(prob, dtype, dropout_p=p, seed=77)


def test_nf4_dequantizes_the_same_values_as_nf4linear():
    # fp32: the NF4 kernel and the dense kernel on NF4Linear.dequantize() give the same bits (same tiles,
    # same fp32 products), forward and dX
    for nf4 in ((64, True), (32, False)):
        p = _problem((21, 96, 24, 4), torch.float32, bias=False, dora=False, nf4=nf4, seed=6)
        dense = dict(p, weight=p["weight"].dequantize(torch.float32))
        y_q, g_q = _run(lora_matmul_triton, p)
        y_d, g_d = _run(lora_matmul_triton, dense)
        if DEV == "cpu":
            assert torch.equal(y_q, y_d) and torch.equal(g_q[0], g_d[0])
        else:  # FMA contraction may move the double-quant absmax by an ulp
            torch.testing.assert_close(y_q, y_d, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(g_q[0], g_d[0], atol=1e-5, rtol=1e-5)


# ---- dropout stream ----------------------------------------------------------------------------

def test_philox_reference_known_answers():
    # Random123's known-answer vectors for Philox4x32-10
    t = lambda v: torch.tensor([v], dtype=torch.int64)
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for ctr, key, want in cases:
        got = philox4x32(*(t(c) for c in ctr), *key)
        assert [int(w) for w in got] == list(want)


@pytest.mark.parametrize("seed,offset,p", [(0, 0, 0.1), (2**62 - 1, 2**62 - 5, 0.5), (123456789, 2**33 + 7, 0.05)])
def test_kernel_mask_equals_reference_mask(seed, offset, p):
    got = dropout_mask_triton(seed, offset, 37, 83, p, device=DEV)  # 83 columns: a ragged group of 8
    want = dropout_mask_ref(seed, offset, 37, 83, p, device=DEV)
    assert torch.equal(got, want)


def test_mask_keeps_a_draw_equal_to_the_threshold():
    # drop iff u16 < t: with p = u16 / 65536 of a chosen element, that element is kept (the boundary)
    u = uniform16_ref(31, 4, 9, 29)
    for i, k in ((0, 0), (3, 17), (8, 28), (5, 9)):
        t = int(u[i, k])
        if t == 0:
            continue
        got = dropout_mask_triton(31, 4, 9, 29, t / 65536, device=DEV)
        assert got[i, k] > 0 and (got == 0).sum() == (u < t).sum()
        assert torch.equal(got, dropout_mask_ref(31, 4, 9, 29, t / 65536, device=DEV))


def test_forward_and_backward_masks_are_the_reference_mask():
    # W = 0, A = B = I, x = 1, s = 1: y = D, and with g = 1: dX = D, dA = column sums of D (exact in fp32)
    m, k, p, seed, offset = 23, 40, 0.3, 2024, 12
    eye = torch.eye(k, device=DEV)
    x = torch.ones(m, k, device=DEV, requires_grad=True)
    a = eye.clone().requires_grad_()
    y = lora_matmul_triton(x, torch.zeros(k, k, device=DEV), a, eye, 1.0, dropout_p=p, seed=seed, offset=offset)
    y.backward(torch.ones_like(y))
    d = dropout_mask_ref(seed, offset, m, k, p, device=DEV)
    assert torch.equal(y, d)
    assert torch.equal(x.grad, d)
    # v = g B = 1, so every row of dA = s v^T drop(x) is the column sums of D
    torch.testing.assert_close(a.grad, d.sum(0).expand(k, k), atol=1e-4, rtol=0)
    # another offset is another mask
    y2 = lora_matmul_triton(x.detach(), torch.zeros(k, k, device=DEV), eye, eye, 1.0, dropout_p=p, seed=seed,
                            offset=offset + 1)
    assert not torch.equal(y2, d)


def test_threshold_is_unbiased():
    for p in (1e-6, 0.05, 0.1, 0.5, 0.9, 0.99999):
        t, scale = dropout_threshold(p)
        assert abs(t / 65536 - p) <= 2**-17
        assert (1 - t / 65536) * scale == pytest.approx(1.0, rel=1e-15)  # E[D] = 1 exactly


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**62 - 1), offset=st.integers(0, 2**62 - 1), rows=st.integers(1, 20),
       cols=st.integers(1, 40), extra_r=st.integers(0, 9), extra_c=st.integers(0, 17), p=st.floats(0.01, 0.95))
def test_mask_is_a_function_of_the_element_only(seed, offset, rows, cols, extra_r, extra_c, p):
    # counter-based: element (i, k) of the mask depends on (seed, offset, i, k) alone, not on the shape,
    # and takes the values 0 or 65536 / (65536 - t)
    small = dropout_mask_ref(seed, offset, rows, cols, p)
    big = dropout_mask_ref(seed, offset, rows + extra_r, cols + extra_c, p)
    assert torch.equal(big[:rows, :cols], small)
    t, scale = dropout_threshold(p)
    assert set(small.unique().tolist()) <= {0.0, float(torch.tensor(scale, dtype=torch.float32))}


def test_drop_fraction_is_p():
    # 2^17 Bernoulli(t / 65536) draws: the dropped fraction lies within 6 standard deviations
    n = 256 * 512
    for p, seed in ((0.1, 1), (0.5, 2)):
        d = dropout_mask_ref(seed, 99, 256, 512, p)
        frac = (d == 0).double().mean().item()
        assert abs(frac - p) <= 6 * math.sqrt(p * (1 - p) / n), (p, frac)
        assert d.mean().item() == pytest.approx(1.0, abs=6 * math.sqrt(p / (1 - p) / n))


# ---- argument checks ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    "change,match",
    [
        (dict(weight=torch.zeros(6, 7)), "x has 8 input features, the weight 7"),
        (dict(lora_A=torch.zeros(2, 7)), r"lora_A must be \[r, in=8\]"),
        (dict(lora_B=torch.zeros(6, 3)), r"lora_B must be \[out=6, r=2\]"),
        (dict(bias=torch.zeros(5)), r"bias must be \[out=6\]"),
        (dict(dropout_p=1.0), r"dropout_p must be a number in \[0, 1\)"),
        (dict(dropout_p=-0.1), r"dropout_p must be a number in \[0, 1\)"),
        (dict(seed=-1), r"seed must be an integer in \[0, 2\^62\)"),
        (dict(offset=2**62), r"offset must be an integer in \[0, 2\^62\)"),
        (dict(weight_norm=torch.ones(6)), "weight_norm is given without magnitude"),
        (dict(magnitude=torch.ones(5)), r"magnitude must be \[out=6\]"),
        (dict(weight=torch.zeros(6, 8, requires_grad=True)), "weight requires grad, but the base layer is frozen"),
        (dict(scaling=float("nan")), "scaling must be a finite number"),
    ],
)
@pytest.mark.parametrize("fn", [lora_matmul_ref, lora_matmul_triton])
def test_bad_arguments_are_refused(fn, change, match):
    args = dict(x=torch.zeros(3, 8), weight=torch.zeros(6, 8), lora_A=torch.zeros(2, 8), lora_B=torch.zeros(6, 2),
                scaling=1.0)
    args.update(change)
    kw = {k: args.pop(k) for k in list(args) if k not in ("x", "weight", "lora_A", "lora_B", "scaling")}
    with pytest.raises((ValueError, TypeError), match=match):
        fn(**args, **kw)


def test_triton_refuses_float64_and_large_rank():
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        lora_matmul_triton(torch.zeros(3, 8, dtype=torch.float64), torch.zeros(6, 8, dtype=torch.float64),
                           torch.zeros(2, 8), torch.zeros(6, 2), 1.0)
    with pytest.raises(ValueError, match="rank 300 > 256"):
        lora_matmul_triton(torch.zeros(3, 8), torch.zeros(6, 8), torch.zeros(300, 8), torch.zeros(6, 300), 1.0)


def test_empty_input():
    x = torch.zeros(0, 8, requires_grad=True)
    a = torch.randn(2, 8, requires_grad=True)
    y = lora_matmul_triton(x, torch.randn(6, 8), a, torch.randn(6, 2), 1.0)
    assert y.shape == (0, 6)
    y.sum().backward()
    assert torch.equal(a.grad, torch.zeros_like(a))


# ---- dispatch ----------------------------------------------------------------------------------

def _choice(want="auto", *, is_cuda=True, dtype=torch.bfloat16, rank=16, have_triton=True, interpret=False,
            is_cpu=None, compiling=False):
    return _choose(want, is_cuda=is_cuda, dtype=dtype, rank=rank, have_triton=have_triton, interpret=interpret,
                   is_cpu=not is_cuda if is_cpu is None else is_cpu, compiling=compiling)


@pytest.mark.parametrize(
    "case,expected",
    [
        (dict(), "triton"),
        (dict(dtype=torch.float16, rank=256), "triton"),
        (dict(dtype=torch.float32), "torch"),  # cuBLAS's exact fp32 GEMM: the reference
        (dict(dtype=torch.float64), "torch"),
        (dict(rank=257), "torch"),
        (dict(have_triton=False), "torch"),
        (dict(is_cuda=False), "torch"),  # bf16 on CPU: the reference
        (dict(is_cuda=False, interpret=True), "torch"),  # auto never picks the interpreter
        (dict(is_cuda=False, dtype=torch.float32), "cpu"),  # the CPU wing's LoRA layer
        (dict(is_cuda=False, dtype=torch.float32, compiling=True), "torch"),  # inductor fuses the ops itself
        (dict(is_cuda=False, is_cpu=False, dtype=torch.float32), "torch"),  # another device (meta, mps)
    ],
)
def test_auto_decision_table(case, expected):
    assert _choice(**case) == expected


@pytest.mark.parametrize(
    "case,match",
    [
        (dict(have_triton=False), "triton is not installed"),
        (dict(is_cuda=False), "need CUDA tensors"),
        (dict(dtype=torch.float64), "float16/bfloat16/float32, got torch.float64"),
        (dict(rank=300), "rank 300 > 256"),
    ],
)
def test_forcing_an_unavailable_backend_raises(case, match):
    assert _choice("triton", dtype=torch.float32) == "triton"
    assert _choice("triton", is_cuda=False, interpret=True) == "triton"
    assert _choice("torch", is_cuda=False, have_triton=False) == "torch"
    with pytest.raises(RuntimeError, match=match):
        _choice("triton", **case)


def test_env_var(monkeypatch):
    x, w, a, b = torch.randn(5, 8), torch.randn(6, 8), torch.randn(2, 8), torch.randn(6, 2)
    monkeypatch.setenv("FTLIB_LORA_BACKEND", "cuda")
    with pytest.raises(ValueError, match="FTLIB_LORA_BACKEND='cuda'"):
        lora_matmul(x, w, a, b, 1.0)
    monkeypatch.setenv("FTLIB_LORA_BACKEND", " Torch ")
    assert lora_backend(x) == "torch"
    monkeypatch.delenv("FTLIB_LORA_BACKEND")
    if DEV == "cpu":
        assert lora_backend(x) == "cpu"  # fp32 on CPU: the LoRA layer's CPU path; the op itself is the reference
        assert lora_backend(x.double()) == "torch"
        assert torch.equal(lora_matmul(x, w, a, b, 1.0), lora_matmul_ref(x, w, a, b, 1.0))
        monkeypatch.setenv("FTLIB_LORA_BACKEND", "cpu")
        with pytest.raises(RuntimeError, match="FTLIB_LORA_BACKEND=cpu cannot run this call: .*fp32 CPU"):
            lora_backend(x.double())
        if lora_backend(x, rank=8) == "cpu":  # the C++ kernels built: a rank they do not take is named
            with pytest.raises(RuntimeError, match="FTLIB_LORA_BACKEND=cpu cannot run this call: .*got 2"):
                lora_backend(x, rank=2)
    monkeypatch.setenv("FTLIB_LORA_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert lora_backend(x) == "triton"
    assert torch.equal(lora_matmul(x, w, a, b, 1.0), lora_matmul_triton(x, w, a, b, 1.0))
    monkeypatch.delenv("TRITON_INTERPRET")
    if DEV == "cpu":
        with pytest.raises(RuntimeError, match="need CUDA tensors"):
            lora_matmul(x, w, a, b, 1.0)


# ---- GPU: bf16 and larger shapes, natively -----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,dora,p,nf4", [
    (torch.bfloat16, False, 0.0, None), (torch.bfloat16, False, 0.1, None), (torch.bfloat16, True, 0.1, None),
    (torch.bfloat16, False, 0.0, (64, True)), (torch.bfloat16, True, 0.05, (64, True)),
    (torch.float16, True, 0.0, (64, False)),
])
def test_gpu_matches_float64_reference(dtype, dora, p, nf4):
    prob = _problem((1000, 1536, 1040, 16), dtype, bias=True, dora=dora, nf4=nf4, seed=11, device="cuda")
    _compare(prob, dtype, dropout_p=p, seed=5, offset=2**35)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,nf4,p", [
    ((1000, 1536, 1040, 16), (32, True), 0.0),  # tiles wider than the block: one absmax per block
    ((1000, 1536, 1040, 16), (256, True), 0.1),  # tiles narrower than the block: one absmax per row
    ((513, 1000, 777, 16), (64, True), 0.1),  # K not a multiple of the block: per-element gathers
    ((8, 4096, 1024, 16), (64, True), 0.0),  # 8 tokens: the down / v passes split K / N
])
def test_gpu_nf4_blocks_and_odd_k(shape, nf4, p):
    # QLoRA without bitsandbytes: every NF4 code path of the kernels, natively in bf16
    prob = _problem(shape, torch.bfloat16, bias=False, dora=False, nf4=nf4, seed=13, device="cuda")
    _compare(prob, torch.bfloat16, dropout_p=p, seed=9)


@pytest.mark.gpu
def test_gpu_large_rank_and_masks():
    prob = _problem((777, 520, 300, 200), torch.bfloat16, bias=False, dora=False, seed=12, device="cuda")
    _compare(prob, torch.bfloat16, dropout_p=0.1, seed=3)
    assert torch.equal(dropout_mask_triton(7, 8, 1000, 1001, 0.2, "cuda"), dropout_mask_ref(7, 8, 1000, 1001, 0.2, "cuda"))
