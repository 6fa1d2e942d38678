"""The chunked cross-entropy's softmax step on one (V, C) block of logits, fused on CPU.

For every column c of z (V vocabulary rows, C target tokens), with y[c] the target row:

    lse[c] = log sum_v exp(z[v, c])
    grad:  z[v, c] <- softmax(z)[v, c] - [v == y[c]] = exp(z[v, c] - lse[c]) - [v == y[c]]   (in place)

the loss-and-gradient step of ``ftlib.losses.chunked_cross_entropy`` on CPU, where the block is laid
out (V, chunk) (``losses._vocab_major``). The PyTorch ops (``amax``, ``sub_``, ``exp_``, ``sum``,
``div_``, ``scatter_add_``) take five full passes over the block, hundreds of MB at V = 128k;
the CPU wing's kernel (``ftlib.cpu.xent_block``) takes two (running column maxima and sums over row
blocks of 32, then the gradient written in one sweep), one exp per element each, for fp32 blocks on
an AVX2 + FMA core. ``FTLIB_XENT_BACKEND=auto|cpu|torch`` (``ftlib._backends``; ``auto``: the kernel
where it can run outside ``torch.compile``, else the PyTorch ops).
"""

from __future__ import annotations

import torch

from ftlib._backends import cpu_or_torch
from ftlib.cpu import xent_block_cpu_, xent_block_cpu_unsupported

__all__ = ["xent_block_", "xent_block_backend"]


def xent_block_backend(z: torch.Tensor) -> str:
    """``cpu`` (the fused CPU kernel) or ``torch`` for a (V, C) block z."""
    return cpu_or_torch("FTLIB_XENT_BACKEND", lambda: xent_block_cpu_unsupported(z))


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
    if xent_block_backend(z) != "cpu" or z.shape[1] == 0:
        return _torch_block_(z, y, grad)
    return xent_block_cpu_(z, y, grad)
