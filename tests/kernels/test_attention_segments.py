"""Separate query / key segments (``cu_seqlens_k``): the reference, the Triton kernel, SDPA and the op.

Query segment s attends to key segment s, causal bottom-right aligned per pair (both segments end
at the same position; flash-attn's ``flash_attn_varlen_func`` with cu_seqlens_q != cu_seqlens_k).
The reference is checked against one dense float64 mask written over the concatenated rows; the
kernel (interpreter, fp32 / fp16: the interpreter's bf16 dot is broken) and SDPA against the
reference in float64: output, log-sum-exp and every gradient, normwise tolerances as in
test_attention_triton.py. Pairs: q shorter than k, equal, a single query token, an empty query
segment, q longer than k (its first rows see no key), lengths across the 16-wide interpreter tiles.
"""

from __future__ import annotations

import pytest
import torch

from ftlib.kernels import attention
from ftlib.kernels.attention_ref import attention_ref
from ftlib.kernels.attention_sdpa import attention_sdpa

PAIRS = [(3, 7), (5, 5), (1, 9), (0, 4), (17, 40), (6, 2), (20, 21)]  # (Tq, Tk) per segment
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 4e-3)}


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(pairs, dtype, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    nq, nk = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    q = torch.randn(nq, hq, d, generator=g).to(dtype)
    k = torch.randn(nk, hkv, d, generator=g).to(dtype)
    v = torch.randn(nk, hkv, d, generator=g).to(dtype)
    return q, k, v, _cu([p[0] for p in pairs]), _cu([p[1] for p in pairs])


def _brute(q, k, v, cq, ck, scale, window=None, softcap=None):
    """One [Nq, Nk] float64 mask over the concatenated rows: same pair, j - k0 <= i - q0 + (Tk - Tq), window."""
    allowed = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    for s in range(len(cq) - 1):
        q0, q1, k0, k1 = int(cq[s]), int(cq[s + 1]), int(ck[s]), int(ck[s + 1])
        i = torch.arange(q0, q1)[:, None] - q0 + (k1 - k0) - (q1 - q0)  # the query's position in key coordinates
        j = torch.arange(k0, k1)[None, :] - k0
        m = j <= i
        if window is not None:
            m &= j > i - window
        allowed[q0:q1, k0:k1] = m
    g = q.shape[1] // k.shape[1]
    kr, vr = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kr) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, vr)


