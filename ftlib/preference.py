"""Preference tuning: sequence log-probabilities without full logits, the DPO family of losses, and
reference log-probabilities that need no second model.

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

Losses (Δ = (π_c - π_r) - (ρ_c - ρ_r), π policy and ρ reference log-probs of the chosen c and
rejected r responses; h = β Δ; softplus(x) = log(1 + e^x) = -log σ(-x)):

    sigmoid  (DPO, Rafailov et al. 2023)           (1 - ε) softplus(-h) + ε softplus(h)
             ε > 0: conservative DPO / label smoothing (Mitchell 2023, "A note on DPO with noisy preferences")
    robust   (Chowdhury et al. 2024, "Provably robust DPO")   ((1 - ε) softplus(-h) - ε softplus(h)) / (1 - 2ε)
    ipo      (Azar et al. 2023, "A general theoretical paradigm ...")   (Δ - 1 / (2β))^2
    hinge    (SLiC, Zhao et al. 2023)              max(0, 1 - h)
    simpo    (Meng et al. 2024), reference-free    h' = β (π̄_c - π̄_r) - γ;  (1 - ε) softplus(-h') + ε softplus(h')
    orpo     (Hong et al. 2024), reference-free    -π̄_c + β softplus(-(odds(π̄_c) - odds(π̄_r))),
             odds(x) = x - log(1 - e^x)   (β is the paper's λ)

π̄ = length-normalised (mean per response token) log-probs: always for simpo and orpo, and by
default for ipo (as TRL does; ``length_normalize`` overrides for the others). Rewards for logging:
β (π - ρ) per side (simpo, orpo: β π̄), margin = chosen - rejected reward, accuracy = 1 when the
chosen reward is strictly larger. Losses are per pair: sum them and divide by the number of pairs
of the accumulation window (``TrainOptimizer.backward(losses.sum(), n_pairs)``).

Guards against likelihood displacement (DPO can widen the margin while the chosen responses'
likelihood falls too: Razin et al. 2024, "Unintentional unalignment"; Pal et al. 2024, "Smaug"):

    RPO   (Pang et al. 2024, "Iterative reasoning preference optimization"; TRL's ``rpo_alpha``)
          loss + α · nll_c,   nll_c = -π_c / n_c   (the NLL of the chosen response per response token,
          from the summed log-probs whatever ``length_normalize`` says). TRL takes the token mean over
          all chosen tokens of its batch, which is this value when the chosen responses of a batch
          have one length; per pair here, so gradient accumulation does not change it.
    DPOP  (Pal et al. 2024, "Smaug", eq. 3)    Δ' = Δ - λ · max(0, ρ_c - π_c)   in place of Δ:
          the loss grows as soon as the chosen log-prob falls below the reference's.

``LikelihoodDisplacementMonitor`` watches the logged means (``PreferenceOutput.stats()``, TRL's names
``logps/chosen``, ``rewards/margins``, ...) and warns when the chosen log-probs fall steadily while
the margin grows.

Reference log-probs. ``reference_pair_logps`` runs the same model with its adapters disabled
(``ftlib.lora.disable_adapters``: no weight copied) under ``torch.no_grad()``, or a separate frozen
model, or reads the values a batch carries when the pair cache holds a reference computed once by
``precompute_reference`` (then training runs no reference pass at all).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ._dist import comm_device, get_rank, get_world_size
from .losses import IGNORE_INDEX, head_weight

__all__ = [
    "LOSS_KINDS", "LikelihoodDisplacementMonitor", "LikelihoodDisplacementWarning", "PairLogps", "PreferenceLoss",
    "PreferenceOutput", "SequenceLogprobs", "TokenLogprobs", "dpo_sigmoid_loss", "dpop_penalty", "hinge_loss", "ipo_loss",
    "orpo_loss", "pair_logps", "precompute_reference", "reference_pair_logps", "robust_dpo_loss", "rpo_nll",
    "sequence_logprobs", "simpo_loss", "token_logprobs",
]

LOSS_KINDS = ("sigmoid", "robust", "ipo", "hinge", "simpo", "orpo")
_REFERENCE_FREE = ("simpo", "orpo")


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


@torch.no_grad()
def reference_pair_logps(model, batch: dict, *, reference_model=None, autocast=None,
                         chunk_size: int = 1024) -> PairLogps:
    """Reference log-probs of a pair batch, with no gradient.

    In order: the batch's precomputed ``ref_chosen`` / ``ref_rejected`` when present (token counts
    from the labels); else ``reference_model`` when given (a frozen model, e.g. for full fine-tuning);
    else ``model`` with its adapters disabled. ``autocast``: a callable returning a context manager
    (e.g. ``opt.autocast``) so the reference runs in the training precision.
    """
    if "ref_chosen" in batch:
        labels = batch["labels"]
        # token counts per document from the labels, as sequence_logprobs counts them
        valid = labels[:, 1:] != IGNORE_INDEX
        if "cu_seqlens" in batch:
            t = labels.shape[1]
            pos = valid.nonzero()
            cu = batch["cu_seqlens"].to(labels.device, torch.int64)
            doc = torch.searchsorted(cu, pos[:, 0] * t + pos[:, 1] + 1, right=True) - 1
            count = torch.zeros(cu.numel() - 1, dtype=torch.int64, device=labels.device).index_add(
                0, doc, torch.ones_like(doc))
        else:
            count = valid.sum(1)
        ci, ri = batch["chosen_index"].to(count.device), batch["rejected_index"].to(count.device)
        return PairLogps(batch["ref_chosen"].float(), batch["ref_rejected"].float(), count[ci], count[ri])
    ctx = autocast() if autocast is not None else nullcontext()
    if reference_model is not None:
        with ctx:
            return pair_logps(reference_model, batch, chunk_size=chunk_size)
    from .lora import disable_adapters, lora_layers

    if not any(True for _ in lora_layers(model)):
        raise ValueError("reference_pair_logps: the model has no adapters to disable; pass reference_model= (a "
                         "frozen copy of the starting model) or precompute the reference into the pair cache")
    with disable_adapters(model), ctx:
        return pair_logps(model, batch, chunk_size=chunk_size)


def precompute_reference(model, cache, name: str, *, pad_id: int, seq_len: int | None = None,
                         batch_size: int = 1, reference_model=None, autocast=None, device=None,
                         chunk_size: int = 1024, description: str = "", progress: bool = True):
    """Compute every pair's reference log-probs once and store them in the pair cache.

    Writes ``<cache>/reference/<name>.safetensors`` (``chosen``, ``rejected``: float64 [n_pairs],
    summed over response tokens; metadata: the cache fingerprint, ``description``) atomically and
    attaches it (``cache.reference``), so the ``PairLoader`` batches carry ``ref_chosen`` /
    ``ref_rejected`` and ``reference_pair_logps`` reads them. The pass runs like
    ``reference_pair_logps`` (adapters disabled, or ``reference_model``; ``autocast`` a context
    factory such as ``opt.autocast``), in packed rows of ``seq_len`` (default: the longest pair),
    ``batch_size`` rows per forward. Under torch.distributed every rank must call it: each computes
    its share of the pairs, the values are summed across ranks, rank 0 writes the file and every
    rank attaches it. Returns the cache.
    """
    from ._atomic import atomic_write
    from .data import PairLoader

    world, rank = get_world_size(), get_rank()
    ref_attached, cache.reference = cache.reference, None  # batches must not carry an old reference
    try:
        sc, sr = cache.side_lengths
        seq_len = seq_len or int((sc + sr).max())
        loader = PairLoader(cache, batch_size=batch_size, pad_id=pad_id, seq_len=seq_len, packing=True,
                            shuffle=False, drop_last=False, rank=rank, world_size=world)
        values = np.zeros((3, len(cache)))  # chosen, rejected, computed-here count
        it = loader
        if progress and rank == 0:
            from tqdm.auto import tqdm

            it = tqdm(loader, total=len(loader), desc=f"reference {name}")
        for batch in it:
            ids = batch["pair_ids"].numpy()
            if device is not None:
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            ref = reference_pair_logps(model, batch, reference_model=reference_model, autocast=autocast,
                                       chunk_size=chunk_size)
            values[0, ids] = ref.chosen.double().cpu().numpy()
            values[1, ids] = ref.rejected.double().cpu().numpy()
            values[2, ids] += 1
        if world > 1:
            t = torch.from_numpy(values).to(comm_device())
            torch.distributed.all_reduce(t)
            values = t.cpu().numpy()
    except BaseException:
        cache.reference = ref_attached
        raise
    chosen, rejected, seen = values
    bad = np.flatnonzero((seen != 1) | ~np.isfinite(chosen) | ~np.isfinite(rejected))
    if len(bad):
        raise RuntimeError(f"precompute_reference: {len(bad)} pairs got no single finite reference log-prob "
                           f"(first: pair {int(bad[0])})")
    if rank == 0:
        from safetensors.numpy import save

        meta = {"cache_fingerprint": cache.fingerprint(), "name": name, "n_pairs": str(len(cache)),
                "description": description, "format": "ftlib-pair-reference-v1"}
        path = cache.reference_path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = save({"chosen": np.ascontiguousarray(chosen), "rejected": np.ascontiguousarray(rejected)},
                    metadata=meta)
        atomic_write(path, lambda tmp: tmp.write_bytes(data))
    if world > 1:
        torch.distributed.barrier()
    cache.load_reference(name)
    return cache


# ---- losses ------------------------------------------------------------------------------------------
def dpo_sigmoid_loss(logits: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """(1 - ε) softplus(-β Δ) + ε softplus(β Δ) per pair; ``logits`` = Δ."""
    h = beta * logits
    return (1 - label_smoothing) * F.softplus(-h) + label_smoothing * F.softplus(h)


def robust_dpo_loss(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """((1 - ε) softplus(-β Δ) - ε softplus(β Δ)) / (1 - 2ε), the unbiased loss under label flips of rate ε."""
    h = beta * logits
    return ((1 - label_smoothing) * F.softplus(-h) - label_smoothing * F.softplus(h)) / (1 - 2 * label_smoothing)


def ipo_loss(logits: torch.Tensor, beta: float) -> torch.Tensor:
    """(Δ - 1 / (2β))^2 per pair."""
    return (logits - 1 / (2 * beta)) ** 2


def hinge_loss(logits: torch.Tensor, beta: float) -> torch.Tensor:
    """max(0, 1 - β Δ) per pair."""
    return torch.relu(1 - beta * logits)


def simpo_loss(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor, beta: float, gamma: float,
               label_smoothing: float = 0.0) -> torch.Tensor:
    """h = β (π̄_c - π̄_r) - γ;  (1 - ε) softplus(-h) + ε softplus(h) per pair (mean log-probs in)."""
    h = beta * (chosen_mean - rejected_mean) - gamma
    return (1 - label_smoothing) * F.softplus(-h) + label_smoothing * F.softplus(h)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, accurate on both sides of -ln 2 (Mächler 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor, beta: float) -> torch.Tensor:
    """-π̄_c + β softplus(-(odds_c - odds_r)), odds(x) = x - log(1 - e^x); mean log-probs in.

    Means are clamped to <= -1e-6 so the odds stay finite when a response has probability ~1.
    """
    c, r = chosen_mean.clamp(max=-1e-6), rejected_mean.clamp(max=-1e-6)
    log_odds = (c - _log1mexp(c)) - (r - _log1mexp(r))
    return -chosen_mean + beta * F.softplus(-log_odds)


def rpo_nll(chosen_sum: torch.Tensor, chosen_n: torch.Tensor) -> torch.Tensor:
    """RPO's NLL term per pair: -π_c / n_c, the chosen response's negative log-likelihood per response token."""
    return -chosen_sum / chosen_n.clamp(min=1).to(chosen_sum.dtype)


def dpop_penalty(policy_chosen: torch.Tensor, reference_chosen: torch.Tensor) -> torch.Tensor:
    """DPOP's penalty per pair: max(0, ρ_c - π_c), positive once the chosen log-prob falls below the reference's."""
    return torch.relu(reference_chosen - policy_chosen)


@dataclass
class PreferenceOutput:
    """Per-pair ``losses`` [P] (with grad) and detached logging values [P]: rewards, the policy's summed
    log-probs of each side, and RPO's NLL term when the loss has one."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor | None = None
    rejected_logps: torch.Tensor | None = None
    nll: torch.Tensor | None = None

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracies(self) -> torch.Tensor:
        return (self.chosen_rewards > self.rejected_rewards).to(self.chosen_rewards.dtype)

    def stats(self) -> dict:
        """Batch means as Python floats, under TRL's names: ``loss``, ``rewards/chosen``, ``rewards/rejected``,
        ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (summed policy
        log-probs), ``nll_loss`` (with RPO); ``n_pairs`` weighs them when micro-batches are combined."""
        if self.losses.numel() == 0:
            return {"n_pairs": 0}
        out = {"n_pairs": int(self.losses.numel()), "loss": float(self.losses.detach().mean()),
               "rewards/chosen": float(self.chosen_rewards.mean()), "rewards/rejected": float(self.rejected_rewards.mean()),
               "rewards/accuracies": float(self.accuracies.mean()), "rewards/margins": float(self.margins.mean())}
        if self.chosen_logps is not None:
            out["logps/chosen"] = float(self.chosen_logps.mean())
            out["logps/rejected"] = float(self.rejected_logps.mean())
        if self.nll is not None:
            out["nll_loss"] = float(self.nll.mean())
        return out


