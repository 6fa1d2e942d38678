"""QLoRA's NF4 base for the stacked MoE experts: each expert's slice of a stacked weight stored in NF4.

A stacked weight W [E, out, in] (``ftlib.models.moe.MoEExperts``) becomes an ``NF4Stack``: for every
expert e, W_e [out, in] quantized exactly as ``NF4Linear`` quantizes a dense weight
(``ftlib.kernels.nf4_ref``: NormalFloat4 codes for blocks of ``blocksize`` consecutive values of the
row-major W_e, one absmax per block, optionally double-quantized; bitsandbytes' layout, so each
expert's bytes are what ``bitsandbytes.functional.quantize_4bit`` gives for W_e). Blocks start at
each expert's first value, so none straddles two experts. Memory per stacked weight:

    E * (out * in / 2  +  4 * ceil(out * in / blocksize))  bytes            (0.5625 byte/param at 64)
    double quantization:  E * (out * in / 2 + ceil(out*in / blocksize) + 4 * ceil(nb / 256) + 4 + 1024)

The grouped product (``NF4Experts.project``) runs each expert's slice of the expert-sorted rows
(``sizes[e]`` rows, in order) through that expert's ``NF4Linear.linear_nobias``: the expert's weight
is dequantized (bitsandbytes on CUDA when installed, the PyTorch reference elsewhere:
``FTLIB_NF4_BACKEND``, the dense layer's dequantizer), used for one GEMM and dropped; backward
dequantizes it again instead of saving it, and saves no per-expert copy of the activations. At most
one expert's weight exists in the compute dtype at a time. The LoRA update goes on top unchanged:
``LoRAExperts(NF4Experts(...), adapters)`` adds ``s (x A_e^T) B_e^T`` to each group's result. A stacked
weight that is not quantized stays the frozen parameter it was (``quantize_modules="targets"``
quantizes the adapted stacked weights only, as it does for linear layers).

Reference: Dettmers et al. 2023 (QLoRA, arXiv:2305.14314); bitsandbytes' ``quantize_4bit`` layout.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.moe import MoEExperts, grouped_linear
from .nf4 import NF4Linear

__all__ = ["NF4Experts", "NF4Stack"]

_STACKED = ("gate_up_proj", "down_proj")  # MoEExperts' parameter order


class NF4Stack(nn.ModuleList):
    """E frozen ``NF4Linear`` (no bias), expert e's [out, in]; ``shape`` [E, out, in], ``dtype`` (the
    compute dtype) and ``device`` read like the stacked tensor's."""

    @classmethod
    def quantize(cls, weight: torch.Tensor, *, blocksize: int = 64, double_quant: bool = False) -> NF4Stack:
        """NF4 of each expert's slice of ``weight`` [E, out, in]."""
        if weight.dim() != 3:
            raise ValueError(f"NF4Stack.quantize: expected a stacked weight [E, out, in], got shape {tuple(weight.shape)}")
        return cls(NF4Linear.from_weight(weight[e], blocksize=blocksize, double_quant=double_quant)
                   for e in range(weight.shape[0]))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self), self[0].out_features, self[0].in_features))

    @property
    def dtype(self) -> torch.dtype:
        return self[0].compute_dtype

    @property
    def device(self) -> torch.device:
        return self[0].codes.device

    def grouped(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """``grouped_linear`` with each group's weight dequantized in turn: x [M, in] sorted by expert -> [M, out]."""
        parts = [self[e].linear_nobias(rows) for e, rows in enumerate(x.split(sizes)) if sizes[e]]
        return torch.cat(parts) if parts else x.new_zeros(0, self.shape[1])

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stacked weight [E, out, in] in ``dtype`` (default: the compute dtype)."""
        return torch.stack([layer.dequantize(dtype) for layer in self])

    def nbytes(self) -> int:
        """Bytes held by the codes and scales of every expert."""
        return sum(p.numel() * p.element_size() for p in self.parameters())


class NF4Experts(nn.Module):
    """``MoEExperts`` with some of its stacked weights (``names``) in NF4, the others as they were.

    Routing (``forward``) is ``MoEExperts.forward`` unchanged; only the grouped product differs.
    """

    forward = MoEExperts.forward

    def __init__(self, base: MoEExperts, names: list[str] | tuple[str, ...] = _STACKED, *, blocksize: int = 64,
                 double_quant: bool = False):
        super().__init__()
        bad = [n for n in names if n not in _STACKED]
        if bad:
            raise ValueError(f"NF4Experts: {bad} are not stacked expert weights (expected {', '.join(_STACKED)})")
        self.num_experts, self.act = base.num_experts, base.act
        self.blocksize, self.double_quant = blocksize, double_quant
        for name in _STACKED:
            w = getattr(base, name)
            if name in names:
                setattr(self, name, NF4Stack.quantize(w, blocksize=blocksize, double_quant=double_quant))
            else:
                setattr(self, name, w)  # the same frozen Parameter, no copy

    def quantized(self) -> list[str]:
        """The stacked weights held in NF4."""
        return [n for n in _STACKED if isinstance(getattr(self, n), NF4Stack)]

    def project(self, name: str, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """One grouped product with the stacked weight ``name`` over expert-sorted rows."""
        w = getattr(self, name)
        return w.grouped(x, sizes) if isinstance(w, NF4Stack) else grouped_linear(x, w, sizes)

    def to_experts(self, dtype: torch.dtype | None = None) -> MoEExperts:
        """A plain ``MoEExperts`` holding the dequantized weights (``dtype``: default each weight's own)."""
        e, two_i, h = self.gate_up_proj.shape
        with torch.device("meta"):
            out = MoEExperts(h, two_i // 2, e, self.act)
        for name in _STACKED:
            w = getattr(self, name)
            value = w.dequantize(dtype) if isinstance(w, NF4Stack) else w.detach().to(dtype or w.dtype)
            setattr(out, name, nn.Parameter(value, requires_grad=False))
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, nf4={self.quantized()}, blocksize={self.blocksize}, "
                f"double_quant={self.double_quant}")
