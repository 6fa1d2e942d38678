"""Kernels for the hot spots, each with a pure-PyTorch reference beside it.

``attention(q, k, v, *, causal, cu_seqlens, max_seqlen, softmax_scale)`` is the
one attention entry point the model calls; see ``dispatch.py`` for how a
backend is chosen (``FTLIB_ATTN_BACKEND=auto|flash|triton|sdpa|torch``). The fused
Triton kernel lives in ``ftlib.kernels.attention_triton`` (it imports Triton, so
``import ftlib`` does not); ``attention_sdpa`` (PyTorch's fused SDPA kernels, per
document for packed batches) is the CPU path; ``attention_ref`` the float64 oracle.
"""

from .attention_ref import attention_ref
from .attention_sdpa import attention_sdpa
from .dispatch import attention, attention_backend

__all__ = ["attention", "attention_backend", "attention_ref", "attention_sdpa"]
