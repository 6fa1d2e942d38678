"""fp32 products with a frozen weight on CPU through oneDNN: ``x W^T + b`` and the input gradient ``dy W``.

    y = x W^T + b        x [.., in], W [out, in], b [out]
    dx = dy W            (the only gradient when W and b are frozen, as a LoRA base or a frozen head is)

These GEMMs are most of a CPU fine-tuning step (a LoRA step of a 6 x 512 Llama at 2,048 tokens:
~1 s of ~1.5 s). ``F.linear`` and ``@`` run them in MKL, whose fp32 GEMM takes its AVX2 code path
on CPUs that are not Intel's even when they have AVX-512 (MKL 2024.2 in torch 2.13 on a 2-core AMD
EPYC with AVX-512: 150-177 GFLOP/s). oneDNN, also linked into torch's x86 builds, picks its
kernels by the instruction set, not the vendor: ``torch.ops.mkldnn._linear_pointwise`` with the
plain fp32 tensors (no reorder, no copy; a transposed view of W for ``dy W``) ran the same
products at 340-410 GFLOP/s there, 2.2-2.6x (2,048 x 512 x 1,408 forward 148 -> 344 GFLOP/s, its
input gradient 173 -> 369), with errors of fp32 GEMMs (max error ~1e-6 of the largest output
against float64, MKL's ~4e-7: a different summation order, no reduced precision; oneDNN's fp32
math mode stays the default, strict).

``onednn_unsupported`` says why oneDNN cannot take a product (not fp32 plain CPU tensors of 2 or
more dims, autocast on, a torch without oneDNN); ``onednn_linear`` / ``onednn_input_grad`` are the
plain products (for autograd functions that own their backward, or no grad), ``FrozenLinear`` both as
one autograd node for a frozen weight. Which backend runs is decided by the linear family,
``ftlib.kernels.linear`` (``FTLIB_LINEAR_BACKEND``: the LoRA base layers, the chunked loss's head).
torch's ``FlopCounterMode`` has no formula for oneDNN's op (registering one means importing
``torch.utils.flop_counter``, which pulls in Triton): count FLOPs with ``ftlib.metrics.FlopsModel``,
or under ``FTLIB_LINEAR_BACKEND=torch``.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["FrozenLinear", "bias_fits", "onednn_input_grad", "onednn_linear", "onednn_unsupported"]


_PLAIN = (torch.Tensor, torch.nn.Parameter)


@functools.cache
def _onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def bias_fits(bias: torch.Tensor | None, n: int) -> bool:
    """Whether oneDNN can take this bias for n outputs: none, or fp32 CPU [n] (F.linear broadcasts other
    shapes, oneDNN does not)."""
    return bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu" and bias.shape == (n,)
                            and type(bias) in _PLAIN)


def onednn_unsupported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why oneDNN cannot run the product of x [.., in] with weight [out, in] (or its transpose); None when
    it can."""
    if not (type(x) in _PLAIN and type(weight) in _PLAIN):  # not a tensor subclass (DTensor, fake, functional)
        return f"tensor subclasses go to F.linear (got {type(x).__name__}, {type(weight).__name__})"
    if not (x.device.type == weight.device.type == "cpu" and x.dtype == weight.dtype == torch.float32):
        return f"oneDNN's product here takes fp32 CPU tensors, got x {x.dtype} on {x.device}, weight {weight.dtype}"
    if x.dim() < 2 or weight.dim() != 2 or x.numel() == 0 or weight.numel() == 0:
        return f"needs x of 2 or more dims and a 2-D weight, both non-empty; got {tuple(x.shape)}, {tuple(weight.shape)}"
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast is on (the product runs in its dtype)"
    if not _onednn_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn)"
    return None


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [.., K] @ weight [N, K]^T (+ bias) on oneDNN; a fresh tensor, not a view (autograd functions
    return it, and callers may update it in place). oneDNN reads the bias as dense [N] whatever its
    strides (a stride-2 view gave wrong sums, an expanded one read past its storage): it gets a
    contiguous copy when it is not. The caller has checked ``onednn_unsupported`` and ``bias_fits``."""
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
    if x.dim() == 2:
        return y
    return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], weight.shape[0]))  # as matmul does: no view to track


def onednn_input_grad(dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``dy W`` (dy [.., out], W [out, in]) on oneDNN: the input gradient of ``x W^T``."""
    return onednn_linear(dy, weight.t(), None)


class FrozenLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` for a frozen weight and bias, both products on oneDNN (the caller
    has checked the inputs once): ``FrozenLinear.apply(x, weight, bias)``."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        return onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        return (onednn_input_grad(dy, weight) if ctx.needs_input_grad[0] else None), None, None
