"""RoPE's rotation ``x * cos + rotate_half(x) * sin`` as one op, one pass each way on CPU.

Half-split layout (Hugging Face / Meta checkpoints, ``ftlib.models.rope``): with x = cat(x1, x2)
along the head dim D, ``rotate_half(x) = cat(-x2, x1)``, and

    y  = x * cos + rotate_half(x) * sin           x [B, T, H, D], cos/sin [B, T, D] (every head)
    dx = dy * cos - rotate_half(dy * sin)         (rotate_half's transpose is -rotate_half)

Autograd through the forward's ops takes four elementwise passes and three temporaries forward
and about six passes backward (``mul``, ``cat``, ``neg``, ``addcmul`` and their gradients, summed);
this op keeps the same tensors (cos and sin, the model's tables shared by every layer). On CPU
with fp32 tensors and an AVX2 + FMA core, ``csrc/rope.cpp`` does each direction in one pass (read
x, write y); elsewhere (other dtypes and devices, under ``torch.compile``,
``FTLIB_ROPE_BACKEND=torch``) the formulas above run as PyTorch ops inside the same autograd
function. With cos or sin requiring grad the
plain autograd form is used (it differentiates them too).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from ftlib._cbuild import kernel_threads, load_library
from ftlib._cbuild import tensor_ptr as _ptr

__all__ = ["rope", "rope_backend", "rotate_half"]

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x2, x1) where x = cat(x1, x2) along the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@functools.cache
def _library():
    """The built ``csrc/rope.cpp`` with its signatures declared, or None (no compiler, no AVX2 + FMA)."""
    lib = load_library("rope.cpp", openmp=True)
    if lib is None or not lib.ft_rope_supported():
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ft_rope_openmp.argtypes = []
    lib.ft_rope.argtypes = [p, p, p, p, i64, i64, i64, i32, i32]
    return lib


def _threads(n: int) -> int:
    """Threads for a call over n elements (``ftlib._cbuild.kernel_threads``)."""
    return kernel_threads(bool(_library().ft_rope_openmp()), n)


def rope_backend(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str:
    """``cpp`` (the fused CPU kernel) or ``torch`` (the formulas as PyTorch ops) for these inputs."""
    want = os.environ.get("FTLIB_ROPE_BACKEND", "auto").strip().lower()
    if want not in ("auto", "torch"):
        raise ValueError(f"FTLIB_ROPE_BACKEND={want!r}: expected auto or torch")
    if want == "torch" or torch.compiler.is_compiling():  # under compile, inductor fuses the ops instead
        return "torch"
    if (x.device.type == "cpu" and x.dtype == cos.dtype == sin.dtype == torch.float32 and x.dim() == 4
            and x.shape[-1] % 2 == 0 and cos.shape == sin.shape == (*x.shape[:2], x.shape[-1])
            and cos.device.type == sin.device.type == "cpu" and _library() is not None):
        return "cpp"
    return "torch"


@torch.library.custom_op("ftlib::cpu_rope", mutates_args=())
def _cpu_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, adjoint: bool) -> torch.Tensor:
    """x [B, T, H, D] rotated by cos/sin [B, T, D] (adjoint: by the transpose), fp32, one pass."""
    b, t, h, d = x.shape
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    y = torch.empty_like(x)
    _library().ft_rope(_ptr(x), _ptr(cos), _ptr(sin), _ptr(y), b * t, h, d, int(adjoint), _threads(x.numel()))
    return y


@_cpu_rope.register_fake
def _(x, cos, sin, adjoint):
    return torch.empty_like(x)


class _Rope(torch.autograd.Function):
    """y = x * cos + rotate_half(x) * sin; saves cos and sin only (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, cos, sin, cpp):
        ctx.save_for_backward(cos, sin)
        ctx.cpp = cpp
        if cpp:
            return _cpu_rope(x, cos, sin, False)
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (B, T, 1, D)
        return torch.addcmul(x * c, rotate_half(x), s)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        if ctx.cpp:
            return _cpu_rope(dy, cos, sin, True), None, None, None
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return dy * c - rotate_half(dy * s), None, None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by cos/sin [B, T, D] (broadcast over the heads); differentiable in x."""
    if cos.requires_grad or sin.requires_grad:  # the plain form differentiates the tables too
        return torch.addcmul(x * cos.unsqueeze(-2), rotate_half(x), sin.unsqueeze(-2))
    return _Rope.apply(x, cos, sin, rope_backend(x, cos, sin) == "cpp")
