"""The CPU wing: C++ compute kernels (and oneDNN's fp32 GEMM) that make fp32 training on a CPU fast.

They exist so CI and the CPU demo run fast; users train on GPUs. Nothing here is called by the model
or the adapters directly: each op family in ``ftlib.kernels`` (attention, linear, LoRA, RMSNorm,
RoPE, SwiGLU, the chunked loss's softmax step) picks its backend per call, and its ``cpu`` backend
is the kernel here (op-level dispatch, as for the GPU families; the switches are in
``ftlib._backends``). Results equal the PyTorch ops' up to fp32 rounding.

Anatomy: ``_library.py`` is the one builder and loader (``csrc/<name>.cpp`` compiled on first use by
``ftlib._cbuild``, signatures declared, thread counts); each op module holds the kernel's custom
ops, the ``*_unsupported`` check that says why a call cannot take it (the text of a forced backend's
error), and its docstring with the math:

- ``attention``: flash attention over packed documents, forward and backward (``csrc/flash_attn.cpp``)
- ``linear``: fp32 products with a frozen weight on oneDNN (``torch.ops.mkldnn``; no C++ of ours)
- ``lora_dropout``: LoRA's input-dropout mask and masked products, and the one-node LoRA layer
  (``csrc/lora_dropout.cpp``)
- ``rmsnorm``, ``rope``, ``swiglu``, ``xent_block``: one pass each way (``csrc/<name>.cpp``)
"""

from .attention import flash_attn_cpu_backward, flash_attn_cpu_forward, flash_attn_cpu_unsupported
from .linear import FrozenLinear, bias_fits, onednn_input_grad, onednn_linear, onednn_unsupported
from .lora_dropout import (
    MaskedLoRALinear,
    lora_cpu_unsupported,
    mask_cpu,
    masked_da_cpu,
    masked_dx_add_cpu_,
    masked_dx_cpu,
    masked_xa_cpu,
)
from .rmsnorm import rms_norm_cpu_backward, rms_norm_cpu_forward, rms_norm_cpu_unsupported
from .rope import rope_cpu, rope_cpu_unsupported
from .swiglu import swiglu_cpu, swiglu_cpu_unsupported
from .xent_block import xent_block_cpu_, xent_block_cpu_unsupported

__all__ = ["FrozenLinear", "MaskedLoRALinear", "bias_fits", "flash_attn_cpu_backward", "flash_attn_cpu_forward",
           "flash_attn_cpu_unsupported", "lora_cpu_unsupported", "mask_cpu", "masked_da_cpu", "masked_dx_add_cpu_",
           "masked_dx_cpu", "masked_xa_cpu", "onednn_input_grad", "onednn_linear", "onednn_unsupported",
           "rms_norm_cpu_backward", "rms_norm_cpu_forward", "rms_norm_cpu_unsupported", "rope_cpu",
           "rope_cpu_unsupported", "swiglu_cpu", "swiglu_cpu_unsupported", "xent_block_cpu_",
           "xent_block_cpu_unsupported"]