def _normwise(name, got, want, tol):
    err = (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
    assert err <= tol, f"{name}: normwise error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("extra", [{}, {"sliding_window": 3}, {"softcap": 2.0}])
def test_reference_equals_one_dense_mask(extra):
    q, k, v, cq, ck = _inputs(PAIRS, torch.float64)
    got = attention_ref(q, k, v, cu_seqlens=cq, cu_seqlens_k=ck, softmax_scale=0.5, **extra)
    want = _brute(q, k, v, cq, ck, 0.5, extra.get("sliding_window"), extra.get("softcap"))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_default_keys_are_the_query_segments():
    q, k, v, cq, _ = _inputs([(5, 5), (9, 9), (1, 1)], torch.float64)
    a = attention_ref(q, k, v, cu_seqlens=cq)
    torch.testing.assert_close(attention_ref(q, k, v, cu_seqlens=cq, cu_seqlens_k=cq), a, rtol=0, atol=1e-13)
    torch.testing.assert_close(attention(q, k, v, cu_seqlens=cq, cu_seqlens_k=cq), a, rtol=0, atol=1e-13)


@pytest.mark.parametrize("extra", [{}, {"sliding_window": 4}, {"softcap": 2.0}])
def test_sdpa_and_the_op_equal_the_reference(extra):
    q, k, v, cq, ck = _inputs(PAIRS, torch.float32, seed=1)
    qs, ks, vs = (t.double().requires_grad_() for t in (q, k, v))
    want = attention_ref(qs, ks, vs, cu_seqlens=cq, cu_seqlens_k=ck, **extra)
    do = torch.randn(want.shape, dtype=torch.float64)
    gw = torch.autograd.grad(want, (qs, ks, vs), do)
    for fn in (attention_sdpa, attention):
        qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
        got = fn(qa, ka, va, cu_seqlens=cq, cu_seqlens_k=ck, **extra)
        _normwise(f"{fn.__name__} o", got, want.detach(), 1e-5)
        for a, b, name in zip(torch.autograd.grad(got, (qa, ka, va), do.float()), gw, "qkv"):
            _normwise(f"{fn.__name__} d{name}", a, b, 1e-5)


def test_mismatched_segments_are_refused():
    q, k, v, cq, ck = _inputs([(3, 7), (5, 5)], torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens_k has 1 segments, cu_seqlens 2"):
        attention_ref(q, k, v, cu_seqlens=cq, cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_k, over the 12 key rows"):
        attention_sdpa(q, k, v, cu_seqlens=cq, cu_seqlens_k=torch.tensor([0, 7, 11], dtype=torch.int32))


# ---- the Triton kernel (interpreter on CPU) ------------------------------------------------------

triton_cases = pytest.mark.parametrize("dtype,extra,hkv", [
    (torch.float32, {}, 2), (torch.float16, {}, 2), (torch.float32, {}, 4), (torch.float32, {"sliding_window": 5}, 2),
    (torch.float16, {"sliding_window": 5}, 1), (torch.float32, {"softcap": 2.0}, 2),
])


@triton_cases
def test_triton_equals_the_reference(dtype, extra, hkv):
    pytest.importorskip("triton")
    from ftlib.kernels.attention_triton import attention_triton

    q, k, v, cq, ck = _inputs(PAIRS, dtype, hkv=hkv, seed=2)
    qs, ks, vs = (t.double().requires_grad_() for t in (q, k, v))
    want, lse_w = attention_ref(qs, ks, vs, cu_seqlens=cq, cu_seqlens_k=ck, return_lse=True, **extra)
    do = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    gw = torch.autograd.grad(want, (qs, ks, vs), do)
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    got, lse = attention_triton(qa, ka, va, cu_seqlens=cq, cu_seqlens_k=ck, max_seqlen=20, max_seqlen_k=40,
                                return_lse=True, **extra)
    tol_o, tol_g = TOL[dtype]
    _normwise("o", got, want.detach(), tol_o)
    seen = torch.isfinite(lse_w)
    assert torch.equal(torch.isfinite(lse), seen), "rows that see no key: lse must be -inf exactly there"
    _normwise("lse", lse[seen], lse_w[seen].detach(), tol_o)
    for a, b, name in zip(torch.autograd.grad(got, (qa, ka, va), do.to(dtype)), gw, "qkv"):
        _normwise(f"d{name}", a, b, tol_g)


def test_triton_default_is_unchanged():
    """cu_seqlens_k = cu_seqlens (the SEPARATE_K launch) gives the same bits as the plain varlen launch."""
    pytest.importorskip("triton")
    from ftlib.kernels.attention_triton import attention_triton

    q, k, v, cq, _ = _inputs([(5, 5), (19, 19), (1, 1)], torch.float32, seed=4)
    a = attention_triton(q, k, v, cu_seqlens=cq)
    b = attention_triton(q, k, v, cu_seqlens=cq, cu_seqlens_k=cq)
    assert torch.equal(a, b)


def test_triton_refuses_bad_key_segments():
    pytest.importorskip("triton")
    from ftlib.kernels.attention_triton import attention_triton

    q, k, v, cq, ck = _inputs([(3, 7), (5, 5)], torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens_k must rise from 0 to N=12"):
        attention_triton(q, k, v, cu_seqlens=cq, cu_seqlens_k=torch.tensor([0, 7, 13], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_k=4 < longest"):
        attention_triton(q, k, v, cu_seqlens=cq, cu_seqlens_k=ck, max_seqlen_k=4)
    with pytest.raises(ValueError, match="cu_seqlens_k has 1 segments"):
        attention_triton(q, k, v, cu_seqlens=cq, cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32))


def test_the_cpu_kernel_is_not_chosen_for_separate_keys(monkeypatch):
    """The CPU wing's kernel has no key segments: auto takes SDPA, forcing it is an error naming why."""
    from ftlib.kernels import attention_backend

    q, k, v, cq, ck = _inputs(PAIRS, torch.float32)
    assert attention_backend(q, None, k, v, separate_k=True) == "sdpa"
    monkeypatch.setenv("FTLIB_ATTN_BACKEND", "cpu")
    with pytest.raises(RuntimeError, match="no separate key segments"):
        attention(q, k, v, cu_seqlens=cq, cu_seqlens_k=ck)
