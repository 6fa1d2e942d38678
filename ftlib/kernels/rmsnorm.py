"""RMSNorm ``y = w * x / sqrt(mean(x^2) + eps)`` as one autograd op, one pass each way on CPU.

Math (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; the Llama / Hugging Face
form: normalised in float32, cast back to x's dtype before the scale), per row of H features:

    r  = 1 / sqrt(mean(x^2) + eps),   n = x r,   y = w * n
    dx = r (g - n mean(g n)),   g = w dy;      dw = sum over rows of dy * n

Backward keeps x and the per-row r only (n is recomputed). The PyTorch path writes the two passes
of each direction out (autograd through the textbook form keeps the same tensors but runs ~8
elementwise passes). On CPU with fp32 tensors and an AVX2 + FMA core, ``csrc/rmsnorm.cpp`` does
the forward and the input gradient reading each row twice (the second read from L1) and writing it
once; the weight's gradient, when the weight trains, comes from PyTorch ops. Elsewhere (other
dtypes and devices, under ``torch.compile``, ``FTLIB_RMSNORM_BACKEND=torch``) the PyTorch path runs.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from ftlib._cbuild import kernel_threads, load_library
from ftlib._cbuild import tensor_ptr as _ptr

__all__ = ["rms_norm", "rms_norm_backend"]

@functools.cache
def _library():
    """The built ``csrc/rmsnorm.cpp`` with its signatures declared, or None (no compiler, no AVX2 + FMA)."""
    lib = load_library("rmsnorm.cpp", openmp=True)
    if lib is None or not lib.ft_rmsnorm_supported():
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ft_rmsnorm_openmp.argtypes = []
    lib.ft_rmsnorm_fwd.argtypes = [p, p, p, p, i64, i64, ctypes.c_float, i32]
    lib.ft_rmsnorm_bwd.argtypes = [p, p, p, p, p, i64, i64, i32]
    return lib


def _threads(n: int) -> int:
    """Threads for a call over n elements (``ftlib._cbuild.kernel_threads``)."""
    return kernel_threads(bool(_library().ft_rmsnorm_openmp()), n)


def rms_norm_backend(x: torch.Tensor, weight: torch.Tensor) -> str:
    """``cpp`` (the fused CPU kernel) or ``torch`` (PyTorch ops) for these inputs."""
    want = os.environ.get("FTLIB_RMSNORM_BACKEND", "auto").strip().lower()
    if want not in ("auto", "torch"):
        raise ValueError(f"FTLIB_RMSNORM_BACKEND={want!r}: expected auto or torch")
    if want == "torch" or torch.compiler.is_compiling():  # under compile, inductor fuses the ops instead
        return "torch"
    if (x.device.type == weight.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.dim() >= 1
            and weight.shape == x.shape[-1:] and _library() is not None):
        return "cpp"
    return "torch"


@torch.library.custom_op("ftlib::cpu_rms_norm", mutates_args=())
def _cpu_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y like x, r [.., 1] fp32) for fp32 x [.., H], weight [H]."""
    h = x.shape[-1]
    x, weight = x.contiguous(), weight.contiguous()
    y, r = torch.empty_like(x), x.new_empty((*x.shape[:-1], 1))
    _library().ft_rmsnorm_fwd(_ptr(x), _ptr(weight), _ptr(y), _ptr(r), x.numel() // max(1, h), h, eps,
                              _threads(x.numel()))
    return y, r


@_cpu_fwd.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1))


@torch.library.custom_op("ftlib::cpu_rms_norm_backward", mutates_args=())
def _cpu_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """dx for fp32 dy, x [.., H], weight [H], r [.., 1]."""
    h = x.shape[-1]
    dy, x, weight, r = dy.contiguous(), x.contiguous(), weight.contiguous(), r.contiguous()
    dx = torch.empty_like(x)
    _library().ft_rmsnorm_bwd(_ptr(dy), _ptr(x), _ptr(weight), _ptr(r), _ptr(dx), x.numel() // max(1, h), h,
                              _threads(x.numel()))
    return dx


@_cpu_bwd.register_fake
def _(dy, x, weight, r):
    return torch.empty_like(x)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, cpp):
        ctx.cpp = cpp
        if cpp:
            y, r = _cpu_fwd(x, weight, float(eps))
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
            dx = _cpu_bwd(dy, x, weight, r)
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
    return _RMSNorm.apply(x, weight, eps, rms_norm_backend(x, weight) == "cpp")
