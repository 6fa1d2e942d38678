"""The chunked cross-entropy's softmax step on one (V, C) block of logits, fused on CPU.

For every column c of z (V vocabulary rows, C target tokens), with y[c] the target row:

    lse[c] = log sum_v exp(z[v, c])
    grad:  z[v, c] <- softmax(z)[v, c] - [v == y[c]] = exp(z[v, c] - lse[c]) - [v == y[c]]   (in place)

the loss-and-gradient step of ``ftlib.losses.chunked_cross_entropy`` on CPU, where the block is laid
out (V, chunk) (``losses._vocab_major``). The PyTorch ops (``amax``, ``sub_``, ``exp_``, ``sum``,
``div_``, ``scatter_add_``) take five full passes over the block, hundreds of MB at V = 128k;
``csrc/xent_block.cpp`` takes two (running column maxima and sums over row blocks of 32, then the
gradient written in one sweep), one exp per element each, for fp32 blocks on an AVX2 + FMA core.
``FTLIB_XENT_BACKEND=auto|torch`` (``torch``: the PyTorch ops, as under ``torch.compile`` and for
other dtypes and devices).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from ftlib._cbuild import kernel_threads, load_library
from ftlib._cbuild import tensor_ptr as _ptr

__all__ = ["xent_block_", "xent_block_backend"]


@functools.cache
def _library():
    """The built ``csrc/xent_block.cpp`` with its signatures declared, or None (no compiler, no AVX2 + FMA)."""
    lib = load_library("xent_block.cpp", openmp=True)
    if lib is None or not lib.ft_xent_supported():
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ft_xent_openmp.argtypes = []
    lib.ft_xent_block.argtypes = [p, i64, i64, i64, p, p, i32, i32]
    return lib


def _threads(n: int) -> int:
    """Threads for a call over n elements (``ftlib._cbuild.kernel_threads``)."""
    return kernel_threads(bool(_library().ft_xent_openmp()), n)


def xent_block_backend(z: torch.Tensor) -> str:
    """``cpp`` (the fused CPU kernel) or ``torch`` for a (V, C) block z."""
    want = os.environ.get("FTLIB_XENT_BACKEND", "auto").strip().lower()
    if want not in ("auto", "torch"):
        raise ValueError(f"FTLIB_XENT_BACKEND={want!r}: expected auto or torch")
    if want == "torch" or torch.compiler.is_compiling():
        return "torch"
    if (z.device.type == "cpu" and z.dtype == torch.float32 and z.dim() == 2 and z.stride(1) == 1
            and z.stride(0) >= z.shape[1] and z.shape[0] > 0 and _library() is not None):
        return "cpp"
    return "torch"


def _torch_block_(z: torch.Tensor, y: torch.Tensor, grad: bool) -> torch.Tensor:
    m = z.amax(dim=0, keepdim=True)
    e = (z - m).exp_() if not grad else z.sub_(m).exp_()
    total = e.sum(dim=0, keepdim=True)
    if grad:
        z.div_(total)
        z.scatter_add_(0, y[None, :], torch.full((1, y.numel()), -1.0, dtype=z.dtype, device=z.device))
    return (m + total.log())[0]


def xent_block_(z: torch.Tensor, y: torch.Tensor, grad: bool) -> torch.Tensor:
    """lse (C,) of a (V, C) logit block z (fp32 or fp64); with ``grad``, z becomes softmax(z) -
    onehot(y) along dim 0 in place. y (C,) int64 rows in [0, V) (checked)."""
    if y.shape != (z.shape[1],):
        raise ValueError(f"xent_block_: y must be [C={z.shape[1]}], got {tuple(y.shape)}")
    if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
        raise ValueError(f"xent_block_: labels y must be an integer tensor (row indices), got {y.dtype}")
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= z.shape[0]):
        raise ValueError(f"xent_block_: labels must be in [0, {z.shape[0]}), got [{int(y.min())}, {int(y.max())}]")
    if xent_block_backend(z) != "cpp" or z.shape[1] == 0:
        return _torch_block_(z, y, grad)
    y = y.to(torch.int64).contiguous()
    lse = torch.empty(z.shape[1], dtype=torch.float32)
    lib = _library()
    lib.ft_xent_block(_ptr(z), z.shape[0], z.shape[1], z.stride(0), _ptr(y), _ptr(lse), int(grad), _threads(z.numel()))
    return lse
