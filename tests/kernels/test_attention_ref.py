"""The PyTorch reference attention against SDPA and against per-document runs."""

import pytest
import torch
import torch.nn.functional as F

from ftlib.kernels import attention, attention_ref


def _sdpa(q, k, v, causal, mask=None):
    # q (B, T, Hq, D) -> SDPA wants (B, H, T, D); repeat K/V for GQA in the oracle only.
    g = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)))
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal).transpose(1, 2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(1, 1), (4, 2), (8, 1)])
def test_dense_matches_sdpa(causal, hq, hkv):
    torch.manual_seed(0)
    q = torch.randn(2, 7, hq, 16, dtype=torch.float64)
    k = torch.randn(2, 7, hkv, 16, dtype=torch.float64)
    v = torch.randn(2, 7, hkv, 16, dtype=torch.float64)
    torch.testing.assert_close(attention_ref(q, k, v, causal=causal), _sdpa(q, k, v, causal))


def test_varlen_equals_each_document_alone():
    torch.manual_seed(1)
    lens = [1, 5, 3, 11]
    cu = torch.tensor([0, 1, 6, 9, 20], dtype=torch.int32)
    q = torch.randn(20, 4, 8, dtype=torch.float64)
    k = torch.randn(20, 2, 8, dtype=torch.float64)
    v = torch.randn(20, 2, 8, dtype=torch.float64)
    out = attention(q, k, v, causal=True, cu_seqlens=cu, max_seqlen=max(lens))
    for s, e in zip(cu.tolist(), cu.tolist()[1:]):
        alone = attention_ref(q[None, s:e], k[None, s:e], v[None, s:e], causal=True)[0]
        torch.testing.assert_close(out[s:e], alone)


def test_decode_step_sees_whole_cache_and_padding_rows_are_zero():
    torch.manual_seed(2)
    q = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    k = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    v = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    full = attention_ref(q, k, v, causal=True)
    last = attention_ref(q[:, -1:], k, v, causal=True)  # bottom-right aligned causal
    torch.testing.assert_close(last, full[:, -1:])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])  # left padding
    out, lse = attention_ref(q, k, v, causal=True, key_padding_mask=mask, return_lse=True)
    assert torch.all(out[:, :2] == 0) and torch.isinf(lse[..., :2]).all()
    torch.testing.assert_close(out[:, 2:], attention_ref(q[:, 2:], k[:, 2:], v[:, 2:], causal=True))


def test_bad_shapes_raise():
    q = torch.randn(1, 4, 3, 8)
    k = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attention_ref(q, k, k)
    with pytest.raises(ValueError, match="cu_seqlens"):
        attention_ref(q[0], q[0], q[0], cu_seqlens=torch.tensor([0, 2, 3], dtype=torch.int32))


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_grouping_of_short_documents_is_exact(causal):
    """Documents batched into block-diagonal tiles (and long ones alone) equal per-document runs."""
    torch.manual_seed(3)
    lens = [300, 5, 250, 0, 600, 1, 1, 211, 299]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu[-1])
    q = torch.randn(n, 2, 4, dtype=torch.float64)
    k, v = torch.randn(n, 1, 4, dtype=torch.float64), torch.randn(n, 1, 4, dtype=torch.float64)
    out, lse = attention_ref(q, k, v, causal=causal, cu_seqlens=cu, return_lse=True)
    for s, e in zip(cu.tolist(), cu.tolist()[1:]):
        if e > s:
            o1, l1 = attention_ref(q[None, s:e], k[None, s:e], v[None, s:e], causal=causal, return_lse=True)
            torch.testing.assert_close(out[s:e], o1[0])
            torch.testing.assert_close(lse[:, s:e], l1[0])
