"""Kernels for the hot spots, each with a pure-PyTorch reference beside it.

``attention(q, k, v, *, causal, cu_seqlens, max_seqlen, softmax_scale)`` is the
one attention entry point the model calls; see ``dispatch.py`` for how a
backend is chosen (``FTLIB_ATTN_BACKEND=auto|flash|triton|torch``). The fused
Triton kernel lives in ``ftlib.kernels.attention_triton`` (it imports Triton, so
``import ftlib`` does not).

``lora_matmul(x, weight, lora_A, lora_B, scaling, ...)`` is a LoRA / DoRA linear layer (dense
or NF4 base, dropout) in one op, ``lora_matmul_ref`` its reference; the backend follows
``FTLIB_LORA_BACKEND=auto|triton|torch`` (``lora_matmul.py``), the kernels are in
``ftlib.kernels.lora_triton``.
"""

from .attention_ref import attention_ref
from .dispatch import attention, attention_backend
from .lora_matmul import lora_backend, lora_matmul
from .lora_ref import lora_matmul_ref

__all__ = ["attention", "attention_backend", "attention_ref", "lora_backend", "lora_matmul", "lora_matmul_ref"]
