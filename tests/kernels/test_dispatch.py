"""Attention backend selection: the decision table, forcing, and errors instead of fallbacks."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ftlib.kernels import attention, attention_backend, attention_ref, attention_sdpa
from ftlib.kernels.attention import _choose

HAVE_FLASH = importlib.util.find_spec("flash_attn") is not None


def _choice(want="auto", *, is_cuda=True, dtype=torch.bfloat16, head_dim=128, masked=False,
            have_flash=True, have_triton=True, interpret=False, cpu_why="no CPU kernel for this call"):
    return _choose(want, is_cuda=is_cuda, dtype=dtype, head_dim=head_dim, masked=masked,
                   have_flash=have_flash, have_triton=have_triton, interpret=interpret, cpu_why=cpu_why)


@pytest.mark.parametrize(
    "case,expected",
    [
        (dict(), "flash"),
        (dict(dtype=torch.float16, head_dim=256), "flash"),
        (dict(have_flash=False), "triton"),
        (dict(dtype=torch.float32), "triton"),  # flash-attn has no fp32 kernel
        (dict(head_dim=512), "sdpa"),
        (dict(dtype=torch.float64), "sdpa"),
        (dict(masked=True), "sdpa"),  # key_padding_mask: neither fused kernel takes it
        (dict(have_flash=False, have_triton=False), "sdpa"),
        (dict(is_cuda=False), "sdpa"),
        (dict(is_cuda=False, dtype=torch.float64), "sdpa"),
        (dict(is_cuda=False, interpret=True), "sdpa"),  # auto never picks the interpreter
        (dict(is_cuda=False, dtype=torch.float32, cpu_why=None), "cpu"),  # the CPU wing's kernel takes it
        (dict(is_cuda=False, dtype=torch.float32, cpu_why=None, masked=True), "sdpa"),
    ],
)
def test_auto_decision_table(case, expected):
    assert _choice(**case) == expected


def test_forced_backends():
    assert _choice("torch", is_cuda=False, have_flash=False, have_triton=False) == "torch"
    assert _choice("torch", masked=True) == "torch"  # the reference takes every call, masks too
    assert _choice("sdpa", have_flash=True) == "sdpa"
    assert _choice("sdpa", is_cuda=False, dtype=torch.float64, head_dim=512) == "sdpa"
    assert _choice("triton", have_flash=True) == "triton"
    assert _choice("flash", dtype=torch.float16) == "flash"
    assert _choice("triton", is_cuda=False, interpret=True, dtype=torch.float32) == "triton"
    # A forced, available kernel still sends key_padding_mask calls to SDPA.
    assert _choice("triton", masked=True) == "sdpa"
    assert _choice("flash", masked=True) == "sdpa"
    assert _choice("cpu", is_cuda=False, dtype=torch.float32, cpu_why=None) == "cpu"
    assert _choice("cpu", masked=True) == "sdpa"
    with pytest.raises(RuntimeError, match="FTLIB_ATTN_BACKEND=cpu cannot run this call: the build failed"):
        _choice("cpu", is_cuda=False, dtype=torch.float32, cpu_why="the build failed")


@pytest.mark.parametrize(
    "case,match",
    [
        (dict(want="flash", have_flash=False), "flash_attn is not installed"),
        (dict(want="triton", have_triton=False), "triton is not installed"),
        (dict(want="flash", is_cuda=False), "needs CUDA"),
        (dict(want="flash", is_cuda=False, masked=True), "needs CUDA"),  # misconfiguration caught early
        (dict(want="triton", is_cuda=False), "needs CUDA"),
        (dict(want="flash", dtype=torch.float32), "float16/bfloat16"),
        (dict(want="triton", dtype=torch.float64), "float16/bfloat16/float32"),
        (dict(want="triton", head_dim=320), "head dim 320"),
    ],
)
def test_forcing_an_unavailable_backend_raises(case, match):
    with pytest.raises(RuntimeError, match=match):
        _choice(**case)


def test_env_var_is_validated(monkeypatch):
    q = torch.randn(4, 2, 8)
    monkeypatch.setenv("FTLIB_ATTN_BACKEND", "cuda")
    with pytest.raises(ValueError, match="FTLIB_ATTN_BACKEND='cuda'"):
        attention(q, q, q)
    monkeypatch.setenv("FTLIB_ATTN_BACKEND", " Torch ")  # case and spaces are forgiven
    assert attention_backend(q) == "torch"


def test_auto_on_cpu_is_sdpa_and_torch_is_the_reference(monkeypatch):
    monkeypatch.delenv("FTLIB_ATTN_BACKEND", raising=False)
    q = torch.randn(1, 5, 2, 8)
    assert attention_backend(q) == "sdpa"
    assert torch.equal(attention(q, q, q, causal=True), attention_sdpa(q, q, q, causal=True))
    monkeypatch.setenv("FTLIB_ATTN_BACKEND", "torch")
    assert attention_backend(q) == "torch"
    assert torch.equal(attention(q, q, q, causal=True), attention_ref(q, q, q, causal=True))


def test_forced_triton_runs_the_kernel_on_cpu_under_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    from ftlib.kernels.attention_triton import attention_triton

    monkeypatch.setenv("FTLIB_ATTN_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    q, k, v = torch.randn(21, 2, 16), torch.randn(21, 1, 16), torch.randn(21, 1, 16)
    cu = torch.tensor([0, 9, 21], dtype=torch.int32)
    assert attention_backend(q) == "triton"
    out = attention(q, k, v, causal=True, cu_seqlens=cu, max_seqlen=12)
    assert torch.equal(out, attention_triton(q, k, v, causal=True, cu_seqlens=cu, max_seqlen=12))
    torch.testing.assert_close(out, attention_ref(q, k, v, causal=True, cu_seqlens=cu), atol=1e-5, rtol=1e-5)
    # key_padding_mask goes to SDPA even when triton is forced.
    qd = torch.randn(1, 6, 2, 8)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    assert attention_backend(qd, mask) == "sdpa"
    torch.testing.assert_close(attention(qd, qd, qd, key_padding_mask=mask),
                               attention_ref(qd, qd, qd, key_padding_mask=mask))


def test_forced_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("FTLIB_ATTN_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        attention(torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8))


@pytest.mark.skipif(HAVE_FLASH, reason="flash_attn is installed here")
def test_forced_flash_without_flash_attn_raises(monkeypatch):
    monkeypatch.setenv("FTLIB_ATTN_BACKEND", "flash")
    with pytest.raises(RuntimeError, match="flash_attn is not installed"):
        attention(torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flash", "sdpa", "torch"])
def test_gpu_every_backend_agrees(monkeypatch, backend):
    if backend == "flash" and not HAVE_FLASH:
        pytest.skip("flash_attn not installed")
    monkeypatch.setenv("FTLIB_ATTN_BACKEND", backend)
    torch.manual_seed(0)
    lens = [3, 200, 57]
    n = sum(lens)
    cu = torch.tensor([0, 3, 203, 260], dtype=torch.int32, device="cuda")
    q = torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, 2, 128, device="cuda", dtype=torch.bfloat16)
    assert attention_backend(q) == backend
    out = attention(q, k, v, causal=True, cu_seqlens=cu, max_seqlen=max(lens))
    want = attention_ref(q.double(), k.double(), v.double(), causal=True, cu_seqlens=cu)
    err = (out.double() - want).abs().max() / want.abs().max()
    assert err < 1.6e-2, f"{backend}: normwise error {err:.3g}"
    qd, kd, vd = (t[:200].view(2, 100, -1, 128) for t in (q, k, v))  # dense, Tq = Tk
    out = attention(qd, kd, vd, causal=True)
    want = attention_ref(qd.double(), kd.double(), vd.double(), causal=True)
    assert (out.double() - want).abs().max() / want.abs().max() < 1.6e-2


@pytest.mark.parametrize("backend", ["torch", "sdpa", "auto"])
@pytest.mark.parametrize("cu", [[0, 4.7, 10], [0.0, 4.0, 10.0], [False, True]])
def test_non_integer_cu_seqlens_are_refused_naming_the_dtype(monkeypatch, backend, cu):
    """cu_seqlens are document boundaries: a float tensor ([0, 4.7, 10] was truncated to [0, 4, 10] and
    ran) or a bool one is refused with a ValueError naming the dtype, on every CPU backend and in the C++
    kernel's own entry."""
    from ftlib.cpu import flash_attn_cpu_forward, flash_attn_cpu_unsupported

    monkeypatch.setenv("FTLIB_ATTN_BACKEND", backend)
    q = torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match=r"cu_seqlens must be an integer tensor.*torch\.(float32|bool)"):
        attention(q, q, q, cu_seqlens=torch.tensor(cu))
    if flash_attn_cpu_unsupported(q, q, q) is None:
        with pytest.raises(ValueError, match="cu_seqlens must be an integer tensor"):
            flash_attn_cpu_forward(q, q, q, torch.tensor(cu), True, 0.35)


def test_integer_cu_seqlens_of_any_width_are_accepted(monkeypatch):
    monkeypatch.setenv("FTLIB_ATTN_BACKEND", "sdpa")
    q = torch.randn(10, 2, 8)
    ref = attention(q, q, q, cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32))
    for dt in (torch.int64, torch.int16, torch.uint8):
        assert torch.equal(attention(q, q, q, cu_seqlens=torch.tensor([0, 4, 10], dtype=dt)), ref)
