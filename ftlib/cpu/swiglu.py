"""SwiGLU's ``silu(g) * u`` and its two gradients in one pass each on CPU (``csrc/swiglu.cpp``).

    h = g s u,  s = sigmoid(g);     dg = dh u s (1 + g (1 - s)),   du = dh g s

(Shazeer, arXiv:2002.05202; the op with its PyTorch path is ``ftlib.kernels.swiglu``.) fp32 on an
AVX2 + FMA core; keeps only g and u for backward (one [N, I] tensor fewer per layer than autograd
through ``F.silu(g) * u``); its exp is within ~2 ulp of the reference's. ``swiglu_cpu`` is a
custom op with its autograd registered.
"""

from __future__ import annotations

import torch

from ftlib._cbuild import tensor_ptr as _ptr

from ._library import library, threads, why_not

__all__ = ["swiglu_cpu", "swiglu_cpu_unsupported"]


def swiglu_cpu_unsupported(g: torch.Tensor, u: torch.Tensor) -> str | None:
    """Why the kernel cannot take g and u (None when it can)."""
    if not (g.device.type == u.device.type == "cpu" and g.dtype == u.dtype == torch.float32):
        return f"the C++ kernel takes fp32 CPU tensors, got g {g.dtype} on {g.device}, u {u.dtype} on {u.device}"
    if g.shape != u.shape:
        return f"g and u must have one shape, got {tuple(g.shape)} and {tuple(u.shape)}"
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast is on (the products run in its dtype)"
    return why_not("swiglu")


@torch.library.custom_op("ftlib::cpu_swiglu", mutates_args=())
def swiglu_cpu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for fp32 CPU g, u of one shape, differentiable in both."""
    g, u = g.contiguous(), u.contiguous()
    h = torch.empty_like(g)
    library("swiglu").ft_swiglu_fwd(_ptr(g), _ptr(u), _ptr(h), g.numel(), threads("swiglu", g.numel()))
    return h


@swiglu_cpu.register_fake
def _(g, u):
    return torch.empty_like(g)


@torch.library.custom_op("ftlib::cpu_swiglu_backward", mutates_args=())
def _swiglu_cpu_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dh, g, u = dh.contiguous(), g.contiguous(), u.contiguous()
    dg, du = torch.empty_like(g), torch.empty_like(u)
    library("swiglu").ft_swiglu_bwd(_ptr(dh), _ptr(g), _ptr(u), _ptr(dg), _ptr(du), g.numel(),
                                    threads("swiglu", g.numel()))
    return dg, du


@_swiglu_cpu_backward.register_fake
def _(dh, g, u):
    return torch.empty_like(g), torch.empty_like(u)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dh):
    g, u = ctx.saved_tensors
    return _swiglu_cpu_backward(dh, g, u)


swiglu_cpu.register_autograd(_backward, setup_context=_setup_context)
