"""The SDPA attention path (CPU default) against the float64 reference: ragged packs, padding, decode, grads."""

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.kernels import attention_ref, attention_sdpa
from ftlib.kernels.attention_sdpa import _varlen_fwd

sdpa_mod = importlib.import_module("ftlib.kernels.attention_sdpa")  # the module (the package attribute is the function)
TOL = dict(rtol=1e-10, atol=1e-10)  # float64: both sides are exact softmax attention up to rounding


def _grads(fn, q, k, v, g, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), g))


def _pack(lens, hq, hkv, d, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(n, hq, d, generator=gen, dtype=dtype)
    k, v = (torch.randn(n, hkv, d, generator=gen, dtype=dtype) for _ in range(2))
    return q, k, v, torch.randn(n, hq, d, generator=gen, dtype=dtype), cu


@pytest.fixture(params=["cpu-flash", "recompute"])
def path(request, monkeypatch):
    """Both implementations: ATen's CPU flash kernels, and the portable per-document recompute."""
    if request.param == "recompute":
        monkeypatch.setattr(sdpa_mod, "_cpu_flash_available", lambda: False)
    return request.param


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(0, 41), min_size=1, max_size=6), st.sampled_from([(1, 1), (4, 2), (6, 1), (3, 3)]),
       st.sampled_from([8, 24]), st.booleans(), st.integers(0, 1000))
def test_ragged_pack_equals_reference_float64_with_every_gradient(lens, heads, d, causal, seed):
    """Invariant: on any pack (empty and one-token documents included, GQA, causal or not) output
    and dq, dk, dv equal the float64 reference, on both implementation paths."""
    if sum(lens) == 0:
        lens = lens + [1]
    q, k, v, g, cu = _pack(lens, *heads, d, seed)
    for flash in (True, False):
        orig = sdpa_mod._cpu_flash_available
        sdpa_mod._cpu_flash_available = (lambda: True) if flash else (lambda: False)
        try:
            got = _grads(attention_sdpa, q, k, v, g, causal=causal, cu_seqlens=cu, softmax_scale=0.37)
            ref = _grads(attention_ref, q, k, v, g, causal=causal, cu_seqlens=cu, softmax_scale=0.37)
        finally:
            sdpa_mod._cpu_flash_available = orig
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name, f=flash: f"{n} (flash={f}): {m}")


def test_documents_never_see_each_other(path):
    """Changing one document's keys/values changes no other document's output."""
    q, k, v, _, cu = _pack([5, 9, 1, 13], 4, 2, 8, seed=3)
    base = attention_sdpa(q, k, v, causal=True, cu_seqlens=cu)
    k2, v2 = k.clone(), v.clone()
    k2[5:14] += 1.0
    v2[5:14] -= 2.0
    moved = attention_sdpa(q, k2, v2, causal=True, cu_seqlens=cu)
    assert torch.equal(moved[:5], base[:5]) and torch.equal(moved[14:], base[14:])
    assert not torch.allclose(moved[5:14], base[5:14])


@pytest.mark.parametrize("tq,tk,causal", [(7, 7, True), (7, 7, False), (1, 9, True), (3, 9, True), (4, 6, False)])
def test_dense_equals_reference_with_padding_mask_and_grads(path, tq, tk, causal):
    """Dense layout incl. bottom-right causal decode (Tq < Tk) and a key mask with a fully masked
    row (left padding): zeros there, no NaN in any gradient, everything equal to the reference."""
    gen = torch.Generator().manual_seed(tq * 31 + tk)
    q = torch.randn(2, tq, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, tk, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    g = torch.randn(2, tq, 4, 8, generator=gen, dtype=torch.float64)
    mask = torch.ones(2, tk, dtype=torch.long)
    mask[1, : tk - 1] = 0  # row 1 sees only its last key: with causal and tq == tk most of its queries see none
    for kpm in (None, mask):
        got = _grads(attention_sdpa, q, k, v, g, causal=causal, key_padding_mask=kpm)
        want = _grads(attention_ref, q, k, v, g, causal=causal, key_padding_mask=kpm)
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
            assert torch.isfinite(a).all(), name
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name, p=kpm: f"{n} mask={p is not None}: {m}")


def test_float32_close_to_float64_reference():
    q, k, v, g, cu = _pack([3, 17, 40, 1], 8, 4, 64, seed=5)
    got = _grads(attention_sdpa, *(t.float() for t in (q, k, v)), g.float(), causal=True, cu_seqlens=cu)
    want = _grads(attention_ref, q, k, v, g, causal=True, cu_seqlens=cu)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_custom_op_registration_is_consistent():
    """torch.library.opcheck: fake (meta) shapes, schema and autograd registration of the varlen op."""
    q, k, v, _, cu = _pack([3, 0, 6], 4, 2, 8, seed=7)
    for t in (q, k, v):
        t.requires_grad_()
    torch.library.opcheck(_varlen_fwd, (q, k, v, cu, True, 0.25))


def test_compiles_without_graph_break_and_layout_changes_do_not_recompile():
    """A function around the varlen op compiles with fullgraph=True; a new document layout of the same
    number of tokens (another cu_seqlens length and values) reuses the compiled graph."""
    import torch._dynamo

    torch._dynamo.reset()
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def f(q, k, v, cu):
        return attention_sdpa(q * 2.0, k, v, causal=True, cu_seqlens=cu).sum()

    q, k, v, _, _ = _pack([10], 4, 2, 8, seed=9, dtype=torch.float32)
    layouts = [[3, 7], [1, 2, 3, 4], [10], [5, 5], [2, 2, 2, 2, 2]]
    for lens in layouts:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        torch._dynamo.maybe_mark_dynamic(cu, 0)
        want = attention_sdpa(q * 2.0, k, v, causal=True, cu_seqlens=cu).sum()
        torch.testing.assert_close(f(q, k, v, cu), want)
    assert len(compiles) == 1, f"{len(compiles)} compilations for {len(layouts)} layouts"


def test_bad_inputs_raise():
    q, k, v, _, cu = _pack([3, 4], 2, 1, 8, seed=11)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to N=7"):
        attention_sdpa(q, k, v, cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attention_sdpa(q, torch.randn(7, 3, 8, dtype=torch.float64), torch.randn(7, 3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="key_padding_mask must be"):
        attention_sdpa(q[None], k[None], v[None], key_padding_mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match="dense layout only"):
        attention_sdpa(q, k, v, key_padding_mask=torch.ones(1, 7))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_gpu_fallback_path_with_gradients(dtype, tol):
    """On CUDA the SDPA path is the fallback (per-document SDPA forward, recomputed backward)."""
    q, k, v, g, cu = _pack([3, 200, 57, 1], 8, 2, 64, seed=13)
    want = _grads(attention_ref, q, k, v, g, causal=True, cu_seqlens=cu)
    dev = [t.to("cuda", dtype) for t in (q, k, v, g)]
    got = _grads(attention_sdpa, *dev[:3], dev[3], causal=True, cu_seqlens=cu.cuda())
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        err = (a.double().cpu() - b).abs().max() / b.abs().max()
        assert err < tol, f"{name}: normwise error {err:.3g}"