@dataclass(frozen=True)
class PreferenceLoss:
    """A DPO-family loss (module docstring): ``PreferenceLoss(kind, beta, ...)(policy, reference)``.

    ``label_smoothing`` ε for sigmoid (conservative DPO), robust (< 0.5) and simpo; ``gamma`` the SimPO
    target margin; ``length_normalize`` None = per-kind default (simpo, orpo, ipo: mean log-probs;
    others: sums); ``reference_free`` scores sigmoid/robust/ipo/hinge against ρ = 0. Guards:
    ``rpo_alpha`` α adds α · (-π_c / n_c) per pair (RPO; None = off, as in TRL); ``dpop_lambda`` λ > 0
    replaces Δ by Δ - λ max(0, ρ_c - π_c) (DPOP; reference-based kinds).
    """

    kind: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5
    length_normalize: bool | None = None
    reference_free: bool = False
    rpo_alpha: float | None = None
    dpop_lambda: float = 0.0

    def __post_init__(self):
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"unknown preference loss {self.kind!r}; choose one of {', '.join(LOSS_KINDS)}")
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        hi = 0.5 if self.kind == "robust" else 1.0
        if not 0 <= self.label_smoothing < hi:
            raise ValueError(f"label_smoothing must be in [0, {hi}) for {self.kind}, got {self.label_smoothing}")
        if self.label_smoothing and self.kind not in ("sigmoid", "robust", "simpo"):
            raise ValueError(f"label_smoothing does not apply to the {self.kind} loss")
        if self.kind in _REFERENCE_FREE and self.length_normalize is False:
            raise ValueError(f"{self.kind} is defined on length-normalised log-probs (length_normalize=False refused)")
        if self.rpo_alpha is not None:
            if not (math.isfinite(self.rpo_alpha) and self.rpo_alpha >= 0):
                raise ValueError(f"rpo_alpha must be a finite number >= 0 (or None), got {self.rpo_alpha}")
            if self.kind == "orpo":
                raise ValueError("rpo_alpha does not apply to orpo: its loss already holds the chosen NLL")
        if not (math.isfinite(self.dpop_lambda) and self.dpop_lambda >= 0):
            raise ValueError(f"dpop_lambda must be a finite number >= 0, got {self.dpop_lambda}")
        if self.dpop_lambda and not self.needs_reference:
            raise ValueError(f"dpop_lambda needs reference log-probs; the {self.kind} loss"
                             f"{' with reference_free=True' if self.reference_free else ''} has none")

    @property
    def needs_reference(self) -> bool:
        return self.kind not in _REFERENCE_FREE and not self.reference_free

    @property
    def normalize(self) -> bool:
        if self.length_normalize is not None:
            return self.length_normalize
        return self.kind in ("simpo", "orpo", "ipo")

    def __call__(self, policy: PairLogps, reference: PairLogps | None = None) -> PreferenceOutput:
        pc, pr = policy.values(self.normalize)
        b, k = self.beta, self.kind
        logged = dict(chosen_logps=policy.chosen.detach(), rejected_logps=policy.rejected.detach())
        if k in _REFERENCE_FREE:
            if k == "simpo":
                losses = simpo_loss(pc, pr, b, self.gamma, self.label_smoothing)
            else:
                losses = orpo_loss(pc, pr, b)
            return self._with_rpo(losses, policy, (b * pc).detach(), (b * pr).detach(), logged)
        if reference is None:
            if self.needs_reference:
                raise ValueError(f"the {k} loss needs reference log-probs (or reference_free=True)")
            rc, rr = torch.zeros_like(pc), torch.zeros_like(pr)
        else:
            if reference.chosen_n.shape != policy.chosen_n.shape or not (
                    torch.equal(reference.chosen_n.cpu(), policy.chosen_n.cpu())
                    and torch.equal(reference.rejected_n.cpu(), policy.rejected_n.cpu())):
                raise ValueError("reference and policy log-probs cover different response tokens (token counts differ)")
            rc, rr = (v.to(pc.dtype).detach() for v in reference.values(self.normalize))
        logits = (pc - pr) - (rc - rr)
        if self.dpop_lambda:
            logits = logits - self.dpop_lambda * dpop_penalty(pc, rc)
        if k == "sigmoid":
            losses = dpo_sigmoid_loss(logits, b, self.label_smoothing)
        elif k == "robust":
            losses = robust_dpo_loss(logits, b, self.label_smoothing)
        elif k == "ipo":
            losses = ipo_loss(logits, b)
        else:
            losses = hinge_loss(logits, b)
        return self._with_rpo(losses, policy, (b * (pc - rc)).detach(), (b * (pr - rr)).detach(), logged)

    def _with_rpo(self, losses, policy: PairLogps, chosen_rewards, rejected_rewards, logged) -> PreferenceOutput:
        nll = None
        if self.rpo_alpha is not None:
            nll = rpo_nll(policy.chosen, policy.chosen_n)
            losses = losses + self.rpo_alpha * nll
            nll = nll.detach()
        return PreferenceOutput(losses, chosen_rewards, rejected_rewards, nll=nll, **logged)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


