"""Token-weighted causal-LM cross-entropy, plain and chunked (no full logits).

Label convention: ``labels`` [B, T] are aligned with ``input_ids`` (``labels[b, t]`` is the
token at position t, or -100 for no loss), and the shift happens inside: the logits at
position t predict ``labels[:, t + 1]``. So the loss covers ``labels[:, 1:]`` predicted from
``logits[:, :-1]``, the Hugging Face convention.

Both functions return ``(loss_sum, num_tokens)``: the *sum* of -log p(label) over target
tokens and the number of target tokens (labels != -100). Summing, not averaging, is what makes
gradient accumulation exact: divide by the token count of the whole accumulation window
(``ftlib.optim`` does this), never per micro-batch.

Chunked variant: with vocabulary V = 128k and 8k tokens, fp32 logits alone take 4 GiB. The
chunked loss computes logits for ``chunk_size`` target tokens at a time, keeps only the
log-sum-exp per token (N floats) for backward, and recomputes each chunk's logits in backward::

    loss_i   = lse_i - z_i[y_i],          z_i = W h_i,  lse_i = log sum_v exp(z_iv)
    dL/dz_i  = g * (softmax(z_i) - onehot(y_i))
    dL/dh_i  = dL/dz_i @ W,               dL/dW = sum_i dL/dz_i^T h_i

Tokens without a label are dropped before any matmul. Peak extra memory is one
[chunk_size, V] fp32 block. The same recompute idea as Liger-Kernel's fused linear
cross-entropy (Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels for LLM Training").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "cross_entropy_sum", "chunked_cross_entropy", "count_target_tokens", "bradley_terry_loss"]

IGNORE_INDEX = -100


def _check_labels(labels: torch.Tensor, lead_shape: torch.Size, what: str) -> None:
    if labels.ndim != 2 or labels.shape != lead_shape:
        raise ValueError(f"labels must be [B, T] matching {what} {tuple(lead_shape)}, got {tuple(labels.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be int64 or int32, got {labels.dtype}")


def count_target_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Number of tokens that carry a loss under the shift convention: (labels[:, 1:] != -100).sum()."""
    return (labels[:, 1:] != ignore_index).sum()


def cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of ``labels[:, 1:]`` under ``logits[:, :-1]`` and the target count.

    logits [B, T, V] (any float dtype; half types computed in fp32), labels [B, T] aligned with
    input_ids. Returns (loss_sum fp32 (fp64 for fp64 logits) 0-d, num_tokens int64 0-d).
    """
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    _check_labels(labels, logits.shape[:2], "logits")
    vocab = logits.shape[-1]
    z = logits[:, :-1].reshape(-1, vocab)  # (B*(T-1), V)
    z = z.to(torch.promote_types(z.dtype, torch.float32))  # fp32 softmax for half inputs
    y = labels[:, 1:].reshape(-1).long()
    loss = F.cross_entropy(z, y, ignore_index=ignore_index, reduction="sum")
    return loss, (y != ignore_index).sum()


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, y, chunk_size, dtype):
        # h (N, H) target tokens only, weight (V, H), y (N,); matmuls in `dtype`
        acc = torch.promote_types(dtype, torch.float32)  # softmax in fp32 (fp64 stays fp64)
        lse = torch.empty(h.shape[0], dtype=acc, device=h.device)
        total = torch.zeros((), dtype=acc, device=h.device)
        # autocast off: backward recomputes the logits in the inputs' dtype, forward must match
        with torch.autocast(device_type=h.device.type, enabled=False):
            w_t = weight.to(dtype).t()  # (H, V): converted once, not per chunk (a [V, H] copy each)
            for s in range(0, h.shape[0], chunk_size):
                z = (h[s : s + chunk_size].to(dtype) @ w_t).to(acc)  # (C, V)
                lse_c = torch.logsumexp(z, dim=-1)
                lse[s : s + chunk_size] = lse_c
                total += (lse_c - z.gather(1, y[s : s + chunk_size, None]).squeeze(1)).sum()
        ctx.save_for_backward(h, weight, y, lse)
        ctx.chunk_size, ctx.dtype = chunk_size, dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        h, weight, y, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        c, dtype = ctx.chunk_size, ctx.dtype
        acc = lse.dtype
        # (V, H) accumulator in fp32: summing many chunks in bf16 would lose the small updates
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        w = weight.to(dtype)
        for s in range(0, h.shape[0], c):
            hc = h[s : s + c].to(dtype)
            z = (hc @ w.t()).to(acc)  # (C, V), recomputed
            dz = torch.exp(z - lse[s : s + c, None])  # softmax
            dz[torch.arange(hc.shape[0], device=dz.device), y[s : s + c]] -= 1.0
            dz *= grad_out
            if need_h:
                grad_h[s : s + c] = (dz.to(dtype) @ w).to(h.dtype)
            if need_w:
                grad_w += dz.t() @ hc.to(acc)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cross_entropy_sum(hidden @ lm_head_weight.T, labels)`` without [B, T, V] logits.

    hidden [B, T, H] (the final-norm output), lm_head_weight [V, H], labels [B, T] aligned with
    input_ids (same shift as :func:`cross_entropy_sum`). Matmuls run in the autocast dtype
    when autocast is on (else the inputs' common dtype), softmax in fp32. Returns (loss_sum fp32 0-d, num_tokens int64 0-d).
    """
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [B, T, H], got shape {tuple(hidden.shape)}")
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"lm_head_weight must be [V, {hidden.shape[2]}] for hidden size {hidden.shape[2]}, "
            f"got {tuple(lm_head_weight.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _check_labels(labels, hidden.shape[:2], "hidden")
    y = labels[:, 1:].reshape(-1).long()
    keep = (y != ignore_index).nonzero().squeeze(1)  # (N,) positions with a target
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, keep)  # (N, H)
    # the matmul dtype: autocast's when active (as nn.Linear would run), else the wider input's
    if torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
    else:
        dtype = torch.promote_types(h.dtype, lm_head_weight.dtype)
    y = y.index_select(0, keep)
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= lm_head_weight.shape[0]):
        raise ValueError(f"labels must be in [0, {lm_head_weight.shape[0]}) or {ignore_index}")
    loss = _ChunkedCE.apply(h, lm_head_weight, y, int(chunk_size), dtype)
    return loss, keep.new_tensor(keep.numel())


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise reward-model loss, summed: ``sum_i -log sigmoid(r_c,i - r_r,i - m_i)`` and the pair count.

    Bradley-Terry (Bradley & Terry 1952): P(chosen preferred) = sigmoid(r_c - r_r), the reward-model
    objective of InstructGPT (Ouyang et al. 2022); the optional margin m (a float or a [N] tensor)
    is Llama 2's (Touvron et al. 2023, eq. 2): a clearer preference must win by more. Computed as
    -logsigmoid(d - m) in fp32 (fp64 stays fp64), stable for any |d|. ``chosen``, ``rejected``: scores
    [N]. Returns (loss_sum 0-d, num_pairs int64 0-d), ready for ``TrainOptimizer.backward``.
    """
    if chosen.shape != rejected.shape or chosen.ndim != 1:
        raise ValueError(f"chosen and rejected must be [N] score vectors of one shape, got "
                         f"{tuple(chosen.shape)} and {tuple(rejected.shape)}")
    acc = torch.promote_types(torch.promote_types(chosen.dtype, rejected.dtype), torch.float32)
    d = chosen.to(acc) - rejected.to(acc)
    if margin is not None:
        m = torch.as_tensor(margin, dtype=acc, device=d.device)
        if m.ndim not in (0, 1) or (m.ndim == 1 and m.shape != d.shape):
            raise ValueError(f"margin must be a float or a [{d.shape[0]}] tensor, got shape {tuple(m.shape)}")
        d = d - m
    return -F.logsigmoid(d).sum(), torch.tensor(d.shape[0], dtype=torch.int64, device=d.device)
