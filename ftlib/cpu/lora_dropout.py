"""A LoRA adapter's input dropout on CPU (``csrc/lora_dropout.cpp``): the keep mask and the three masked products.

    mask:  m[i, k] = (u16(i, k) >= t)                    the Philox4x32-10 stream of the fused LoRA kernels
    xa:    u  = scale (x * m) A^T                        (N, K) -> (N, r)
    dx:    dx = (du A) * m          (or added into dx)   (N, r) -> (N, K)
    da:    dA = du^T (x * m)                             -> (r, K)

``u16`` are the 16-bit uniforms of ``ftlib.kernels.lora_ref.uniform16_ref`` (counter = (column // 8,
row, c2, c3), key = the seed's two words: ``lora_ref.rng_words`` gives all four), eight Philox calls
per AVX2 register; the products read the 1-byte mask in place with r-wide accumulators in registers
(2,048 x 1,408, r = 16, one core: forward 2.5-2.9 ms against 8.4-22 ms for the PyTorch ops). fp32 on
an AVX2 + FMA core, r a multiple of 8 up to 64 (``lora_cpu_unsupported``).

``MaskedLoRALinear`` is a whole LoRA layer ``x W^T + b + (c (x * m) A^T) B^T`` as one autograd node:
its backward writes dx = dy W and adds the adapter's masked part into it in place, where autograd
would sum the base's and the adapter's input gradients in a separate [N, in] pass
(``bench_train.py``'s step: 1366 -> 1338 ms, median of 16 alternating steps). The dropout law, the
seeds and the PyTorch path are ``ftlib.lora.dropout``'s; the choice of backend is
``ftlib.kernels.lora_backend``'s (``FTLIB_LORA_BACKEND``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftlib._cbuild import tensor_ptr as _ptr

from ._library import library, threads, why_not
from .linear import bias_fits, onednn_input_grad, onednn_linear

__all__ = ["MaskedLoRALinear", "lora_cpu_unsupported", "mask_cpu", "masked_da_cpu", "masked_dx_add_cpu_",
           "masked_dx_cpu", "masked_xa_cpu"]


def lora_cpu_unsupported(rank: int | None = None) -> str | None:
    """Why the kernels cannot run (no library, no AVX2 + FMA, or a rank that is not a multiple of 8 up to
    64); None when they can."""
    why = why_not("lora_dropout")
    if why is None and rank is not None and not library("lora_dropout").ft_lora_supported(int(rank)):
        return f"the C++ LoRA kernels take a rank that is a multiple of 8 up to 64, got {rank}"
    return why


def mask_cpu(rows: int, cols: int, words: tuple[int, int, int, int], threshold: int) -> torch.Tensor:
    """The keep mask [rows, cols] bool: the stream's 16-bit uniforms >= threshold."""
    out = torch.empty((rows, cols), dtype=torch.bool)
    library("lora_dropout").ft_lora_dropout_mask(_ptr(out), rows, cols, *words, threshold,
                                                 threads("lora_dropout", rows * cols))
    return out