# ---- likelihood displacement -------------------------------------------------------------------------
class LikelihoodDisplacementWarning(UserWarning):
    """The chosen responses' log-probs fall steadily while the preference margin grows."""


def _trend(y: list[float]) -> tuple[float, float]:
    """Least-squares slope of ``y`` against 0, 1, 2, ... and its t statistic (slope / standard error;
    ±inf for a noiseless line)."""
    n = len(y)
    xm, ym = (n - 1) / 2, sum(y) / n
    sxx = sum((i - xm) ** 2 for i in range(n))
    slope = sum((i - xm) * (v - ym) for i, v in enumerate(y)) / sxx
    ssr = sum((v - ym - slope * (i - xm)) ** 2 for i, v in enumerate(y))
    se = math.sqrt(ssr / (n - 2) / sxx)
    if se == 0:
        return slope, math.copysign(math.inf, slope) if slope else 0.0
    return slope, slope / se


class LikelihoodDisplacementMonitor:
    """Warns when, over a window of ``window`` steps, the mean chosen log-prob fell steadily while the mean
    margin grew.

    "Steadily" means a trend, not noise: the least-squares slope of ``logps/chosen`` is negative and that
    of ``rewards/margins`` positive, each at least ``t`` standard errors from zero, and the fitted fall of
    the chosen log-prob over the window, -slope · (window - 1), is at least ``min_drop`` nats. Windows do
    not overlap (steps 1..w, w+1..2w, ...): each is tested once, so noise alone seldom warns over a
    long run.

    ``update(stats)`` takes one step's ``PreferenceOutput.stats()`` (pair-weighted over the step's
    micro-batches) and returns the warning text when it fires, else None; with ``warn`` it is also
    issued as a ``LikelihoodDisplacementWarning``. ``state_dict`` / ``load_state_dict`` carry the
    window across a resume.
    """

    def __init__(self, window: int = 50, min_drop: float = 0.5, t: float = 3.0, warn: bool = True):
        if window < 4:
            raise ValueError(f"window must be >= 4 steps, got {window}")
        if not (min_drop >= 0 and t >= 0):
            raise ValueError(f"min_drop and t must be >= 0, got {min_drop}, {t}")
        self.window, self.min_drop, self.t, self.warn = window, min_drop, t, warn
        self.chosen: deque[float] = deque(maxlen=window)
        self.margin: deque[float] = deque(maxlen=window)
        self.fired = 0

    def update(self, stats: dict) -> str | None:
        if "logps/chosen" not in stats or "rewards/margins" not in stats:
            return None  # a step without pairs
        self.chosen.append(float(stats["logps/chosen"]))
        self.margin.append(float(stats["rewards/margins"]))
        if len(self.chosen) < self.window:
            return None
        (sc, tc), (sm, tm) = _trend(list(self.chosen)), _trend(list(self.margin))
        self.chosen.clear()  # the next window starts after this one
        self.margin.clear()
        fall = -sc * (self.window - 1)
        if not (tc <= -self.t and tm >= self.t and sm > 0 and fall >= self.min_drop):
            return None
        msg = (f"likelihood displacement: over the last {self.window} steps the chosen log-prob fell by "
               f"{fall:.3f} (fitted) while the margin grew by {sm * (self.window - 1):.3f}; DPO pushes the "
               "rejected responses down more than it lifts the chosen ones (try rpo_alpha, dpop_lambda, a "
               "larger beta, or on-policy pairs)")
        if self.warn:
            warnings.warn(msg, LikelihoodDisplacementWarning, stacklevel=2)
        self.fired += 1
        return msg

    def state_dict(self) -> dict:
        return {"chosen": list(self.chosen), "margin": list(self.margin), "fired": self.fired}

    def load_state_dict(self, state: dict) -> None:
        self.chosen.clear()
        self.margin.clear()
        self.chosen.extend(state["chosen"][-self.window:])
        self.margin.extend(state["margin"][-self.window:])
        self.fired = int(state["fired"])
