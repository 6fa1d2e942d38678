"""``LoRALinear``: a frozen linear layer plus a trainable low-rank (LoRA / rsLoRA / DoRA) update.

    LoRA  (Hu et al., arXiv:2106.09685):     y = W x + b + s B A drop(x)
                                              (drop(x): ``ftlib.lora.dropout``, a 1-byte mask)
    DoRA  (Liu et al., arXiv:2402.09353):    y = b + (m / n) (W + s B A) x,
          n = ||W + s B A||_row detached (paper section 4.3); with dropout in training
          y = W x + b + (m / n - 1) W drop(x) + (m / n) s B A drop(x)  (PEFT's form)

with ``A`` [r, in], ``B`` [out, r], ``m`` [out], ``s = alpha / r`` (rsLoRA, Kalajdzievski
arXiv:2312.03732: ``alpha / sqrt(r)``). ``A`` starts Kaiming-uniform (a = sqrt(5), as
``nn.Linear``) or Gaussian N(0, 1/r^2), ``B`` at zero and ``m`` at ``||W||_row``, so a
fresh adapter leaves the output unchanged bit for bit. Parameter names match PEFT's
(``base_layer``, ``lora_A``, ``lora_B``, ``lora_magnitude_vector``).

The base is an ``nn.Linear`` (any dtype) or an ``NF4Linear`` (QLoRA). Adapter weights
are fp32 by default; under ``torch.autocast`` every matmul runs in the autocast dtype
and gradients land on the fp32 adapters; without autocast the input is cast to the
adapter dtype for the adapter path and the sum is returned in the base output's dtype.

Merging folds the update into the base weight in fp32 (DoRA: ``W <- (m / n) (W + s B A)``
with ``n`` kept for unmerging) and is undone exactly up to fp32 rounding. An NF4 base is
never merged in place (re-quantizing would drop most of the update): use
``merge_and_unload`` to export a dequantized, merged ``nn.Linear``.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.dora_ref import dora_row_norm, row_sq_norm
from ._fused import dispatch_forward
from .dropout import apply_mask, dropout_mask, masked_linear
from .nf4 import NF4Linear

__all__ = ["LoRALinear"]


class LoRALinear(nn.Module):
    """Wrap ``base_layer`` (``nn.Linear`` or ``NF4Linear``) with a rank-``r`` adapter."""

    def __init__(
        self,
        base_layer: nn.Module,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        *,
        use_rslora: bool = False,
        use_dora: bool = False,
        init: str = "kaiming",
        adapter_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if not isinstance(base_layer, (nn.Linear, NF4Linear)):
            raise TypeError(f"LoRALinear wraps nn.Linear or NF4Linear, got {type(base_layer).__name__}")
        if not isinstance(r, int) or r <= 0:
            raise ValueError(f"LoRA rank must be a positive integer, got {r!r}")
        if not alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {alpha!r}")
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.r, self.alpha, self.use_rslora, self.use_dora = r, float(alpha), use_rslora, use_dora
        self.scaling = self.alpha / math.sqrt(r) if use_rslora else self.alpha / r
        self.base_layer = base_layer
        for p in base_layer.parameters():
            p.requires_grad_(False)
        device = next(base_layer.parameters()).device
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=adapter_dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=adapter_dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self.disabled = False
        self._merge_norm: torch.Tensor | None = None  # DoRA: n at merge time, for unmerge
        self._w_sq_cache: tuple[tuple, torch.Tensor] | None = None
        self.reset_parameters(init)
        if use_dora:
            # m = ||W + s B A||_row = ||W||_row at init (B = 0)
            self.lora_magnitude_vector = nn.Parameter(self.weight_norm().to(adapter_dtype))
        self._warned_weight_dropout = False

    # ---- initialisation --------------------------------------------------------------------
    def reset_parameters(self, init: str = "kaiming") -> None:
        if init == "kaiming":
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        elif init == "gaussian":
            nn.init.normal_(self.lora_A.weight, std=1.0 / self.r)
        else:
            raise ValueError(f"init must be 'kaiming' or 'gaussian', got {init!r}")
        nn.init.zeros_(self.lora_B.weight)

    # ---- base weight access ----------------------------------------------------------------
    @property
    def is_quantized(self) -> bool:
        return isinstance(self.base_layer, NF4Linear)

    def base_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The base weight [out, in] (dequantized for NF4), detached."""
        base = self.base_layer
        if isinstance(base, NF4Linear):
            return base.dequantize(dtype or base.compute_dtype)
        w = base.weight.detach()
        return w if dtype is None else w.to(dtype)

    def _base_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` without bias, in the base's compute dtype. x (..., in) -> (..., out)."""
        base = self.base_layer
        if isinstance(base, NF4Linear):
            return base.linear_nobias(x.to(base.compute_dtype))
        return F.linear(x.to(base.weight.dtype), base.weight)

    def _w_sq(self) -> torch.Tensor:
        """Cached ``||W||_row^2`` fp32 [out] of the frozen base."""
        t = self.base_layer.codes if self.is_quantized else self.base_layer.weight
        try:
            version = t._version
        except RuntimeError:  # inference tensors have no version counter: never trust the cache
            version = object()
        key = (t.data_ptr(), version, t.device, t.dtype, tuple(t.shape))
        if self._w_sq_cache is None or self._w_sq_cache[0] != key:
            w = self.base_weight(torch.float32) if self.is_quantized else t.detach()
            self._w_sq_cache = (key, row_sq_norm(w))
        return self._w_sq_cache[1]

    @torch.no_grad()
    def weight_norm(self) -> torch.Tensor:
        """DoRA's ``n = ||W + s B A||_row`` fp32 [out], detached; see ``ftlib.kernels.dora_ref`` for the cost."""
        with torch.autocast(self.lora_A.weight.device.type, enabled=False):
            return dora_row_norm(self._base_matmul, self._w_sq(), self.lora_A.weight, self.lora_B.weight,
                                 self.scaling, weight_rows=self._base_rows)

    def _base_rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``W[idx]`` of the base weight (dequantizing an NF4 base whole: a rare fallback)."""
        if self.is_quantized:
            return self.base_weight(torch.float32)[idx]
        return self.base_layer.weight.detach()[idx]

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.disabled or self.merged):
            out = dispatch_forward(self, x)  # the LoRA backend (FTLIB_LORA_BACKEND): Triton, the CPU wing, else None
            if out is not None:
                return out
        result = self.base_layer(x)  # (..., out), includes the bias
        if self.disabled or self.merged:
            return result
        return self.add_adapter(x, result)

    def add_adapter(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """``result`` plus this adapter's update for input x, where ``result = base_layer(x)``.

        ``result`` may be updated in place (its buffer becomes the output). Split from
        :meth:`forward` so a caller that computes the base output some other way (one GEMM for
        several projections of the same input, a fused kernel) can add the adapter to it.
        """
        if self.disabled or self.merged:
            return result
        out_dtype = result.dtype
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.lora_A.weight.dtype)
        drop = self.lora_dropout
        p = drop.p if type(drop) is nn.Dropout and drop.training else 0.0
        custom = not isinstance(drop, (nn.Dropout, nn.Identity))  # a user's own module: call it as is
        if not self.use_dora:
            if p > 0.0:
                u = masked_linear(x, self.lora_A.weight, p, self.scaling)
            else:
                u = self.lora_A(drop(x) if custom else x) * self.scaling
            # result += u B^T as one GEMM accumulating in place: no [.., out] update tensor written and
            # read back, and (s already in u) no [.., out] multiply in backward. Nothing saves the base
            # output, so updating it in place is safe.
            w = self.lora_B.weight
            if result.dtype == u.dtype == w.dtype and result.dim() in (2, 3):
                if result.dim() == 2:
                    return result.addmm_(u, w.t())
                return result.baddbmm_(u, w.t().expand(result.shape[0], -1, -1))
            lora = self.lora_B(u)
            if result.dtype == lora.dtype:
                return result.add_(lora)
            return torch.add(result, lora).to(out_dtype)
        h = drop(x) if custom else x
        if p > 0.0:
            mask, scale = dropout_mask(x, p)
            h = apply_mask(x, mask) * scale
        lora = self.lora_B(self.lora_A(h))  # (..., out), unscaled
        mag_scale = self.lora_magnitude_vector / self.weight_norm()  # (out,), grad flows to m only
        if h is x:
            base_nobias = result if self.base_layer.bias is None else result - self.base_layer.bias
        else:
            base_nobias = self._base_matmul(h)  # W drop(x): the DoRA term sees the same dropped input
        # result + (m/n - 1) W x + (m/n) s B A x, as two fused multiply-adds; exact at init (m/n = 1, B = 0)
        y = torch.addcmul(result.to(mag_scale.dtype), mag_scale - 1, base_nobias)
        return torch.addcmul(y, mag_scale * self.scaling, lora).to(out_dtype)

    def effective_weight(self) -> torch.Tensor:
        """The adapted weight ``W' = W + s B A`` [out, in] (DoRA: rows scaled by ``m / ||W + s B A||``,
        the norm detached as in the forward), differentiable in the adapter's parameters.

        For callers that multiply by the weight themselves instead of calling the layer: the chunked
        losses read an LM head's weight (``ftlib.losses.head_weight``), so a LoRA-adapted ``lm_head``
        trains through this. Costs one [out, in] tensor (and its gradient in backward): 1 GB in bf16
        for a 128k x 4096 head. Dropout acts on the layer's input, which a weight cannot carry: with
        dropout > 0 in training mode this warns once and applies none (the update's expectation over
        the masks is the undropped one).
        """
        base = self.base_weight() if self.is_quantized else self.base_layer.weight
        if self.disabled or self.merged:
            return base
        if self.training and not isinstance(self.lora_dropout, nn.Identity) and not self._warned_weight_dropout:
            warnings.warn("LoRALinear.effective_weight: the adapter's input dropout is not applied (a weight "
                          "cannot carry it); set dropout 0 for this module to silence this", stacklevel=2)
            self._warned_weight_dropout = True
        a, b = self.lora_A.weight, self.lora_B.weight
        delta = (b.float() @ a.float()) * self.scaling if a.dtype != torch.float64 else (b @ a) * self.scaling
        w = base.to(delta.dtype) + delta
        if self.use_dora:
            w = (self.lora_magnitude_vector.to(w.dtype) / self.weight_norm().to(w.dtype)).unsqueeze(1) * w
        return w.to(base.dtype)

    # ---- merging ---------------------------------------------------------------------------
    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``s B A`` fp32 [out, in]."""
        return self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    @torch.no_grad()
    def merged_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(``W'`` fp32 [out, in], DoRA norm ``n`` or None) from the unmerged state."""
        w = self.base_weight(torch.float32) + self.delta_weight()  # W + s B A
        if not self.use_dora:
            return w, None
        norm = torch.linalg.vector_norm(w, dim=1)  # (out,) exact row norms: merging is once, not per step
        return (self.lora_magnitude_vector.float() / norm).view(-1, 1) * w, norm

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the adapter into the base weight (in place); the forward then skips the adapter."""
        if self.merged:
            raise RuntimeError("LoRALinear.merge: adapter is already merged")
        if self.is_quantized:
            raise RuntimeError(
                "LoRALinear.merge: the base weight is NF4; merging in place would re-quantize and lose the update. "
                "Use ftlib.lora.merge_and_unload(model) to export a dequantized, merged model."
            )
        w = self.base_layer.weight
        merged, self._merge_norm = self.merged_weight()
        w.copy_(merged.to(w.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo :meth:`merge` (exact up to rounding in the base dtype)."""
        if not self.merged:
            raise RuntimeError("LoRALinear.unmerge: adapter is not merged")
        w = self.base_layer.weight
        cur = w.float()
        if self.use_dora:
            cur = cur / (self.lora_magnitude_vector.float() / self._merge_norm).view(-1, 1)
            self._merge_norm = None
        w.copy_((cur - self.delta_weight()).to(w.dtype))
        self.merged = False

    def to_linear(self, dtype: torch.dtype | None = None) -> nn.Linear:
        """A plain ``nn.Linear`` holding the merged weight in ``dtype`` (default: the base's dtype)."""
        if self.merged:
            merged = self.base_layer.weight.detach().float()
        else:
            merged, _ = self.merged_weight()
        base = self.base_layer
        dtype = dtype or (base.compute_dtype if isinstance(base, NF4Linear) else base.weight.dtype)
        out = nn.Linear(self.in_features, self.out_features, bias=base.bias is not None, device=merged.device, dtype=dtype)
        with torch.no_grad():
            out.weight.copy_(merged)
            if base.bias is not None:
                out.bias.copy_(base.bias)
        out.requires_grad_(False)
        return out

    def extra_repr(self) -> str:
        return (f"r={self.r}, alpha={self.alpha:g}, scaling={self.scaling:.4g}, rslora={self.use_rslora}, "
                f"dora={self.use_dora}, merged={self.merged}")
