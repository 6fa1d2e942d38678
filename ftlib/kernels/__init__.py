"""Kernels for the hot spots, each with a pure-PyTorch reference beside it.

``attention(q, k, v, *, causal, cu_seqlens, max_seqlen, softmax_scale)`` is the
one attention entry point the model calls; see ``dispatch.py`` for how a
backend is chosen (``FTLIB_ATTN_BACKEND=auto|flash|triton|torch``). The fused
Triton kernel lives in ``ftlib.kernels.attention_triton`` (it imports Triton, so
``import ftlib`` does not).
"""

from .attention_ref import attention_ref
from .dispatch import attention, attention_backend

__all__ = ["attention", "attention_backend", "attention_ref"]
