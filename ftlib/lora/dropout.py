"""Dropout on an adapter's input, ``A drop(x)``, from a one-byte mask and a fast CPU generator.

    drop(x) = x * m / (1 - p),    m_ij ~ Bernoulli(1 - p), independent per element and per module

the law of PEFT's ``nn.Dropout`` on each adapter's input (LoRA, Hu et al. arXiv:2106.09685;
dropout, Srivastava et al. 2014). Each ``LoRALinear`` draws its own mask, also when several
projections read the same x (q/k/v, gate/up), as PEFT's independent modules do.

What the textbook form (``nn.Dropout`` then ``nn.Linear``) costs, and what is done instead:

1. Memory. Autograd keeps the dropped copy of x (for dA) and the mask: 5 bytes per element of x
   per adapted projection in fp32. :func:`masked_linear` keeps x itself (one tensor, shared by
   the projections that read it; nothing else keeps a normalised input) and a 1-byte mask per
   projection, and recomputes ``x * m`` in backward: for q/k/v, 7 bytes per element instead of 15.
   The ``1 / (1 - p)`` scale (and the caller's, e.g. LoRA's ``alpha / r``) is applied to the [.., r]
   output, not to x.
2. Time on CPU. torch's CPU generator fills a Bernoulli mask at 6-9 ns per element
   (``bernoulli_`` on 2048 x 1408 fp32: 18-26 ms of CPU time on one core, measured). The mask here
   is the counter-based Philox4x32-10 stream of the fused LoRA kernels
   (``ftlib.kernels.lora_ref.uniform16_ref``: 16 bits per element, counter = (column // 8, row,
   offset), offset 0), computed by the CPU wing (``ftlib.cpu.lora_dropout``) eight Philox calls per AVX2 register
   and split over torch's threads (2048 x 1408: 1.2 ms on one core, 0.57 ms on two, against 1.4 ms
   for numpy's PCG64 ``random_raw`` on one), the same stream in PyTorch ops where the library
   cannot be built. The seed is one draw of torch's default generator per mask, so
   ``torch.manual_seed`` fixes every mask and a saved torch RNG state resumes them. On CUDA
   torch's own (Philox) generator is used.

3. The products on CPU. ``x * m`` widened to fp32 and fed to a skinny GEMM costs ~5 passes over
   an [N, in] tensor per product. For fp32 on an AVX2 + FMA CPU with a rank that is a multiple of
   8 (up to 64), the CPU wing's kernels compute ``(x * m) A^T``, ``(du A) * m`` and
   ``du^T (x * m)`` reading the 1-byte mask in place, r-wide accumulators in registers (2,048 x
   1,408, r = 16, one core: forward 2.5-2.9 ms against 8.4-22 ms for the PyTorch ops; ``bench_train.py``'s
   step 5.5 % faster on one thread, median of 10 alternating steps). ``FTLIB_LORA_BACKEND=torch``
   keeps the PyTorch ops (``ftlib.kernels.lora_cpu_kernels`` decides).

4. The layer as one node on CPU. With those kernels, a frozen dense base and autocast off,
   :func:`masked_lora_linear` computes a whole LoRA layer's output ``x W^T + b + c (drop(x) A^T)
   B^T`` as one autograd node (``ftlib.cpu.MaskedLoRALinear``), whose backward writes dx = dy W and
   adds the adapter's masked part into it in place: autograd would sum the base's and the adapter's
   input gradients in a separate pass over [N, in] (``bench_train.py``'s step: 1366 -> 1338 ms,
   median of 16 alternating steps). ``LoRALinear`` takes it through its op dispatch
   (``ftlib.lora._fused``).

Exactness on CPU: an element is kept when its 16 random bits are >= round(p * 2^16), so the drop
probability is p rounded to a multiple of 2^-16 (within 7.7e-6 of p; exact when p * 2^16 is an
integer) and the scale is 1 / (1 - that probability), so E[drop(x)] = x exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftlib.cpu import MaskedLoRALinear, mask_cpu, masked_da_cpu, masked_dx_cpu, masked_xa_cpu
from ftlib.kernels.linear import linear_backend
from ftlib.kernels.lora import lora_cpu_kernels
from ftlib.kernels.lora_ref import rng_words, uniform16_ref

__all__ = ["apply_mask", "dropout_mask", "kept_fraction", "masked_linear", "masked_lora_linear"]

_BITS = 16


def _threshold(p: float) -> int:
    return int(round(p * (1 << _BITS)))


def kept_fraction(p: float, device_type: str = "cpu") -> float:
    """1 - (the drop probability the mask realises): the dropout scale is its inverse."""
    return 1.0 - (_threshold(p) / (1 << _BITS) if device_type == "cpu" else p)


@torch.library.custom_op("ftlib::cpu_dropout_mask", mutates_args=())
def _cpu_mask(x: torch.Tensor, p: float, seed: torch.Tensor, cpp: bool) -> torch.Tensor:
    # an opaque op, so torch.compile neither traces the generator nor breaks the graph on the seed
    cols = x.shape[-1] if x.dim() else 1
    rows = x.numel() // max(1, cols)
    if not cpp or x.numel() == 0:  # the same stream in torch ops (slower)
        return (uniform16_ref(int(seed), 0, rows, cols) >= _threshold(p)).view(x.shape)
    return mask_cpu(rows, cols, rng_words(int(seed), 0), _threshold(p)).view(x.shape)


@_cpu_mask.register_fake
def _(x, p, seed, cpp):
    return torch.empty(x.shape, dtype=torch.bool, device=x.device)


def dropout_mask(x: torch.Tensor, p: float) -> tuple[torch.Tensor, float]:
    """(keep mask bool shaped like x, scale 1 / P(keep)) for dropout probability p in (0, 1)."""
    if x.device.type == "cpu":
        seed = torch.randint(0, 2**62, (), dtype=torch.int64)  # one draw of torch's generator per mask
        # x.detach(): the op reads only x's shape, and an input that requires grad would give it an autograd node
        cpp = lora_cpu_kernels(x, torch.float32)  # the mask is the same stream whatever x's dtype
        return _cpu_mask(x.detach(), float(p), seed, cpp), 1.0 / kept_fraction(p, "cpu")
    return torch.rand(x.shape, device=x.device) >= p, 1.0 / kept_fraction(p, x.device.type)


def apply_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x * m``: x where kept, 0 where dropped (a NaN or inf in x stays one, as with ``nn.Dropout``).

    The bool mask is widened to x's dtype and multiplied in. On CPU, one core, 2048 x 512 fp32
    (measured): ``torch.where(mask, x, 0.0)`` 1.7-2.1 ms, ``x * mask`` (bool: a mixed-dtype path)
    1.5 ms, ``x * mask.to(x.dtype)`` 0.5 ms including the widening.
    """
    return x * mask.to(x.dtype)


