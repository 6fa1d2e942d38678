"""The chunked cross-entropy's softmax step on one (V, C) logit block in two passes on CPU (``csrc/xent_block.cpp``).

    lse[c] = log sum_v exp(z[v, c]);   with grad, in place: z[v, c] <- exp(z[v, c] - lse[c]) - [v == y[c]]

Running column maxima and sums over row blocks of 32, then the gradient written in one sweep: one
exp per element each pass, where the PyTorch ops take five passes over the block. fp32 on an
AVX2 + FMA core. The op with its PyTorch path and the label checks is ``ftlib.kernels.xent_block_``.
"""

from __future__ import annotations

import torch

from ftlib._cbuild import tensor_ptr as _ptr

from ._library import library, threads, why_not

__all__ = ["xent_block_cpu_", "xent_block_cpu_unsupported"]


def xent_block_cpu_unsupported(z: torch.Tensor) -> str | None:
    """Why the kernel cannot take the (V, C) block z (None when it can)."""
    if z.device.type != "cpu" or z.dtype != torch.float32:
        return f"the C++ kernel takes an fp32 CPU block, got {z.dtype} on {z.device}"
    if z.dim() != 2 or z.stride(1) != 1 or z.stride(0) < z.shape[1] or z.shape[0] == 0:
        return f"needs a 2-D block with unit column stride and V > 0, got {tuple(z.shape)} strides {z.stride()}"
    return why_not("xent_block")


def xent_block_cpu_(z: torch.Tensor, y: torch.Tensor, grad: bool) -> torch.Tensor:
    """lse (C,) fp32 of the fp32 (V, C) block z; with ``grad``, z becomes softmax(z) - onehot(y) in place.
    y (C,) holds rows in [0, V) (the caller has checked them: the kernel reads them blindly)."""
    y = y.to(torch.int64).contiguous()
    lse = torch.empty(z.shape[1], dtype=torch.float32)
    library("xent_block").ft_xent_block(_ptr(z), z.shape[0], z.shape[1], z.stride(0), _ptr(y), _ptr(lse), int(grad),
                                        threads("xent_block", z.numel()))
    return lse
