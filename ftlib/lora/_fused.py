"""``LoRALinear``'s op dispatch: the layer through the backend ``ftlib.kernels.lora_backend`` picks.

``dispatch_forward(layer, x)`` returns the layer's output computed by a backend of the LoRA family,
or None, in which case the layer runs its own PyTorch path (``FTLIB_LORA_BACKEND=torch``, CUDA
float32/float64, a layer a backend does not take):

- ``triton``: the fused LoRA matmul (``ftlib.kernels.lora_matmul``), dropout from a Philox stream
  keyed by :func:`draw_dropout_rng`;
- ``cpu`` (fp32 on CPU): with input dropout in training and a dense frozen ``nn.Linear`` base, the
  whole layer as one autograd node on the CPU wing's kernels (``ftlib.lora.dropout.masked_lora_linear``);
  otherwise, for a dense frozen base, the base product on the linear family's oneDNN GEMM
  (``ftlib.kernels.linear``) and the adapter added by the layer's own ``add_adapter``.

All give the same outputs and gradients up to rounding.

Compute dtype: the autocast dtype under autocast, else x's dtype (as the base layer computes).
DoRA's row norm comes from the layer's cached ``||W||^2`` and one ``W A^T`` product; for an NF4
base that product runs through the fused kernel too, so QLoRA never holds a 16-bit copy of W.
"""

from __future__ import annotations

import torch
from torch import nn

from ftlib.kernels.linear import linear
from ftlib.kernels.lora import lora_backend, lora_matmul

from .dropout import masked_lora_linear

__all__ = ["dispatch_forward", "draw_dropout_rng"]

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


def dispatch_forward(layer, x: torch.Tensor) -> torch.Tensor | None:
    """``layer(x)`` (an unmerged, enabled ``LoRALinear``) through its LoRA backend, or None for the
    layer's own PyTorch path."""
    dev = x.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    backend = lora_backend(x, dtype=dtype, rank=layer.r)
    if backend == "cpu":
        return _cpu_forward(layer, x)
    if backend != "triton":
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


def _cpu_forward(layer, x: torch.Tensor) -> torch.Tensor | None:
    """The ``cpu`` backend: the one-node layer (LoRA with input dropout in training), else the frozen
    dense base on the linear family plus ``add_adapter``; None for other bases (NF4, hooks, a subclass)."""
    base = layer.base_layer
    if type(base) is not nn.Linear or base._forward_hooks or base._forward_pre_hooks:
        return None
    drop = layer.lora_dropout
    if not layer.use_dora and type(drop) is nn.Dropout and drop.training and drop.p > 0.0:
        y = masked_lora_linear(x, base.weight, base.bias, layer.lora_A.weight, layer.lora_B.weight, drop.p,
                               layer.scaling)
        if y is not None:
            return y
    return layer.add_adapter(x, linear(x, base.weight, base.bias))  # (..., out) with the bias, then the adapter