def _cpu_kernels(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the three products run on the CPU wing's kernels: the LoRA backend is ``cpu`` for this
    input (fp32 on CPU, outside ``torch.compile`` under ``auto``), the weight is fp32 and its rank fits
    (a multiple of 8 up to 64); otherwise the PyTorch ops do."""
    return weight.dtype == torch.float32 and lora_cpu_kernels(x, dtype, int(weight.shape[0]))


class _MaskedLinear(torch.autograd.Function):
    """u = F.linear(x * m, A) * c in ``dtype``; saves x and m, not the dropped copy of x."""

    @staticmethod
    def forward(ctx, x, mask, weight, scale, dtype):
        ctx.cpu = _cpu_kernels(x, weight, dtype)
        if ctx.cpu:
            u = masked_xa_cpu(x, mask, weight, float(scale))
        else:
            with torch.autocast(device_type=x.device.type, enabled=False):
                u = F.linear(apply_mask(x, mask).to(dtype), weight.to(dtype)) * scale
        ctx.save_for_backward(x, mask, weight)
        ctx.scale, ctx.dtype = scale, dtype
        return u

    @staticmethod
    def backward(ctx, du):
        x, mask, weight = ctx.saved_tensors
        dtype = ctx.dtype
        du = (du * ctx.scale).to(dtype)  # (.., r)
        dx = dw = None
        if ctx.cpu:
            if ctx.needs_input_grad[0]:
                dx = masked_dx_cpu(du, weight, mask)
            if ctx.needs_input_grad[2]:
                dw = masked_da_cpu(du, x, mask)
            return dx, None, dw, None, None
        m = mask.to(dtype)  # widened once for both products
        if ctx.needs_input_grad[0]:
            dx = ((du @ weight.to(dtype)) * m).to(x.dtype)
        if ctx.needs_input_grad[2]:
            xm = (x.to(dtype) * m).reshape(-1, x.shape[-1])  # recomputed: (tokens, in)
            dw = (du.reshape(-1, du.shape[-1]).t() @ xm).to(weight.dtype)
        return dx, None, dw, None, None


def masked_linear(x: torch.Tensor, weight: torch.Tensor, p: float, scale: float = 1.0) -> torch.Tensor:
    """``F.linear(drop(x), weight) * scale`` with a fresh mask (see the module docstring); x (.., in) -> (.., r).

    ``scale`` (a LoRA layer passes its ``alpha / r``) is applied to the [.., r] output together with
    the dropout's ``1 / (1 - p)``, so nothing downstream multiplies an [.., out] tensor by it.

    The matmul runs in the autocast dtype when autocast is on (as ``nn.Linear`` would), else
    in x's dtype; weight gradients come back in the weight's dtype.
    """
    mask, keep_scale = dropout_mask(x, p)
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    return _MaskedLinear.apply(x, mask, weight, keep_scale * scale, dtype)


def masked_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                       lora_b: torch.Tensor, p: float, scale: float) -> torch.Tensor | None:
    """A LoRA layer's output ``x W^T + b + scale (drop(x) A^T) B^T`` with a fresh dropout mask, as one
    autograd node on the CPU wing's kernels (``ftlib.cpu.MaskedLoRALinear``); None where they do not apply.

    Applies to fp32 tensors on an AVX2 + FMA CPU (the conditions of the three products, see
    :func:`masked_linear`), a frozen base (W, and b if any, without gradient) and autocast off. Its
    gradients equal those of ``F.linear(x, W, b) + masked_linear(x, A, p, scale) @ B^T``; the
    difference is one pass fewer over the [N, in] input gradient in backward (the adapter's part is
    added into the base's in place).
    """
    if (torch.is_autocast_enabled(x.device.type) or weight.requires_grad
            or (bias is not None and bias.requires_grad) or x.dim() < 2
            or not (weight.dtype == lora_b.dtype == torch.float32) or not _cpu_kernels(x, lora_a, torch.float32)):
        return None
    if bias is not None and bias.dtype != torch.float32:
        return None
    mask, keep_scale = dropout_mask(x, p)
    onednn = linear_backend(x, weight) == "cpu"  # the base products: the linear family's choice
    return MaskedLoRALinear.apply(x.contiguous(), mask, weight, bias, lora_a, lora_b, keep_scale * scale, onednn)
