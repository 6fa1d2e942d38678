"""``swiglu``: the fused CPU kernel against float64 ``silu(g) * u`` (value and both gradients), what
backward keeps, and the backend choice."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.kernels import swiglu, swiglu_backend


def _cpp_or_skip():
    if swiglu_backend(torch.zeros(1), torch.zeros(1)) != "cpu":
        pytest.skip("ftlib/cpu/csrc/swiglu.cpp needs a C++ compiler and an AVX2 + FMA CPU")


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 300), st.floats(0.1, 30.0), st.integers(0, 2**31 - 1))
def test_cpp_matches_float64_reference(n, spread, seed):
    """Invariant: h = silu(g) u, dg = dh u s (1 + g (1 - s)), du = dh g s to fp32 rounding (the
    vector body and the scalar tail, gates from tiny to saturated)."""
    _cpp_or_skip()
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(n, generator=gen) * spread).requires_grad_()
    u = torch.randn(n, generator=gen).requires_grad_()
    dh = torch.randn(n, generator=gen)
    h = swiglu(g, u)
    dg, du = torch.autograd.grad(h, (g, u), dh)
    g64, u64 = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    h64 = F.silu(g64) * u64
    rg, ru = torch.autograd.grad(h64, (g64, u64), dh.double())
    for got, want in ((h, h64), (dg, rg), (du, ru)):
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6 * float(want.abs().max()) + 1e-30)


def test_cpp_work_split_over_threads(monkeypatch):
    _cpp_or_skip()
    g, u, dh = torch.randn(3, 1001), torch.randn(3, 1001), torch.randn(3, 1001)
    mod = importlib.import_module("ftlib.cpu.swiglu")
    one = (mod.swiglu_cpu(g, u), *mod._swiglu_cpu_backward(dh, g, u))
    monkeypatch.setattr(mod, "threads", lambda name, n: 3)
    for a, b in zip(one, (mod.swiglu_cpu(g, u), *mod._swiglu_cpu_backward(dh, g, u))):
        assert torch.equal(a, b)


def test_cpp_shapes_nan_and_saved_tensors():
    _cpp_or_skip()
    g = torch.tensor([[float("nan"), 100.0, -100.0], [0.0, -3.0, 2.5]], requires_grad=True)
    u = torch.ones(2, 3, requires_grad=True)
    h = swiglu(g, u)
    ref = F.silu(g.detach()) * u.detach()
    assert h.shape == (2, 3) and h[0, 0].isnan() and torch.allclose(h[~h.isnan()], ref[~ref.isnan()])
    saved = []
    x = torch.randn(4, 64, requires_grad=True)
    gg, uu = x * 2.0, x * 3.0
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu(gg, uu).sum().backward()
    big = {t.untyped_storage().data_ptr() for t in saved if t.shape == gg.shape}
    assert big == {gg.untyped_storage().data_ptr(), uu.untyped_storage().data_ptr()}  # not silu(g) too


def test_backend_choice(monkeypatch):
    g = torch.zeros(3)
    assert swiglu_backend(g.double(), g.double()) == "torch"
    assert swiglu_backend(g.bfloat16(), g.bfloat16()) == "torch"
    monkeypatch.setenv("FTLIB_SWIGLU_BACKEND", "torch")
    assert swiglu_backend(g, g) == "torch"
    monkeypatch.setenv("FTLIB_SWIGLU_BACKEND", "fast")
    with pytest.raises(ValueError, match="FTLIB_SWIGLU_BACKEND"):
        swiglu(g, g)
    monkeypatch.setenv("FTLIB_SWIGLU_BACKEND", "auto")
    no_build = "no C++ compiler found (c++, g++ or clang++ on PATH, or $CXX)"
    monkeypatch.setattr(importlib.import_module("ftlib.cpu.swiglu"), "why_not", lambda name: no_build)
    assert swiglu_backend(g, g) == "torch"  # no compiler: auto takes the reference
    monkeypatch.setenv("FTLIB_SWIGLU_BACKEND", "cpu")  # forcing the kernel is an error naming why
    with pytest.raises(RuntimeError, match=r"FTLIB_SWIGLU_BACKEND=cpu cannot run this call: no C\+\+ compiler"):
        swiglu(g, g)
    monkeypatch.setenv("FTLIB_SWIGLU_BACKEND", "auto")
    torch.testing.assert_close(swiglu(g + 1, g + 2), F.silu(g + 1) * (g + 2))
