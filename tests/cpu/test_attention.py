"""The CPU wing's flash kernels (``ftlib.cpu.attention``, ``ftlib/cpu/csrc/flash_attn.cpp``) against the
float64 reference: ragged packs, GQA, every gradient, lse against ATen's, thread counts, masking
exactness, NaN, and the backend choice through ``attention``."""

import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftlib.cpu import flash_attn_cpu_backward, flash_attn_cpu_forward, flash_attn_cpu_unsupported
from ftlib.kernels import attention, attention_backend, attention_ref

_MOD = importlib.import_module("ftlib.cpu.attention")


def _available() -> bool:
    x = torch.zeros(1, 1, 8)
    return flash_attn_cpu_unsupported(x, x, x) is None


pytestmark = pytest.mark.skipif(not _available(), reason="csrc/flash_attn.cpp needs a C++ compiler and AVX2 + FMA")


def _pack(lens, hq, hkv, d, seed, spread=1.0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(n, hq, d, generator=gen, dtype=torch.float64) * spread
    k, v = (torch.randn(n, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(n, hq, d, generator=gen, dtype=torch.float64), cu


def _reference(q, k, v, g, cu, causal, scale):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = attention_ref(q, k, v, causal=causal, cu_seqlens=cu, softmax_scale=scale)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), g))


def _close(got, ref, name):
    """fp32 against float64: within 2e-5 of the largest entry (the kernels sum up to D or L terms in fp32)."""
    tol = 2e-5 * max(1.0, ref.abs().max().item())
    err = (got.double() - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from([0, 1, 2, 7, 31, 32, 33, 63, 64, 65, 100]), min_size=1, max_size=5),
       st.sampled_from([(1, 1), (4, 2), (6, 2), (3, 1), (4, 4)]), st.sampled_from([8, 16, 24, 72]), st.booleans(),
       st.sampled_from([0.05, 0.3, 1.0, 3.0]), st.sampled_from([1, 2, 3]), st.integers(0, 10_000))
def test_forward_and_every_gradient_match_float64_reference(monkeypatch, lens, heads, d, causal, scale, threads,
                                                            seed):
    """Invariant: o, dq, dk, dv equal the float64 reference to fp32 rounding on any pack: empty,
    one-token and block-boundary (31/32/33, 63/64/65) documents, grouped heads, causal or not,
    scales that make one key dominate, 1-3 threads."""
    if sum(lens) == 0:
        lens = [*lens, 5]
    monkeypatch.setattr(_MOD, "threads", lambda name, n: threads)
    q, k, v, g, cu = _pack(lens, *heads, d, seed)
    ref = _reference(q, k, v, g, cu, causal, scale)
    qf, kf, vf = q.float(), k.float(), v.float()
    o, lse = flash_attn_cpu_forward(qf, kf, vf, cu, causal, scale)
    grads = flash_attn_cpu_backward(g.float(), qf, kf, vf, o, lse, cu, causal, scale)
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, *grads), ref):
        _close(a, b, name)


def test_running_max_is_rescaled_when_a_later_key_block_dominates():
    """The forward's running maximum grows block by block (keys with rising norms, scores up to
    ~600): the rescale of the partial sums is exercised, output and gradients still exact."""
    lens, d = [150, 97], 16
    q, k, v, g, cu = _pack(lens, 4, 2, d, seed=5)
    k = k * torch.linspace(0.1, 6.0, k.shape[0], dtype=torch.float64)[:, None, None]
    q = q.abs() * 3.0
    k = k.abs()
    ref = _reference(q, k, v, g, cu, True, 1.0)
    o, lse = flash_attn_cpu_forward(q.float(), k.float(), v.float(), cu, True, 1.0)
    assert lse.max() > 300  # the scores are in the hundreds
    grads = flash_attn_cpu_backward(g.float(), q.float(), k.float(), v.float(), o, lse, cu, True, 1.0)
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, *grads), ref):
        _close(a, b, name)


