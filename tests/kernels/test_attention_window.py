"""Sliding window and logit soft-capping: the reference against a brute-force loop, SDPA against the
reference in float64 (forward and every gradient), on odd lengths, GQA and windows smaller and
larger than the documents."""

import pytest
import torch

from ftlib.kernels import attention, attention_ref, attention_sdpa


def _brute(q, k, v, scale, window, softcap):
    # q (T, Hq, D), k/v (T, Hkv, D), one causal document
    t, hq, _ = q.shape
    g = hq // k.shape[1]
    o = torch.zeros_like(q)
    for h in range(hq):
        for i in range(t):
            keys = [j for j in range(i + 1) if window is None or j > i - window]
            s = torch.stack([q[i, h] @ k[j, h // g] for j in keys]) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            p = s.softmax(0)
            o[i, h] = sum(p[n] * v[j, h // g] for n, j in enumerate(keys))
    return o


def _qkv(n, hq, hkv, d, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("window,softcap", [(3, None), (None, 0.7), (4, 1.5), (50, None)])
def test_reference_matches_brute_force(window, softcap):
    q, k, v = _qkv(7, 4, 2, 5)
    got = attention_ref(q[None], k[None], v[None], sliding_window=window, softcap=softcap)[0]
    want = _brute(q, k, v, 5**-0.5, window, softcap)
    assert (got - want).abs().max() < 1e-12


@pytest.mark.parametrize("window,softcap", [(3, None), (None, 0.7), (5, 2.0), (40, None)])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 1)])
def test_sdpa_varlen_and_dense_match_reference_with_grads(window, softcap, hq, hkv):
    cu = torch.tensor([0, 9, 10, 23], dtype=torch.int32)  # a 1-token document, one longer than the window
    q, k, v = (t.requires_grad_() for t in _qkv(23, hq, hkv, 6, seed=1))
    do = torch.randn_like(q)
    outs = {}
    for name, fn in (("ref", attention_ref), ("sdpa", attention_sdpa), ("op", attention)):
        o = fn(q, k, v, cu_seqlens=cu, softmax_scale=0.4, sliding_window=window, softcap=softcap)
        grads = torch.autograd.grad(o, (q, k, v), do)
        outs[name] = (o, *grads)
    for name in ("sdpa", "op"):
        for want, got, what in zip(outs["ref"], outs[name], ("o", "dq", "dk", "dv")):
            assert (got - want).abs().max() < 1e-10, (name, what)
    # dense, bottom-right aligned: the last 4 queries over 11 keys (a decoding step with a cache)
    qd, kd, vd = (t.detach()[None, :11].clone().requires_grad_() for t in (q, k, v))
    ref = attention_ref(qd[:, -4:], kd, vd, sliding_window=window, softcap=softcap)
    got = attention_sdpa(qd[:, -4:], kd, vd, sliding_window=window, softcap=softcap)
    assert (got - ref).abs().max() < 1e-10
    full = attention_ref(qd, kd, vd, sliding_window=window, softcap=softcap)
    assert (full[:, -4:] - ref).abs().max() < 1e-10  # same rows as the square call


def test_window_and_softcap_are_load_bearing():
    q, k, v = _qkv(12, 2, 2, 4, seed=2)
    base = attention_ref(q, k, v)
    assert (attention_ref(q, k, v, sliding_window=3) - base).abs().max() > 1e-3
    assert (attention_ref(q, k, v, softcap=0.5) - base).abs().max() > 1e-3
    assert torch.equal(attention_ref(q, k, v, sliding_window=12), base)  # a window as long as the row hides nothing


@pytest.mark.parametrize("bad", [dict(sliding_window=0), dict(sliding_window=2.5), dict(softcap=0.0),
                                 dict(softcap=-1.0)])
def test_bad_window_or_softcap_is_refused(bad):
    q, k, v = _qkv(4, 2, 2, 4)
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        attention(q, k, v, **bad)
