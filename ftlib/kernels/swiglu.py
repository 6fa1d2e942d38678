"""SwiGLU's gated product ``silu(g) * u`` as one op, with a fused CPU kernel (``csrc/swiglu.cpp``).

    h = silu(g) * u = g s u,   s = sigmoid(g);     dg = dh u s (1 + g (1 - s)),   du = dh g s

(Shazeer, "GLU Variants Improve Transformer", arXiv:2002.05202; the Llama MLP's
``down(silu(gate(x)) * up(x))``.) The reference is ``F.silu(g) * u`` under autograd: two passes
over the [N, I] tensors forward, five backward, and silu(g) kept for backward beside g and u.
On CPU with fp32 tensors and an AVX2 + FMA core, the C++ kernel does each direction in one pass
and keeps only g and u (one [N, I] tensor fewer per layer); its exp is within ~2 ulp of the
reference's. ``FTLIB_SWIGLU_BACKEND=auto|torch`` (``torch``: always the reference, as under
``torch.compile``, where inductor fuses the reference's ops).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
import torch.nn.functional as F

from ftlib._cbuild import kernel_threads, load_library
from ftlib._cbuild import tensor_ptr as _ptr

__all__ = ["swiglu", "swiglu_backend"]

def _threads(n: int) -> int:
    """Threads for a call over n elements (``ftlib._cbuild.kernel_threads``)."""
    return kernel_threads(bool(_library().ft_swiglu_openmp()), n)


@functools.cache
def _library():
    """The built ``csrc/swiglu.cpp`` with its signatures declared, or None (no compiler, no AVX2 + FMA)."""
    lib = load_library("swiglu.cpp", openmp=True)
    if lib is None or not lib.ft_swiglu_supported():
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ft_swiglu_openmp.argtypes = []
    lib.ft_swiglu_fwd.argtypes = [p, p, p, i64, i32]
    lib.ft_swiglu_bwd.argtypes = [p, p, p, p, p, i64, i32]
    return lib


def swiglu_backend(g: torch.Tensor, u: torch.Tensor) -> str:
    """``cpp`` (the fused CPU kernel) or ``torch`` (``F.silu(g) * u``) for these inputs."""
    want = os.environ.get("FTLIB_SWIGLU_BACKEND", "auto").strip().lower()
    if want not in ("auto", "torch"):
        raise ValueError(f"FTLIB_SWIGLU_BACKEND={want!r}: expected auto or torch")
    if torch.compiler.is_compiling():  # under torch.compile, inductor fuses the reference's ops instead
        return "torch"
    if (want == "auto" and g.device.type == "cpu" and g.dtype == u.dtype == torch.float32 and g.shape == u.shape
            and not torch.is_autocast_enabled("cpu") and _library() is not None):
        return "cpp"
    return "torch"


@torch.library.custom_op("ftlib::cpu_swiglu", mutates_args=())
def _fwd(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    g, u = g.contiguous(), u.contiguous()
    h = torch.empty_like(g)
    _library().ft_swiglu_fwd(_ptr(g), _ptr(u), _ptr(h), g.numel(), _threads(g.numel()))
    return h


@_fwd.register_fake
def _(g, u):
    return torch.empty_like(g)


@torch.library.custom_op("ftlib::cpu_swiglu_backward", mutates_args=())
def _bwd(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dh, g, u = dh.contiguous(), g.contiguous(), u.contiguous()
    dg, du = torch.empty_like(g), torch.empty_like(u)
    _library().ft_swiglu_bwd(_ptr(dh), _ptr(g), _ptr(u), _ptr(dg), _ptr(du), g.numel(), _threads(g.numel()))
    return dg, du


@_bwd.register_fake
def _(dh, g, u):
    return torch.empty_like(g), torch.empty_like(u)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dh):
    g, u = ctx.saved_tensors
    return _bwd(dh, g, u)


_fwd.register_autograd(_backward, setup_context=_setup_context)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` (same shapes), differentiable in both; see the module docstring for the backends."""
    if swiglu_backend(g, u) == "cpp":
        return _fwd(g, u)
    return F.silu(g) * u
