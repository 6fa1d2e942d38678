"""RMSNorm's forward and input gradient in one pass each on CPU (``csrc/rmsnorm.cpp``), as custom ops.

    r = 1 / sqrt(mean(x^2) + eps),   y = w * (x r);      dx = r (g - n mean(g n)),  g = w dy,  n = x r

(Zhang & Sennrich 2019, the Llama / Hugging Face form; the op with its PyTorch path and autograd is
``ftlib.kernels.rms_norm``.) fp32 on an AVX2 + FMA core: each row read twice (the second read from
L1) and written once.
"""

from __future__ import annotations

import torch

from ftlib._cbuild import tensor_ptr as _ptr

from ._library import library, threads, why_not

__all__ = ["rms_norm_cpu_backward", "rms_norm_cpu_forward", "rms_norm_cpu_unsupported"]


def rms_norm_cpu_unsupported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the kernel cannot take x [.., H] and weight [H] (None when it can)."""
    if not (x.device.type == weight.device.type == "cpu" and x.dtype == weight.dtype == torch.float32):
        return f"the C++ kernel takes fp32 CPU tensors, got x {x.dtype} on {x.device}, weight {weight.dtype}"
    if x.dim() < 1 or weight.shape != x.shape[-1:]:
        return f"weight must be [H] for x [.., H], got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
    return why_not("rmsnorm")


@torch.library.custom_op("ftlib::cpu_rms_norm", mutates_args=())
def rms_norm_cpu_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y like x, r [.., 1] fp32) for fp32 x [.., H], weight [H]."""
    h = x.shape[-1]
    x, weight = x.contiguous(), weight.contiguous()
    y, r = torch.empty_like(x), x.new_empty((*x.shape[:-1], 1))
    library("rmsnorm").ft_rmsnorm_fwd(_ptr(x), _ptr(weight), _ptr(y), _ptr(r), x.numel() // max(1, h), h, eps,
                                      threads("rmsnorm", x.numel()))
    return y, r


@rms_norm_cpu_forward.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1))


@torch.library.custom_op("ftlib::cpu_rms_norm_backward", mutates_args=())
def rms_norm_cpu_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """dx for fp32 dy, x [.., H], weight [H], r [.., 1]."""
    h = x.shape[-1]
    dy, x, weight, r = dy.contiguous(), x.contiguous(), weight.contiguous(), r.contiguous()
    dx = torch.empty_like(x)
    library("rmsnorm").ft_rmsnorm_bwd(_ptr(dy), _ptr(x), _ptr(weight), _ptr(r), _ptr(dx), x.numel() // max(1, h), h,
                                      threads("rmsnorm", x.numel()))
    return dx


@rms_norm_cpu_backward.register_fake
def _(dy, x, weight, r):
    return torch.empty_like(x)
