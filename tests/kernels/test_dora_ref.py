"""DoRA's row norm (``ftlib.kernels.dora_ref``): the expanded form against the direct one, the
ill-conditioned rows recomputed on the device, and no host synchronisation on CUDA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ftlib.kernels.dora_ref import RECOMPUTE_ROWS, dora_row_norm, dora_row_norm_direct, row_sq_norm


def _case(out_f, in_f, r, cancel_rows, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(r, in_f, generator=g)
    b = torch.randn(out_f, r, generator=g)
    w = torch.randn(out_f, in_f, generator=g)
    s = 0.5
    # rows whose update cancels W to ~1e-4 of its size: the expanded square loses every digit there
    w[:cancel_rows] = -s * (b[:cancel_rows] @ a) + 1e-4 * torch.randn(cancel_rows, in_f, generator=g)
    return w.to(device), a.to(device), b.to(device), s


@given(out_f=st.integers(1, 90), in_f=st.integers(8, 24), r=st.integers(1, 6), frac=st.floats(0, 1),
       seed=st.integers(0, 2**16))
def test_row_norm_matches_direct_with_cancelling_rows(out_f, in_f, r, frac, seed):
    # invariant: with at most RECOMPUTE_ROWS ill-conditioned rows the result is the direct fp32 norm
    # (in_f >= 8: the random rows themselves are well conditioned, so the cancelling ones are all)
    cancel = min(int(frac * out_f), RECOMPUTE_ROWS)
    w, a, b, s = _case(out_f, in_f, r, cancel, seed)
    got = dora_row_norm(lambda x: x @ w.t(), row_sq_norm(w), a, b, s, weight_rows=lambda idx: w[idx])
    want = dora_row_norm_direct(w, a, b, s)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_cancelling_rows_need_the_recompute():
    # the same rows without weight_rows (expansion only) are far off: the test above can fail
    w, a, b, s = _case(20, 16, 4, 5, seed=1)
    rough = dora_row_norm(lambda x: x @ w.t(), row_sq_norm(w), a, b, s)
    want = dora_row_norm_direct(w, a, b, s)
    assert ((rough[:5] - want[:5]).abs() / want[:5]).max() > 1e-2


@pytest.mark.gpu
def test_row_norm_does_not_synchronise_on_cuda():
    w, a, b, s = _case(300, 64, 8, 3, seed=2, device="cuda")
    w_sq = row_sq_norm(w)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
    try:
        got = dora_row_norm(lambda x: x @ w.t(), w_sq, a, b, s, weight_rows=lambda idx: w[idx])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got, dora_row_norm_direct(w, a, b, s), rtol=1e-5, atol=1e-6)
