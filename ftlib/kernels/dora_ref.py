"""DoRA's row norm ``||W + s B A||`` without a second weight-sized tensor (math the kernels use).

DoRA (Liu et al., "DoRA: Weight-Decomposed Low-Rank Adaptation", arXiv:2402.09353)
writes the adapted weight as a magnitude times a direction,

    W' = m * (W + s B A) / ||W + s B A||_row ,    m, ||.||_row in R^out,

where ``||.||_row`` is the L2 norm of each output row (over the input dimension;
PEFT's convention), initialised so that ``m = ||W||_row``. Following section 4.3
of the paper (and PEFT), the norm is treated as a constant in backward.

The direct computation forms ``W + s B A`` (out x in) every step. Expanding the
square avoids it:

    ||W + s B A||_o^2 = ||W||_o^2 + 2 s <W_o, (B A)_o> + s^2 ||(B A)_o||^2
    <W_o, (B A)_o>    = sum_k B_ok (W A^T)_ok            W A^T: [out, r]
    ||(B A)_o||^2     = B_o (A A^T) B_o^T                A A^T: [r, r]

Cancellation. The expansion sums terms of size up to ``||W||^2 + 2s|<W,BA>| + s^2||BA||^2``
to get a result that can be much smaller (an update that nearly cancels a row). Its
relative error is about eps * c with c = (that size) / result, so rows with c > 64 (more
than ~6 bits lost) are recomputed directly from their own rows of W (``weight_rows``):
the result then matches the direct norm to a few ulps, at the cost of a few rows (none are
ill-conditioned in ordinary training, where s B A is small next to W). The check runs on the
device without a host synchronisation (no ``nonzero``, no data-dependent branch: CUDA graphs
stay possible): the ``RECOMPUTE_ROWS`` rows with the largest c are recomputed every call and
their new norm is taken where c > 64. More than ``RECOMPUTE_ROWS`` ill-conditioned rows in one
layer would leave the rest at the expansion's accuracy.

Cost per step: one ``W A^T`` product (out*in*r multiply-adds, the same as running
the base layer on r tokens, done through the base layer itself so an NF4 base is
handled by its own matmul), plus O((out + in) r^2); extra memory O(out * r) instead
of O(out * in). ``||W||_o^2`` is computed once per frozen base weight and cached
(recomputed when the weight's storage, version, device or dtype changes). For an NF4
base the ``W A^T`` product dequantizes the weight once more per step (a transient copy
in the compute dtype, like the forward's own).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["RECOMPUTE_ROWS", "dora_row_norm", "dora_row_norm_direct", "row_sq_norm"]

RECOMPUTE_ROWS = 64  # rows checked for cancellation and recomputed directly per call (the worst ones)


@torch.no_grad()
def row_sq_norm(weight: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """``||W_o||^2`` fp32 [out], in row chunks so a bf16 weight never has a full fp32 copy."""
    out = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for i in range(0, weight.shape[0], chunk_rows):
        out[i : i + chunk_rows] = weight[i : i + chunk_rows].float().pow(2).sum(dim=1)
    return out


@torch.no_grad()
def dora_row_norm(
    base_matmul: Callable[[torch.Tensor], torch.Tensor],
    w_sq: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    weight_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``||W + s B A||_row`` fp32 [out], detached.

    Args:
        base_matmul: ``x -> x W^T`` without bias, (r, in) -> (r, out) (the frozen base layer).
        w_sq: ``||W||_row^2`` fp32 [out] (see :func:`row_sq_norm`).
        lora_A: [r, in]; lora_B: [out, r]; scaling: s.
        weight_rows: ``idx -> W[idx]`` ([k, in]); when given, rows that lost more than ~6 bits to
            cancellation are recomputed directly (see the module docstring).
    """
    a = lora_A.float()  # (r, in)
    b = lora_B.float()  # (out, r)
    wa = base_matmul(lora_A).float().t()  # (out, r) = W A^T
    cross = (b * wa).sum(dim=1)  # (out,) <W_o, (BA)_o>
    ba_sq = ((b @ (a @ a.t())) * b).sum(dim=1)  # (out,) ||(BA)_o||^2
    sq = w_sq + (2.0 * scaling) * cross + (scaling * scaling) * ba_sq
    norm = sq.clamp_min(0.0).sqrt()
    if weight_rows is not None and norm.numel():
        size = w_sq + (2.0 * scaling) * cross.abs() + (scaling * scaling) * ba_sq
        # cancellation factor c = size / sq, compared as sq * 64 < size (sq may be 0)
        ratio = size / sq.clamp_min(torch.finfo(torch.float32).tiny)  # c per row (inf-free)
        worst = torch.topk(ratio, min(RECOMPUTE_ROWS, norm.numel())).indices  # (k,) on the device
        rows = weight_rows(worst).float() + scaling * (b[worst] @ a)  # (k, in)
        bad = sq[worst] * 64.0 < size[worst]
        norm[worst] = torch.where(bad, torch.linalg.vector_norm(rows, dim=1), norm[worst])
    return norm


@torch.no_grad()
def dora_row_norm_direct(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """Reference: materialise ``W + s B A`` (fp32) and take its row norms, fp32 [out]."""
    full = weight.float() + scaling * (lora_B.float() @ lora_A.float())
    return torch.linalg.vector_norm(full, dim=1)
