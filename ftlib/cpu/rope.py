"""RoPE's rotation of q or k in one pass on CPU (``csrc/rope.cpp``), as a custom op.

    y = x * cos + rotate_half(x) * sin;   adjoint: dx = dy * cos - rotate_half(dy * sin)

(half-split layout, x [B, T, H, D], cos/sin [B, T, D]; the op with its PyTorch path and autograd is
``ftlib.kernels.rope``.) fp32 on an AVX2 + FMA core: read x, write y.
"""

from __future__ import annotations

import torch

from ftlib._cbuild import tensor_ptr as _ptr

from ._library import library, threads, why_not

__all__ = ["rope_cpu", "rope_cpu_unsupported"]


def rope_cpu_unsupported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why the kernel cannot rotate x [B, T, H, D] by cos/sin [B, T, D] (None when it can)."""
    if not (x.device.type == cos.device.type == sin.device.type == "cpu"
            and x.dtype == cos.dtype == sin.dtype == torch.float32):
        return f"the C++ kernel takes fp32 CPU tensors, got x {x.dtype} on {x.device}, cos {cos.dtype} on {cos.device}"
    if x.dim() != 4 or x.shape[-1] % 2 or cos.shape != sin.shape or cos.shape != (*x.shape[:2], x.shape[-1]):
        return (f"needs x [B, T, H, D] (D even) and cos/sin [B, T, D], got x {tuple(x.shape)}, "
                f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    return why_not("rope")


@torch.library.custom_op("ftlib::cpu_rope", mutates_args=())
def rope_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, adjoint: bool) -> torch.Tensor:
    """x [B, T, H, D] rotated by cos/sin [B, T, D] (adjoint: by the transpose), fp32, one pass."""
    b, t, h, d = x.shape
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    y = torch.empty_like(x)
    library("rope").ft_rope(_ptr(x), _ptr(cos), _ptr(sin), _ptr(y), b * t, h, d, int(adjoint),
                            threads("rope", x.numel()))
    return y


@rope_cpu.register_fake
def _(x, cos, sin, adjoint):
    return torch.empty_like(x)
