"""The linear family: ``x W^T + b`` and its input gradient ``dy W`` for a frozen weight, on oneDNN on CPU.

    y = x W^T + b        x [.., in], W [out, in], b [out]
    dx = dy W            (the only gradient when W and b are frozen, as a LoRA base or a frozen head is)

These GEMMs are most of a CPU fine-tuning step (a LoRA step of a 6 x 512 Llama at 2,048 tokens:
~1 s of ~1.5 s). ``F.linear`` runs them in MKL, whose fp32 GEMM takes its AVX2 path on CPUs that
are not Intel's; oneDNN (``ftlib.cpu.linear``, measured there at 2.2-2.6x) picks its kernels by the
instruction set, with errors of fp32 GEMMs (a different summation order, no reduced precision).

Backends (``FTLIB_LINEAR_BACKEND=auto|cpu|torch``, ``ftlib._backends``): ``cpu``, oneDNN, for fp32
plain CPU tensors of 2 or more dims with autocast off, taken by ``auto`` where it can run outside
``torch.compile`` (inductor chooses its own GEMMs); ``torch``, ``F.linear`` / ``@``. Who calls it:
the LoRA layer's CPU path (``ftlib.lora``: its frozen base) and the chunked loss's head
(``ftlib.losses``). A plain ``nn.Linear`` in the model runs ``F.linear``.

``linear(x, W, b)`` is differentiable (one autograd node on oneDNN when W and b take no gradient,
``F.linear`` otherwise); ``linear_nograd`` / ``linear_input_grad`` are the plain products for autograd
functions that own their backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftlib._backends import backend_choice, cannot_run, cpu_or_torch
from ftlib.cpu import FrozenLinear, bias_fits, onednn_input_grad, onednn_linear, onednn_unsupported

__all__ = ["linear", "linear_backend", "linear_input_grad", "linear_nograd"]


def linear_backend(x: torch.Tensor, weight: torch.Tensor) -> str:
    """``cpu`` (oneDNN) or ``torch`` for the product of x [.., in] with weight [out, in] (or its transpose)."""
    return cpu_or_torch("FTLIB_LINEAR_BACKEND", lambda: onednn_unsupported(x, weight))


def linear_nograd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` (x [.., in], W [out, in], b [out], any strides) as a plain product: call it where autograd
    does not record (an autograd function's forward, ``torch.no_grad``)."""
    if x.shape[-1] == weight.shape[1] and linear_backend(x, weight) == "cpu" and bias_fits(bias, weight.shape[0]):
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_input_grad(dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``dy W`` (dy [.., out], W [out, in]): the input gradient of ``x W^T``, a plain product like
    :func:`linear_nograd`."""
    if dy.shape[-1] == weight.shape[0] and linear_backend(dy, weight) == "cpu":
        return onednn_input_grad(dy, weight)
    return dy @ weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, both products on oneDNN where ``linear_backend`` says ``cpu`` and
    neither weight nor bias takes a gradient (frozen, or grad mode off); ``F.linear`` itself otherwise
    (same value and gradients up to fp32 rounding)."""
    trains = torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))
    if trains or not bias_fits(bias, weight.shape[0]) or x.shape[-1] != weight.shape[-1]:
        if backend_choice("FTLIB_LINEAR_BACKEND") == "cpu":  # forced: say why it cannot run, never fall back
            why = ("the weight or bias takes a gradient (the oneDNN node computes only dx)" if trains
                   else "the bias or the input's last dim does not fit the weight")
            raise cannot_run("FTLIB_LINEAR_BACKEND", "cpu", why)
        return F.linear(x, weight, bias)
    if linear_backend(x, weight) != "cpu":
        return F.linear(x, weight, bias)
    return FrozenLinear.apply(x, weight, bias)