def test_lse_matches_atens_and_the_backwards_are_interchangeable():
    """lse has ATen's definition and [Hq, N] layout: ATen's per-document forward gives the same lse,
    and its backward fed this kernel's o and lse equals this kernel's backward."""
    lens, hq, hkv, d, scale = [40, 77, 3], 6, 2, 32, 0.2
    q, k, v, g, cu = (t.float() if t.is_floating_point() else t for t in _pack(lens, hq, hkv, d, seed=9))
    o, lse = flash_attn_cpu_forward(q, k, v, cu, True, scale)
    mine = flash_attn_cpu_backward(g, q, k, v, o, lse, cu, True, scale)
    bounds = cu.tolist()
    for s, e in zip(bounds, bounds[1:]):
        qs, ks, vs, gs, os_ = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v, g, o))
        o_a, lse_a = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, ks, vs, 0.0, True, scale=scale)
        torch.testing.assert_close(lse[:, s:e], lse_a[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o[s:e], o_a[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
        theirs = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            gs, qs, ks, vs, os_, lse[None, :, s:e], 0.0, True, scale=scale)
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a[s:e], b[0].transpose(0, 1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lens,heads", [([70, 5, 130, 33], (8, 4)), ([150], (4, 1)), ([200, 9], (6, 2))])
def test_fixed_for_a_thread_count_and_split_backward_exact(monkeypatch, lens, heads):
    """For a given thread count the results are bitwise fixed (every task is computed by one thread
    in a fixed order; a (document, kv head) the backward splits over key ranges sums its parts' dQ
    in part order). One long document with fewer kv heads than threads is split: with 2, 3 and 5
    threads the gradients still equal float64."""
    q, k, v, g, cu = _pack(lens, *heads, 16, seed=2)
    ref = _reference(q, k, v, g, cu, True, 0.25)
    qf, kf, vf, gf = q.float(), k.float(), v.float(), g.float()
    for threads in (1, 2, 3, 5):
        monkeypatch.setattr(_MOD, "threads", lambda name, n, t=threads: t)
        runs = []
        for _ in range(2):
            o, lse = flash_attn_cpu_forward(qf, kf, vf, cu, True, 0.25)
            runs.append((o, lse, *flash_attn_cpu_backward(gf, qf, kf, vf, o, lse, cu, True, 0.25)))
        for a, b in zip(*runs):
            assert torch.equal(a, b)
        for name, a, b in zip(("o", "dq", "dk", "dv"), (runs[0][0], *runs[0][2:]), ref):
            _close(a, b, f"{name} ({threads} threads)")


def test_masked_keys_contribute_exactly_nothing():
    """Causal masking and document bounds are exact (masked P entries are set to 0): moving a
    later key of the same document or any key of another document leaves earlier rows and other
    documents bitwise unchanged, gradients included."""
    q, k, v, g, cu = (t.float() if t.is_floating_point() else t for t in _pack([45, 80], 4, 2, 8, seed=4))
    o, lse = flash_attn_cpu_forward(q, k, v, cu, True, 0.3)
    dq, dk, dv = flash_attn_cpu_backward(g, q, k, v, o, lse, cu, True, 0.3)
    k2, v2 = k.clone(), v.clone()
    k2[60:] += 3.0  # the second document's keys 15.. onwards
    v2[60:] -= 5.0
    o2, lse2 = flash_attn_cpu_forward(q, k2, v2, cu, True, 0.3)
    dq2, _, _ = flash_attn_cpu_backward(g, q, k2, v2, o2, lse2, cu, True, 0.3)
    assert torch.equal(o2[:60], o[:60]) and torch.equal(lse2[:, :60], lse[:, :60])
    assert torch.equal(dq2[:60], dq[:60])
    assert not torch.allclose(o2[60:], o[60:])


def test_nan_propagates_and_stays_in_its_document():
    """A NaN query row yields NaN output in that row and head only (not a finite guess), and the
    other documents stay finite and unchanged."""
    q, k, v, g, cu = (t.float() if t.is_floating_point() else t for t in _pack([20, 40], 2, 1, 8, seed=6))
    o, _ = flash_attn_cpu_forward(q, k, v, cu, True, 0.5)
    q[25, 1, 3] = float("nan")
    o2, lse2 = flash_attn_cpu_forward(q, k, v, cu, True, 0.5)
    assert torch.isnan(o2[25, 1]).all() and torch.isnan(lse2[1, 25])
    assert torch.equal(o2[:20], o[:20]) and torch.isfinite(o2[:25]).all()
    k[30, 0, 0] = float("nan")  # a key: every later row of its document sees it
    o3, _ = flash_attn_cpu_forward(q, k, v, cu, True, 0.5)
    assert torch.isnan(o3[30:]).all() and torch.equal(o3[:20], o[:20])


def test_attention_entry_point_uses_it_and_the_env_switch(monkeypatch):
    """``attention`` on packed fp32 CPU inputs runs this kernel under auto and cpu (values and gradients
    equal the reference); FTLIB_ATTN_BACKEND=sdpa gives ATen's kernels the same answer; fp64 and a head
    dim not a multiple of 8 go to sdpa under auto and are an error naming why when cpu is forced."""
    q, k, v, g, cu = _pack([19, 64, 1, 50], 4, 2, 16, seed=8)
    ref = _reference(q, k, v, g, cu, True, None)
    calls = []
    real = _MOD.flash_attn_cpu_forward
    launcher = importlib.import_module("ftlib.kernels.attention_cpu")
    monkeypatch.setattr(launcher, "flash_attn_cpu_forward", lambda *a: calls.append(1) or real(*a))
    for backend in ("auto", "cpu", "sdpa"):
        monkeypatch.setenv("FTLIB_ATTN_BACKEND", backend)
        calls.clear()
        qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
        assert attention_backend(qf, None, kf, vf) == ("sdpa" if backend == "sdpa" else "cpu")
        o = attention(qf, kf, vf, causal=True, cu_seqlens=cu)
        got = (o, *torch.autograd.grad(o, (qf, kf, vf), g.float()))
        assert len(calls) == (0 if backend == "sdpa" else 1)
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, ref):
            _close(a.detach(), b, f"{name} ({backend})")
    x = torch.zeros(3, 2, 12)
    monkeypatch.setenv("FTLIB_ATTN_BACKEND", "auto")
    assert attention_backend(q, None, k, v) == "sdpa"  # fp64
    assert attention_backend(x, None, x, x) == "sdpa"  # head dim 12
    monkeypatch.setenv("FTLIB_ATTN_BACKEND", "cpu")
    with pytest.raises(RuntimeError, match="FTLIB_ATTN_BACKEND=cpu cannot run this call: .*fp32"):
        attention(q, k, v, cu_seqlens=cu)
    with pytest.raises(RuntimeError, match="FTLIB_ATTN_BACKEND=cpu cannot run this call: .*multiple of 8"):
        attention(x, x, x)
    monkeypatch.setenv("FTLIB_ATTN_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"FTLIB_ATTN_BACKEND='fast': expected one of auto\|flash\|triton\|sdpa\|cpu\|torch"):
        attention(q.float(), k.float(), v.float(), cu_seqlens=cu)


def test_bad_inputs_raise_naming_the_argument():
    """What the C++ kernel would read out of bounds is refused first, naming the argument."""
    q, k, v, g, cu = (t.float() if t.is_floating_point() else t for t in _pack([5, 7], 4, 2, 8, seed=1))
    o, lse = flash_attn_cpu_forward(q, k, v, cu, True, 0.5)
    cases = [
        (lambda: flash_attn_cpu_forward(q, k, v, torch.tensor([0, 5, 11]), True, 0.5), "cu_seqlens"),
        (lambda: flash_attn_cpu_forward(q, k, v, torch.tensor([0, 7, 5, 12]), True, 0.5), "cu_seqlens"),
        (lambda: flash_attn_cpu_forward(q, k[:10], v[:10], cu, True, 0.5), "k .* and v"),
        (lambda: flash_attn_cpu_forward(q[..., :4], k[..., :4], v[..., :4], cu, True, 0.5), "multiple of 8"),
        (lambda: flash_attn_cpu_forward(q.double(), k.double(), v.double(), cu, True, 0.5), "fp32"),
        (lambda: flash_attn_cpu_backward(g[:, :2], q, k, v, o, lse, cu, True, 0.5), "do must be"),
        (lambda: flash_attn_cpu_backward(g, q, k, v, o, lse[:, :5], cu, True, 0.5), "lse must be"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
