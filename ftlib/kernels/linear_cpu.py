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

``cpu_linear_backend`` picks oneDNN for fp32 CPU tensors of 2 or more dims when torch has it; under
``torch.compile`` (inductor chooses its own GEMMs), ``FTLIB_CPU_LINEAR_BACKEND=torch`` or without
oneDNN, the PyTorch ops run. ``frozen_linear`` is ``F.linear`` for a weight and bias without
gradient, as one autograd node on those products (``linear_module`` applies it to an ``nn.Linear``:
the Llama projections and LoRA's base layers call it); ``linear_cpu`` / ``linear_cpu_input_grad`` are
the plain products for autograd functions that own their backward (the LoRA layer's one-node path,
the chunked loss's head). torch's ``FlopCounterMode`` has no formula for oneDNN's op (registering
one means importing ``torch.utils.flop_counter``, which pulls in Triton): count FLOPs with
``ftlib.metrics.FlopsModel``, or under ``FTLIB_CPU_LINEAR_BACKEND=torch``.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

__all__ = ["cpu_linear_backend", "frozen_linear", "linear_cpu", "linear_cpu_input_grad", "linear_module"]


_PLAIN = (torch.Tensor, torch.nn.Parameter)


@functools.cache
def _onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _bias_ok(bias: torch.Tensor | None, n: int) -> bool:
    """Whether oneDNN can take this bias for n outputs: none, or fp32 CPU [n] (F.linear broadcasts other
    shapes, oneDNN does not)."""
    return bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu" and bias.shape == (n,)
                            and type(bias) in _PLAIN)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [.., K] @ weight [N, K]^T (+ bias) on oneDNN; a fresh tensor, not a view (autograd functions
    return it, and callers may update it in place). oneDNN reads the bias as dense [N] whatever its
    strides (a stride-2 view gave wrong sums, an expanded one read past its storage): it gets a
    contiguous copy when it is not."""
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
    if x.dim() == 2:
        return y
    return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], weight.shape[0]))  # as matmul does: no view to track


def cpu_linear_backend(x: torch.Tensor, weight: torch.Tensor) -> str:
    """``onednn`` or ``torch`` for the product of x [.., in] with weight [out, in] (or its transpose)."""
    want = os.environ.get("FTLIB_CPU_LINEAR_BACKEND", "auto").strip().lower()
    if want not in ("auto", "torch"):
        raise ValueError(f"FTLIB_CPU_LINEAR_BACKEND={want!r}: expected auto or torch")
    if want == "torch" or torch.compiler.is_compiling():
        return "torch"
    if (type(x) in _PLAIN and type(weight) in _PLAIN  # not a tensor subclass (DTensor, fake, functional)
            and x.device.type == weight.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and x.dim() >= 2 and weight.dim() == 2 and x.numel() > 0 and weight.numel() > 0
            and not torch.is_autocast_enabled("cpu") and _onednn_available()):
        return "onednn"
    return "torch"


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` (x [.., in], W [out, in], b [out], any strides) as a plain product: call it where autograd
    does not record (an autograd function's forward, ``torch.no_grad``)."""
    if x.shape[-1] == weight.shape[1] and cpu_linear_backend(x, weight) == "onednn" and _bias_ok(bias, weight.shape[0]):
        return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_cpu_input_grad(dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``dy W`` (dy [.., out], W [out, in]): the input gradient of ``x W^T``, a plain product like
    :func:`linear_cpu`."""
    if dy.shape[-1] == weight.shape[0] and cpu_linear_backend(dy, weight) == "onednn":
        return _onednn(dy, weight.t(), None)
    return dy @ weight


class _FrozenLinear(torch.autograd.Function):
    """Both products on oneDNN: frozen_linear has checked the inputs and the backend once."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        return (_onednn(dy, weight.t(), None) if ctx.needs_input_grad[0] else None), None, None


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with both products on oneDNN where ``cpu_linear_backend`` says so
    and neither weight nor bias takes a gradient (frozen, or grad mode off); ``F.linear`` itself
    otherwise (same value and gradients)."""
    trains = torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))
    if (trains or not _bias_ok(bias, weight.shape[0]) or x.shape[-1] != weight.shape[-1]
            or cpu_linear_backend(x, weight) != "onednn"):
        return F.linear(x, weight, bias)
    return _FrozenLinear.apply(x, weight, bias)


def linear_module(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``; a plain ``nn.Linear`` without hooks runs :func:`frozen_linear` on its weight and
    bias instead (its hooks, if any, are honoured by calling it)."""
    if type(layer) is torch.nn.Linear and not (layer._forward_hooks or layer._forward_pre_hooks):
        return frozen_linear(x, layer.weight, layer.bias)
    return layer(x)
