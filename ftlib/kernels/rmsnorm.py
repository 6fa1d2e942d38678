"""RMSNorm ``y = w * x / sqrt(mean(x^2) + eps)`` as one autograd op, one pass each way on CPU.

Math (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; the Llama / Hugging Face
form: normalised in float32, cast back to x's dtype before the scale), per row of H features:

    r  = 1 / sqrt(mean(x^2) + eps),   n = x r,   y = w * n
    dx = r (g - n mean(g n)),   g = w dy;      dw = sum over rows of dy * n

Backward keeps x and the per-row r only (n is recomputed). The PyTorch path writes the two passes
of each direction out (autograd through the textbook form keeps the same tensors but runs ~8
elementwise passes). Backends (``FTLIB_RMSNORM_BACKEND=auto|cpu|torch``, ``ftlib._backends``): ``cpu``, the CPU
wing's kernel (``ftlib.cpu.rmsnorm``: fp32 on an AVX2 + FMA core, the forward and the input gradient
reading each row twice and writing it once; the weight's gradient, when the weight trains, comes from
PyTorch ops), taken by ``auto`` where it can run outside ``torch.compile``; ``torch``, the PyTorch
path, everywhere else.
"""

from __future__ import annotations

import torch

from ftlib._backends import cpu_or_torch
from ftlib.cpu import rms_norm_cpu_backward, rms_norm_cpu_forward, rms_norm_cpu_unsupported

__all__ = ["rms_norm", "rms_norm_backend"]


def rms_norm_backend(x: torch.Tensor, weight: torch.Tensor) -> str:
    """``cpu`` (the fused CPU kernel) or ``torch`` (PyTorch ops) for these inputs."""
    return cpu_or_torch("FTLIB_RMSNORM_BACKEND", lambda: rms_norm_cpu_unsupported(x, weight))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, cpp):
        ctx.cpp = cpp
        if cpp:
            y, r = rms_norm_cpu_forward(x, weight, float(eps))
        else:
            acc = torch.float64 if x.dtype == torch.float64 else torch.float32
            h = x.to(acc)
            ms = torch.linalg.vector_norm(h, dim=-1, keepdim=True).square_().div_(h.shape[-1])  # mean(x^2), one pass
            r = ms.add_(eps).rsqrt_()  # (..., 1)
            y = weight * (h * r).to(x.dtype)
        ctx.save_for_backward(x, r, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, r, weight = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0] and ctx.cpp:
            dx = rms_norm_cpu_backward(dy, x, weight, r)
        elif ctx.needs_input_grad[0]:
            n = x.to(r.dtype) * r  # (..., H) normalised input, recomputed
            g = (dy * weight).to(r.dtype)
            mean_gn = torch.linalg.vecdot(g, n).unsqueeze(-1).div_(n.shape[-1])  # (..., 1)
            dx = torch.addcmul(g, n, mean_gn, value=-1.0).mul_(r).to(x.dtype)
        if ctx.needs_input_grad[1]:
            n = x.to(r.dtype) * r
            dw = (dy * n.to(x.dtype)).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        return dx, dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2, -1) + eps))`` normalised in float32 (float64 for float64),
    differentiable in x and weight; see the module docstring for the backends."""
    return _RMSNorm.apply(x, weight, eps, rms_norm_backend(x, weight) == "cpu")