@torch.library.custom_op("ftlib::cpu_masked_xa", mutates_args=())
def masked_xa_cpu(x: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
    """(x * m) A^T * scale: x (.., K), mask (.., K) bool, A (r, K) -> (.., r)."""
    k, r = x.shape[-1], weight.shape[0]
    x2, m2, at = x.reshape(-1, k).contiguous(), mask.reshape(-1, k).contiguous(), weight.t().contiguous()
    u = x.new_empty(x2.shape[0], r)
    library("lora_dropout").ft_lora_masked_xa(_ptr(x2), _ptr(m2), _ptr(at), _ptr(u), x2.shape[0], k, r, scale,
                                              threads("lora_dropout", x2.numel()))
    return u.view(*x.shape[:-1], r)


@masked_xa_cpu.register_fake
def _(x, mask, weight, scale):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("ftlib::cpu_masked_dx", mutates_args=())
def masked_dx_cpu(du: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(du A) * m: du (.., r), A (r, K), mask (.., K) -> (.., K)."""
    k, r = weight.shape[1], weight.shape[0]
    du2, a, m2 = du.reshape(-1, r).contiguous(), weight.contiguous(), mask.reshape(-1, k).contiguous()
    dx = du.new_empty(du2.shape[0], k)
    library("lora_dropout").ft_lora_masked_dx(_ptr(du2), _ptr(a), _ptr(m2), _ptr(dx), du2.shape[0], k, r, 0,
                                              threads("lora_dropout", dx.numel()))
    return dx.view(*mask.shape)


@masked_dx_cpu.register_fake
def _(du, weight, mask):
    return du.new_empty(mask.shape)


@torch.library.custom_op("ftlib::cpu_masked_dx_add_", mutates_args=("dx",))
def masked_dx_add_cpu_(dx: torch.Tensor, du: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor) -> None:
    """dx += (du A) * m in place: dx (N, K) contiguous fp32, du (N, r), A (r, K), mask (N, K)."""
    k, r = weight.shape[1], weight.shape[0]
    du2, a, m2 = du.reshape(-1, r).contiguous(), weight.contiguous(), mask.reshape(-1, k).contiguous()
    library("lora_dropout").ft_lora_masked_dx(_ptr(du2), _ptr(a), _ptr(m2), _ptr(dx), du2.shape[0], k, r, 1,
                                              threads("lora_dropout", dx.numel()))


@torch.library.custom_op("ftlib::cpu_masked_da", mutates_args=())
def masked_da_cpu(du: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """du^T (x * m): du (.., r), x and mask (.., K) -> (r, K)."""
    k, r = x.shape[-1], du.shape[-1]
    du2, x2, m2 = du.reshape(-1, r).contiguous(), x.reshape(-1, k).contiguous(), mask.reshape(-1, k).contiguous()
    da = x.new_empty(r, k)
    library("lora_dropout").ft_lora_masked_da(_ptr(du2), _ptr(x2), _ptr(m2), _ptr(da), x2.shape[0], k, r,
                                              threads("lora_dropout", x2.numel()))
    return da


@masked_da_cpu.register_fake
def _(du, x, mask):
    return x.new_empty(du.shape[-1], x.shape[-1])


class MaskedLoRALinear(torch.autograd.Function):
    """y = x W^T + b + (c (x * m) A^T) B^T on the CPU kernels as one autograd node:
    ``MaskedLoRALinear.apply(x, mask, W, b, A, B, c, onednn)``.

    ``onednn``: the base products on oneDNN (the linear family's choice), else ``F.linear`` / ``@``.
    Saves x, the mask and the [N, r] product u = c (x * m) A^T (W, A, B are parameters); W and b frozen,
    x contiguous fp32 [.., in], everything fp32 on CPU (the caller has checked).
    """

    @staticmethod
    def forward(ctx, x, mask, weight, bias, lora_a, lora_b, scale, onednn):
        if onednn and bias_fits(bias, weight.shape[0]):
            y = onednn_linear(x, weight, bias)
        else:
            y = F.linear(x, weight, bias)
        u = masked_xa_cpu(x, mask, lora_a, float(scale))  # (.., r), scale folded in
        y.view(-1, y.shape[-1]).addmm_(u.view(-1, u.shape[-1]), lora_b.t())
        ctx.save_for_backward(x, mask, weight, lora_a, lora_b, u)
        ctx.scale, ctx.onednn = scale, onednn
        return y

    @staticmethod
    def backward(ctx, dy):
        x, mask, weight, lora_a, lora_b, u = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = da = db = None
        if ctx.needs_input_grad[5]:
            db = dy2.t() @ u.reshape(-1, u.shape[-1])  # (out, r)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[4]:
            du = (dy2 @ lora_b) * ctx.scale  # (N, r): the gradient of (x * m) A^T
            if ctx.needs_input_grad[4]:
                da = masked_da_cpu(du, x, mask)
            if ctx.needs_input_grad[0]:
                # (N, in), fresh and contiguous: the adapter's part is added in place
                dx = onednn_input_grad(dy2, weight) if ctx.onednn else dy2 @ weight
                masked_dx_add_cpu_(dx, du, lora_a, mask)
                dx = dx.view(x.shape)
        return dx, None, None, None, da, db, None, None
