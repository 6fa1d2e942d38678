"""``rope``: both backends against float64 ``x * cos + rotate_half(x) * sin`` (value and the input
gradient, arbitrary cos/sin), what backward keeps, the thread split, and the backend choice."""

import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftlib.kernels import rope, rope_backend, rotate_half

_MOD = importlib.import_module("ftlib.cpu.rope")


def _cpp_available() -> bool:
    x = torch.zeros(1, 1, 1, 2)
    return rope_backend(x, torch.zeros(1, 1, 2), torch.zeros(1, 1, 2)) == "cpu"


def _reference(x, cos, sin):
    return x * cos.unsqueeze(-2) + rotate_half(x) * sin.unsqueeze(-2)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 2), st.integers(1, 9), st.integers(1, 5), st.sampled_from([2, 6, 16, 18, 34, 64]),
       st.integers(0, 2**31 - 1))
def test_rope_matches_float64_reference(monkeypatch, backend, b, t, h, d, seed):
    """Invariant: y = x cos + rotate_half(x) sin and dx = dy cos - rotate_half(dy sin) (the
    transpose) to fp32 rounding, for cos/sin with unequal halves too (the kernels read both), head
    dims with a vector body and a scalar tail."""
    if backend == "cpu" and not _cpp_available():
        pytest.skip("ftlib/cpu/csrc/rope.cpp needs a C++ compiler and an AVX2 + FMA CPU")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, h, d, generator=gen).requires_grad_()
    cos, sin = torch.randn(b, t, d, generator=gen), torch.randn(b, t, d, generator=gen)
    dy = torch.randn(b, t, h, d, generator=gen)
    monkeypatch.setenv("FTLIB_ROPE_BACKEND", backend)
    assert rope_backend(x, cos, sin) == backend
    y = rope(x, cos, sin)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    y64 = _reference(x64, cos.double(), sin.double())
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_backward_keeps_only_the_tables(monkeypatch, backend):
    """Backward keeps cos and sin only (as autograd through the textbook ops does): no [B, T, H, D]."""
    if backend == "cpu" and not _cpp_available():
        pytest.skip("ftlib/cpu/csrc/rope.cpp needs a C++ compiler and an AVX2 + FMA CPU")
    monkeypatch.setenv("FTLIB_ROPE_BACKEND", backend)
    x = torch.randn(2, 7, 3, 8, requires_grad=True)
    q = x * 2.0
    cos, sin = torch.randn(2, 7, 8), torch.randn(2, 7, 8)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        rope(q, cos, sin)
    assert [tuple(s.shape) for s in saved] == [(2, 7, 8), (2, 7, 8)]


def test_cpp_thread_split_is_bit_equal(monkeypatch):
    if not _cpp_available():
        pytest.skip("ftlib/cpu/csrc/rope.cpp needs a C++ compiler and an AVX2 + FMA CPU")
    x, cos, sin = torch.randn(1, 13, 4, 64), torch.randn(1, 13, 64), torch.randn(1, 13, 64)
    one = [_MOD.rope_cpu(x, cos, sin, adj) for adj in (False, True)]
    monkeypatch.setattr(_MOD, "threads", lambda name, n: 3)
    for adj, want in zip((False, True), one):
        assert torch.equal(_MOD.rope_cpu(x, cos, sin, adj), want)


def test_tables_with_grad_use_the_plain_form():
    """cos/sin that require grad get their gradient (the autograd form), x its own."""
    x = torch.randn(1, 3, 2, 4, requires_grad=True)
    cos, sin = torch.randn(1, 3, 4, requires_grad=True), torch.randn(1, 3, 4, requires_grad=True)
    rope(x, cos, sin).sum().backward()
    assert cos.grad is not None and sin.grad is not None
    torch.testing.assert_close(cos.grad, x.detach().sum(-2))


def test_backend_choice(monkeypatch):
    x, c = torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 4)
    assert rope_backend(x.double(), c.double(), c.double()) == "torch"
    assert rope_backend(x, c[:, :1], c[:, :1]) == "torch"  # tables not [B, T, D] of x: the broadcasting ops
    monkeypatch.setenv("FTLIB_ROPE_BACKEND", "torch")
    assert rope_backend(x, c, c) == "torch"
    monkeypatch.setenv("FTLIB_ROPE_BACKEND", "cuda")
    with pytest.raises(ValueError, match="FTLIB_ROPE_BACKEND"):
        rope_backend(x, c, c)
