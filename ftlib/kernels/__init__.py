"""Kernels for the hot spots, each with a pure-PyTorch reference beside it.

Each family has the same four files: ``X_ref.py`` the PyTorch reference (the math),
``_X_kernels.py`` the ``@triton.jit`` code, ``X_triton.py`` launchers, autotuning and autograd,
and ``X.py`` the dispatch between backends (attention: ``attention_*``, LoRA: ``lora_*``).
``nf4_ref.py`` and ``dora_ref.py`` hold the NF4 storage math and DoRA's row norm the LoRA
kernels use (``ftlib.lora`` builds its layers on them: nothing here imports ``ftlib.lora``).
``compile_check.py`` compiles every kernel for sm_90 / sm_80 / sm_89 without a GPU.

``attention(q, k, v, *, causal, cu_seqlens, max_seqlen, softmax_scale)`` is the
one attention entry point the model calls; see ``attention.py`` for how a
backend is chosen (``FTLIB_ATTN_BACKEND=auto|flash|triton|sdpa|cpu|torch``). The fused
Triton kernel lives in ``ftlib.kernels.attention_triton`` (it imports Triton, so
``import ftlib`` does not); ``attention_cpu`` runs packed fp32 calls on the CPU wing's flash kernel
(``ftlib.cpu.attention``, all documents in one call); ``attention_sdpa`` (PyTorch's fused SDPA
kernels, per document for packed batches) takes the other CPU calls; ``attention_ref`` is the
float64 oracle.

``lora_matmul(x, weight, lora_A, lora_B, scaling, ...)`` is a LoRA / DoRA linear layer (dense
or NF4 base, dropout) in one op, ``lora_matmul_ref`` its reference; the LoRA layer's backend
follows ``FTLIB_LORA_BACKEND=auto|triton|cpu|torch`` (``lora.py``: ``cpu`` is the CPU wing's layer),
the kernels are in ``ftlib.kernels.lora_triton``.

``augment_tokens(input_ids, labels, attention_mask, tags, offsets, candidates, params)`` is the
on-device synonym swap / masking of ``ftlib.augment``, ``augment_tokens_ref`` its reference; the
backend follows ``FTLIB_AUGMENT_BACKEND=auto|triton|torch`` (``augment.py``), the kernel
is launched by ``ftlib.kernels.augment_triton``.

The CPU families choose between the CPU wing's kernel (``ftlib.cpu``, C++ built on first use) and
PyTorch ops, ``FTLIB_<FAMILY>_BACKEND=auto|cpu|torch`` (the table: ``ftlib._backends``):

- ``linear(x, W, b)`` / ``linear_nograd`` / ``linear_input_grad``: fp32 products with a frozen weight on
  oneDNN (``FTLIB_LINEAR_BACKEND``): the LoRA base layers and the chunked loss's logits;
- ``rms_norm(x, weight, eps)``: the Llama RMSNorm as one autograd op (``FTLIB_RMSNORM_BACKEND``);
- ``rope(x, cos, sin)``: RoPE's rotation of q or k as one autograd op (``FTLIB_ROPE_BACKEND``);
- ``swiglu(g, u)``: the Llama MLP's ``silu(g) * u`` (``FTLIB_SWIGLU_BACKEND``);
- ``xent_block_(z, y, grad)``: the chunked cross-entropy's softmax step on one (V, C) block of logits
  (log-sum-exp per column and, in place, softmax minus one-hot; ``FTLIB_XENT_BACKEND``).
"""

from .attention import attention, attention_backend
from .attention_cpu import attention_cpu, attention_cpu_unsupported
from .attention_ref import attention_ref
from .attention_sdpa import attention_sdpa
from .augment import augment_backend, augment_tokens
from .augment_ref import augment_tokens_ref
from .linear import linear, linear_backend, linear_input_grad, linear_nograd
from .lora import lora_backend, lora_cpu_kernels, lora_matmul
from .lora_ref import lora_matmul_ref
from .rmsnorm import rms_norm, rms_norm_backend
from .rope import rope, rope_backend, rotate_half
from .swiglu import swiglu, swiglu_backend
from .xent_block import xent_block_, xent_block_backend

__all__ = ["attention", "attention_backend", "attention_cpu", "attention_cpu_unsupported", "attention_ref",
           "attention_sdpa", "augment_backend", "augment_tokens", "augment_tokens_ref", "linear", "linear_backend",
           "linear_input_grad", "linear_nograd", "lora_backend", "lora_cpu_kernels", "lora_matmul",
           "lora_matmul_ref", "rms_norm", "rms_norm_backend", "rope", "rope_backend", "rotate_half", "swiglu",
           "swiglu_backend", "xent_block_", "xent_block_backend"]
