"""``rms_norm``: both backends against float64 ``w * x / sqrt(mean(x^2) + eps)`` (value and the
gradients of x and the weight), what backward keeps, the thread split, and the backend choice."""

import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftlib.kernels import rms_norm, rms_norm_backend

_MOD = importlib.import_module("ftlib.cpu.rmsnorm")


def _cpp_available() -> bool:
    return rms_norm_backend(torch.zeros(1, 4), torch.zeros(4)) == "cpu"


def _reference(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from([(1,), (3,), (2, 5)]), st.sampled_from([1, 7, 8, 9, 17, 33, 100]), st.booleans(),
       st.floats(0.01, 100.0), st.integers(0, 2**31 - 1))
def test_rms_norm_matches_float64_reference(monkeypatch, backend, lead, h, train_weight, spread, seed):
    """Invariant: y = w x r, dx = r (g - n mean(g n)) with g = w dy, n = x r, dw = sum dy n, r =
    1 / sqrt(mean(x^2) + eps), to fp32 rounding, for rows with a vector body and a scalar tail and
    inputs from small (eps matters) to large."""
    if backend == "cpu" and not _cpp_available():
        pytest.skip("ftlib/cpu/csrc/rmsnorm.cpp needs a C++ compiler and an AVX2 + FMA CPU")
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, h, generator=gen) * spread).requires_grad_()
    w = (torch.randn(h, generator=gen)).requires_grad_(train_weight)
    dy = torch.randn(*lead, h, generator=gen)
    eps = 1e-6 if spread > 1 else 1e-2
    monkeypatch.setenv("FTLIB_RMSNORM_BACKEND", backend)
    assert rms_norm_backend(x, w) == backend
    y = rms_norm(x, w, eps)
    grads = torch.autograd.grad(y, (x, w) if train_weight else (x,), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_(train_weight)
    y64 = _reference(x64, w64, eps)
    want = torch.autograd.grad(y64, (x64, w64) if train_weight else (x64,), dy.double())
    torch.testing.assert_close(y.double(), y64, rtol=2e-5, atol=2e-5 * float(y64.detach().abs().max()) + 1e-12)
    # fp32 rounding is relative to the terms a gradient is summed from (dx = r g - r n mean(g n)
    # cancels when a row is one feature or eps is negligible), not to the result
    with torch.no_grad():
        r64 = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
        terms = [(r64 * (w64 * dy.double()).abs()).max(),
                 (dy.double().abs() * (x64 * r64).abs()).reshape(-1, h).sum(0).max()]
    for got, ref, scale in zip(grads, want, terms):
        torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=2e-5 * float(scale) + 1e-12)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_backward_keeps_x_and_the_row_scale(monkeypatch, backend):
    if backend == "cpu" and not _cpp_available():
        pytest.skip("ftlib/cpu/csrc/rmsnorm.cpp needs a C++ compiler and an AVX2 + FMA CPU")
    monkeypatch.setenv("FTLIB_RMSNORM_BACKEND", backend)
    x = torch.randn(2, 7, 16, requires_grad=True)
    h = x * 2.0
    w = torch.ones(16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        rms_norm(h, w, 1e-6)
    assert sorted(tuple(s.shape) for s in saved) == [(2, 7, 1), (2, 7, 16), (16,)]


def test_cpp_thread_split_is_bit_equal(monkeypatch):
    if not _cpp_available():
        pytest.skip("ftlib/cpu/csrc/rmsnorm.cpp needs a C++ compiler and an AVX2 + FMA CPU")
    x, w, dy = torch.randn(13, 40), torch.randn(40), torch.randn(13, 40)
    y1, r1 = _MOD.rms_norm_cpu_forward(x, w, 1e-6)
    dx1 = _MOD.rms_norm_cpu_backward(dy, x, w, r1)
    monkeypatch.setattr(_MOD, "threads", lambda name, n: 3)
    y3, r3 = _MOD.rms_norm_cpu_forward(x, w, 1e-6)
    assert torch.equal(y1, y3) and torch.equal(r1, r3) and torch.equal(dx1, _MOD.rms_norm_cpu_backward(dy, x, w, r3))


def test_backend_choice(monkeypatch):
    x, w = torch.zeros(2, 4), torch.zeros(4)
    assert rms_norm_backend(x.double(), w.double()) == "torch"
    assert rms_norm_backend(x.bfloat16(), w) == "torch"
    assert rms_norm_backend(x, torch.zeros(3)) == "torch"
    monkeypatch.setenv("FTLIB_RMSNORM_BACKEND", "torch")
    assert rms_norm_backend(x, w) == "torch"
    monkeypatch.setenv("FTLIB_RMSNORM_BACKEND", "fast")
    with pytest.raises(ValueError, match="FTLIB_RMSNORM_BACKEND"):
        rms_norm_backend(x, w)
