"""RoPE's rotation ``x * cos + rotate_half(x) * sin`` as one op, one pass each way on CPU.

Half-split layout (Hugging Face / Meta checkpoints, ``ftlib.models.rope``): with x = cat(x1, x2)
along the head dim D, ``rotate_half(x) = cat(-x2, x1)``, and

    y  = x * cos + rotate_half(x) * sin           x [B, T, H, D], cos/sin [B, T, D] (every head)
    dx = dy * cos - rotate_half(dy * sin)         (rotate_half's transpose is -rotate_half)

Autograd through the forward's ops takes four elementwise passes and three temporaries forward
and about six passes backward (``mul``, ``cat``, ``neg``, ``addcmul`` and their gradients, summed);
this op keeps the same tensors (cos and sin, the model's tables shared by every layer). Backends
(``FTLIB_ROPE_BACKEND=auto|cpu|torch``, ``ftlib._backends``): ``cpu``, the CPU wing's kernel
(``ftlib.cpu.rope``: fp32 on an AVX2 + FMA core, each direction in one pass, read x, write y), taken
by ``auto`` where it can run outside ``torch.compile``; ``torch``, the formulas above as PyTorch ops
inside the same autograd function. With cos or sin requiring grad the
plain autograd form is used (it differentiates them too).
"""

from __future__ import annotations

import torch

from ftlib._backends import cpu_or_torch
from ftlib.cpu import rope_cpu, rope_cpu_unsupported

__all__ = ["rope", "rope_backend", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x2, x1) where x = cat(x1, x2) along the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_backend(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str:
    """``cpu`` (the fused CPU kernel) or ``torch`` (the formulas as PyTorch ops) for these inputs."""
    return cpu_or_torch("FTLIB_ROPE_BACKEND", lambda: rope_cpu_unsupported(x, cos, sin))


class _Rope(torch.autograd.Function):
    """y = x * cos + rotate_half(x) * sin; saves cos and sin only (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, cos, sin, cpp):
        ctx.save_for_backward(cos, sin)
        ctx.cpp = cpp
        if cpp:
            return rope_cpu(x, cos, sin, False)
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (B, T, 1, D)
        return torch.addcmul(x * c, rotate_half(x), s)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        if ctx.cpp:
            return rope_cpu(dy, cos, sin, True), None, None, None
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return dy * c - rotate_half(dy * s), None, None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by cos/sin [B, T, D] (broadcast over the heads); differentiable in x."""
    if cos.requires_grad or sin.requires_grad:  # the plain form differentiates the tables too
        return torch.addcmul(x * cos.unsqueeze(-2), rotate_half(x), sin.unsqueeze(-2))
    return _Rope.apply(x, cos, sin, rope_backend(x, cos, sin) == "cpu")
