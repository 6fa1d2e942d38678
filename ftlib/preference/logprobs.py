"""Sequence and token log-probabilities without full logits: the chunked projection, per document and per pair.

Sequence log-probabilities. For a document s with response tokens y_t (labels != -100, labels
aligned with input_ids, the shift inside as in ``ftlib.losses``)::

    logp_sum(s)  = sum_t log softmax(W h_{t-1})[y_t],     n(s) = number of such t,
    logp_mean(s) = logp_sum(s) / n(s)

The first response token is predicted from the last prompt token's hidden state, so it is
included (labels on each document's first token are -100, so nothing is predicted across a
document boundary). ``sequence_logprobs`` computes them from the final hidden states and the LM
head ``chunk_size`` target tokens at a time: only response tokens are projected, only one
[chunk_size, V] block exists at a time, and backward recomputes each block (the recompute idea of
``ftlib.losses.chunked_cross_entropy``; here the result is per token, so the gradient is
``dlogp_i/dz_i = onehot(y_i) - softmax(z_i)`` scaled by each token's own upstream gradient).
Documents are the ``cu_seqlens`` segments of a packed batch, or the rows of a padded one.

``pair_logps`` gathers the chosen and rejected sides of a pair batch (``ftlib.data.pair_batches``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..losses import IGNORE_INDEX, head_weight

__all__ = ["PairLogps", "PairPolicy", "SequenceLogprobs", "TokenLogprobs", "pair_logps", "sequence_logprobs",
           "token_logprobs"]


# ---- sequence log-probabilities ------------------------------------------------------------------
class _ChunkedTokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, y, chunk_size, dtype, softcap=None, with_entropy=False, out_scale=1.0):
        # h (N, H) target tokens only, weight (V, H), y (N,); matmuls in `dtype`, softmax in fp32 (fp64 stays)
        acc = torch.promote_types(dtype, torch.float32)
        logp = torch.empty(h.shape[0], dtype=acc, device=h.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        with torch.autocast(device_type=h.device.type, enabled=False):
            w_t = weight.to(dtype).t()  # (H, V), converted once
            for s in range(0, h.shape[0], chunk_size):
                z = (h[s : s + chunk_size].to(dtype) @ w_t).to(acc)  # (C, V)
                if softcap is not None:  # c tanh(z / c) (Gemma-2's final_logit_softcapping)
                    z = torch.tanh(z / softcap) * softcap
                if out_scale != 1.0:  # 1 / temperature, after the cap
                    z = z * out_scale
                lse_c = torch.logsumexp(z, dim=-1)
                lse[s : s + chunk_size] = lse_c
                logp[s : s + chunk_size] = z.gather(1, y[s : s + chunk_size, None]).squeeze(1) - lse_c
                if with_entropy:  # H = lse - sum_v p_v z_v, from the block already in hand
                    entropy[s : s + chunk_size] = lse_c - (torch.exp(z - lse_c[:, None]) * z).sum(-1)
        ctx.save_for_backward(h, weight, y, lse)
        ctx.chunk_size, ctx.dtype, ctx.softcap, ctx.out_scale = chunk_size, dtype, softcap, out_scale
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy=None):
        h, weight, y, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        c, dtype, acc = ctx.chunk_size, ctx.dtype, lse.dtype
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        w = weight.to(dtype)
        g = grad_out.to(acc)
        for s in range(0, h.shape[0], c):
            hc = h[s : s + c].to(dtype)
            z = (hc @ w.t()).to(acc)  # (C, V), recomputed
            if ctx.softcap is not None:
                t = torch.tanh(z / ctx.softcap)
                z = t * ctx.softcap
            if ctx.out_scale != 1.0:
                z = z * ctx.out_scale
            dz = torch.exp(z - lse[s : s + c, None]).neg_()  # -softmax
            dz[torch.arange(hc.shape[0], device=dz.device), y[s : s + c]] += 1.0  # onehot - softmax
            dz *= g[s : s + c, None]
            if ctx.out_scale != 1.0:
                dz *= ctx.out_scale
            if ctx.softcap is not None:
                dz *= 1.0 - t * t  # through the cap
                del t
            if need_h:
                grad_h[s : s + c] = (dz.to(dtype) @ w).to(h.dtype)
            if need_w:
                grad_w += dz.t() @ hc.to(acc)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None, None


@dataclass
class SequenceLogprobs:
    """Per-document response log-probabilities: ``sum`` [S] (fp32; fp64 for fp64 inputs) and ``count`` [S] int64."""

    sum: torch.Tensor
    count: torch.Tensor

    @property
    def mean(self) -> torch.Tensor:
        return self.sum / self.count.clamp(min=1).to(self.sum.dtype)


@dataclass
class TokenLogprobs:
    """Per-target-token log-probabilities of a batch, in document then position order.

    ``logp`` [N] (fp32; fp64 for fp64 inputs), ``doc`` [N] int64 (the document of each target),
    ``n_docs``, and ``entropy`` [N] of the predicted distribution (no gradient) when asked for."""

    logp: torch.Tensor
    doc: torch.Tensor
    n_docs: int
    entropy: torch.Tensor | None = None

    def per_document(self) -> SequenceLogprobs:
        total = torch.zeros(self.n_docs, dtype=self.logp.dtype, device=self.logp.device).index_add(0, self.doc, self.logp)
        count = torch.zeros(self.n_docs, dtype=torch.int64, device=self.logp.device).index_add(
            0, self.doc, torch.ones_like(self.doc))
        return SequenceLogprobs(total, count)


def token_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, *,
                   cu_seqlens: torch.Tensor | None = None, chunk_size: int = 1024, temperature: float = 1.0,
                   entropy: bool = False, ignore_index: int = IGNORE_INDEX,
                   softcap: float | None = None) -> TokenLogprobs:
    """``log softmax(W h_{t-1} / temperature)[labels[t]]`` for every target token, without [tokens, V] logits.

    ``temperature`` divides the logits (as a sampler at that temperature sees them; done on h, the
    head being linear, or after the cap with ``softcap``); ``entropy=True`` also returns each predicted
    distribution's entropy, from the same logit blocks. The rest as ``sequence_logprobs``, which sums
    these per document:

    hidden [B, T, H] (final-norm output), lm_head_weight [V, H], labels [B, T] aligned with
    input_ids. Documents: the segments of ``cu_seqlens`` (int32 [S + 1] over the flattened B*T
    tokens, a packed batch) or, without it, the B rows. Matmuls run in the autocast dtype when
    autocast is on (else the inputs' common dtype), the softmax in fp32. ``softcap`` c: the logits are
    ``c * tanh(z / c)`` first (Gemma-2's ``final_logit_softcapping``).
    """
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [B, T, H], got shape {tuple(hidden.shape)}")
    b, t, hdim = hidden.shape
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != hdim:
        raise ValueError(f"lm_head_weight must be [V, {hdim}], got {tuple(lm_head_weight.shape)}")
    if labels.shape != (b, t):
        raise ValueError(f"labels must be [B, T]={(b, t)}, got {tuple(labels.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    y = labels[:, 1:].reshape(-1).long()
    keep = (y != ignore_index).nonzero().squeeze(1)  # (N,) shifted positions with a target
    h = hidden[:, :-1].reshape(-1, hdim).index_select(0, keep)  # (N, H): the predicting states
    out_scale = 1.0
    if temperature != 1.0 and softcap is None:
        h = h / temperature
    elif temperature != 1.0:  # capped logits: c tanh(z / c) / temperature
        out_scale = 1.0 / temperature
    y = y.index_select(0, keep)
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= lm_head_weight.shape[0]):
        raise ValueError(f"labels must be in [0, {lm_head_weight.shape[0]}) or {ignore_index}")
    if torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
    else:
        dtype = torch.promote_types(h.dtype, lm_head_weight.dtype)
    logp, ent = _ChunkedTokenLogprob.apply(h, lm_head_weight, y, int(chunk_size), dtype,
                                           None if softcap is None else float(softcap), bool(entropy),
                                           out_scale)  # (N,)
    # the document of a target is the document of the target token (flat position of labels[:, 1:])
    rows, cols = keep // (t - 1), keep % (t - 1) + 1
    if cu_seqlens is None:
        doc, n_docs = rows, b
    else:
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must be an integer tensor (document boundaries), got {cu_seqlens.dtype}")
        cu = cu_seqlens.to(device=keep.device, dtype=torch.int64)
        if cu.ndim != 1 or int(cu[0]) != 0 or int(cu[-1]) != b * t:
            raise ValueError(f"cu_seqlens must be 1-D from 0 to B*T={b * t}, got {cu.tolist()[:4]}...")
        doc, n_docs = torch.searchsorted(cu, rows * t + cols, right=True) - 1, cu.numel() - 1
    return TokenLogprobs(logp, doc, int(n_docs), ent if entropy else None)


def sequence_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, *,
                      cu_seqlens: torch.Tensor | None = None, chunk_size: int = 1024,
                      ignore_index: int = IGNORE_INDEX, softcap: float | None = None) -> SequenceLogprobs:
    """Sum and count of ``log p(labels[t] | ...)`` per document, without [tokens, V] logits (``token_logprobs``
    summed per document)."""
    return token_logprobs(hidden, lm_head_weight, labels, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                          ignore_index=ignore_index, softcap=softcap).per_document()


@dataclass
class PairLogps:
    """Log-probs of each pair's chosen and rejected responses: sums [P] and token counts [P]."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_n: torch.Tensor
    rejected_n: torch.Tensor

    def values(self, length_normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected): sums, or means per response token when ``length_normalize``."""
        if not length_normalize:
            return self.chosen, self.rejected
        return (self.chosen / self.chosen_n.clamp(min=1).to(self.chosen.dtype),
                self.rejected / self.rejected_n.clamp(min=1).to(self.rejected.dtype))


_LAYOUT = ("position_ids", "cu_seqlens", "max_seqlen", "attention_mask")  # the batch contract of ftlib.data.collate


def pair_logps(model, batch: dict, *, chunk_size: int = 1024) -> PairLogps:
    """Policy log-probs of a pair batch (packed or padded, ``ftlib.data.pair_batches``) through ``model``
    (a ``LlamaForCausalLM``: ``model.model`` gives hidden states, ``model.lm_head`` the head)."""
    hidden = model.model(batch["input_ids"], **{k: batch[k] for k in _LAYOUT if k in batch})
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    seq = sequence_logprobs(hidden, head_weight(model.lm_head), batch["labels"], cu_seqlens=batch.get("cu_seqlens"),
                            softcap=cap,
                            chunk_size=chunk_size)
    ci, ri = batch["chosen_index"].to(seq.sum.device), batch["rejected_index"].to(seq.sum.device)
    return PairLogps(seq.sum[ci], seq.sum[ri], seq.count[ci], seq.count[ri])


class PairPolicy(torch.nn.Module):
    """``pair_logps`` as a module: ``PairPolicy(model)(batch)`` -> (chosen, rejected, chosen_n, rejected_n),
    the tuple of ``PairLogps``' fields (``PairLogps(*out)``). The module DDP wraps, so the gradient
    all-reduce hooks see the whole policy forward (``ftlib.distributed.wrap_ddp(PairPolicy(model))``)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        lp = pair_logps(self.model, batch)
        return lp.chosen, lp.rejected, lp.chosen_n, lp.rejected_n
