"""``LoRALinear`` through the fused LoRA matmul (``ftlib.kernels.lora_matmul``) when its backend is Triton.

``fused_forward(layer, x)`` returns the layer's output computed by the fused op, or None when the
backend is the PyTorch one (CPU, float32/float64, ``FTLIB_LORA_BACKEND=torch``), in which case
the layer runs its own PyTorch path. Both give the same outputs and gradients up to rounding;
the dropout masks differ (the layer's own path uses ``nn.Dropout``, the fused op a Philox stream
keyed by :func:`draw_dropout_rng`).

Compute dtype: the autocast dtype under autocast, else x's dtype (as the base layer computes).
DoRA's row norm comes from the layer's cached ``||W||^2`` and one ``W A^T`` product; for an NF4
base that product runs through the fused kernel too, so QLoRA never holds a 16-bit copy of W.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["draw_dropout_rng", "fused_forward"]

_SEED_MASK = 2**62 - 1


def draw_dropout_rng(device: torch.device) -> tuple[int, int]:
    """A fresh (seed, offset) for one dropout mask, from torch's generator of ``device``.

    CUDA: the generator's seed and its Philox offset, advanced by 4 (a host-side counter: no sync;
    restored by activation checkpointing like any torch RNG state). CPU: a 62-bit draw.
    """
    if device.type == "cuda":
        gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
        offset = gen.get_offset()
        gen.set_offset(offset + 4)
        return gen.initial_seed() & _SEED_MASK, offset & _SEED_MASK
    return int(torch.randint(0, 2**62, (1,)).item()), 0


def _row_norm(layer, dtype: torch.dtype) -> torch.Tensor:
    if not layer.is_quantized:
        return layer.weight_norm()
    from ftlib.kernels.dora_ref import dora_row_norm
    from ftlib.kernels.lora_triton import base_matmul_triton

    base = layer.base_layer
    with torch.no_grad(), torch.autocast(layer.lora_A.weight.device.type, enabled=False):
        return dora_row_norm(lambda a: base_matmul_triton(a.to(dtype), base), layer._w_sq(), layer.lora_A.weight,
                             layer.lora_B.weight, layer.scaling, weight_rows=layer._base_rows)


def fused_forward(layer, x: torch.Tensor) -> torch.Tensor | None:
    """``layer(x)`` through the fused op, or None when the LoRA backend is not Triton."""
    from ftlib.kernels.lora import lora_backend, lora_matmul

    dev = x.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    if lora_backend(x, dtype=dtype, rank=layer.r) != "triton":
        return None
    drop = layer.lora_dropout
    if isinstance(drop, nn.Identity) or not layer.training:
        p = 0.0
    elif isinstance(drop, nn.Dropout):
        p = float(drop.p)
    else:
        return None  # a dropout module the kernel does not implement: the layer's own path
    base = layer.base_layer
    seed, offset = draw_dropout_rng(x.device) if p > 0 else (0, 0)
    magnitude = norm = None
    if layer.use_dora:
        magnitude, norm = layer.lora_magnitude_vector, _row_norm(layer, dtype)
    with torch.autocast(dev, enabled=False):
        return lora_matmul(
            x.to(dtype), base if layer.is_quantized else base.weight, layer.lora_A.weight, layer.lora_B.weight,
            layer.scaling, bias=base.bias, dropout_p=p, seed=seed, offset=offset, magnitude=magnitude,
            weight_norm=norm,
        )
