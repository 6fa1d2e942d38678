"""The Triton kernel's sliding-window and soft-cap variants against the float64 reference
(interpreter on CPU, natively on a GPU): odd lengths, windows smaller and larger than the
documents, GQA, forward, lse and dQ, dK, dV; the same checks as ``test_attention_triton``."""

import pytest
import torch

pytest.importorskip("triton")

from test_attention_triton import _check_against_reference, _cu, _inputs  # noqa: E402

PACK = [1, 17, 0, 40, 3]


@pytest.mark.parametrize("window,softcap", [(5, None), (16, None), (33, None), (200, None), (None, 0.8),
                                            (7, 1.3)])
@pytest.mark.parametrize("hq,hkv", [(2, 1), (4, 4)])
def test_varlen_window_softcap(window, softcap, hq, hkv):
    n = sum(PACK)
    q, k, v, do = _inputs((n, hq, 16), (n, hkv, 16), torch.float32, seed=hq + (window or 0))
    q, k = q * 2, k * 2  # scores of a few units: the cap bends them
    _check_against_reference(q, k, v, do, causal=True, cu_seqlens=_cu(PACK), max_seqlen=max(PACK),
                             sliding_window=window, softcap=softcap)


@pytest.mark.parametrize("tq,tk,window", [(37, 37, 6), (19, 45, 9), (45, 19, 4), (23, 23, 1)])
def test_dense_window(tq, tk, window):
    q, k, v, do = _inputs((2, tq, 2, 24), (2, tk, 1, 24), torch.float32, seed=tq + tk)
    _check_against_reference(q, k, v, do, causal=True, sliding_window=window, softcap=2.0)


def test_window_variant_is_load_bearing():
    from ftlib.kernels.attention_triton import attention_triton

    q, k, v, _ = _inputs((40, 2, 16), (40, 1, 16), torch.float32)
    full = attention_triton(q, k, v, causal=True)
    assert (attention_triton(q, k, v, causal=True, sliding_window=5) - full).abs().max() > 1e-3
    assert (attention_triton(q, k, v, causal=True, softcap=0.5) - full).abs().max() > 1e-3
