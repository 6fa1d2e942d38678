"""GRPO: group-relative advantages and the clipped policy-gradient loss (with Dr. GRPO and DAPO variants).

Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath"). For each prompt, G
completions o_1..o_G are sampled from the rollout policy π_old and scored, r_i. Advantages:

    A_i = r_i - mean(r_group)                         scale_rewards = "none"  (Dr. GRPO, Liu et al. 2025)
    A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4)   "group"  (GRPO; std unbiased, as TRL)
    A_i = (r_i - mean(r_group)) / (std(r_batch) + 1e-4)   "batch"

NaN rewards (unscorable samples) are left out of the means and get A_i = 0. A group whose
rewards all agree (std = 0) teaches nothing; ``drop_zero_std=True`` drops it (DAPO's dynamic
sampling, Yu et al. 2025) and counts it (``frac_reward_zero_std``, TRL's name).

Loss, per completion token t of o_i (π_θ the policy being trained, log-probs at the sampling
temperature)::

    ρ_t   = exp(log π_θ(o_t) - log π_old(o_t))              (= 1 with gradient when μ = 1: π_old = sg(π_θ))
    ℓ_t   = -min(ρ_t A_i, clip(ρ_t, 1 - ε_low, 1 + ε_high) A_i) + β KL_t
    KL_t  = exp(log π_ref - log π_θ) - (log π_ref - log π_θ) - 1      (k3, Schulman 2020; β = 0: no term)

ε_high > ε_low is DAPO's clip-higher. μ ≥ 1 passes over one rollout batch: π_old is then the
log-probs taken once before the first update (``policy_logprobs`` under ``torch.no_grad()``).
The reference is the same model with its adapters disabled (``reference_logprobs``).

Aggregation over the completion tokens of a micro-batch of S sequences (``loss_type``, TRL's):

    grpo      mean_i ( sum_t ℓ_it / |o_i| )                 (sequence mean, then batch mean)
    bnpo      sum ℓ / sum |o_i|                             (token mean over the micro-batch)
    dr_grpo   sum ℓ / (S · max_completion_length)           (Dr. GRPO: a constant, no length bias)
    dapo      sum ℓ / num_items                             (token mean over the whole accumulation
                                                             window: pass its token count)

These equal TRL's ``GRPOTrainer`` loss and gradient (``importance_sampling_level="token"``,
no vLLM correction, no entropy mask) on the same batch; with gradient accumulation over k
micro-batches divide grpo/bnpo/dr_grpo by k as TRL does, and pass dapo the window's token count.

Tokens are laid out padding-free: ``policy_logprobs`` runs a packed batch (``pack_rollouts``)
and returns one log-prob per completion token (``ftlib.preference.token_logprobs``: the chunked
head, never [tokens, V] logits), with the local sequence of each token in ``batch["token_seq"]``.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..losses import head_weight
from ..preference import TokenLogprobs, token_logprobs

__all__ = [
    "Advantages", "GRPOConfig", "GRPOLossOutput", "LOSS_TYPES", "group_advantages", "grpo_loss", "policy_logprobs",
    "reference_logprobs",
]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
_SCALES = ("group", "batch", "none")
_LAYOUT = ("position_ids", "cu_seqlens", "max_seqlen", "attention_mask")


@dataclass(frozen=True)
class GRPOConfig:
    """The loss's settings (TRL's names and defaults, except ``loss_type``: DAPO's token mean)."""

    loss_type: str = "dapo"
    epsilon_low: float = 0.2  # TRL's ``epsilon``
    epsilon_high: float = 0.2  # DAPO: 0.28
    beta: float = 0.0  # KL coefficient; 0 skips the reference pass
    scale_rewards: str = "group"  # group | batch | none (Dr. GRPO)
    max_completion_length: int | None = None  # dr_grpo's constant
    temperature: float = 1.0  # the sampling temperature: log-probs are of softmax(z / T)

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.scale_rewards not in _SCALES:
            raise ValueError(f"scale_rewards must be one of {_SCALES}, got {self.scale_rewards!r}")
        if not (0 <= self.epsilon_low < 1 and self.epsilon_high >= 0):
            raise ValueError(f"need 0 <= epsilon_low < 1 and epsilon_high >= 0, got {self.epsilon_low}, "
                             f"{self.epsilon_high}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.loss_type == "dr_grpo" and not self.max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


# ---- advantages ----------------------------------------------------------------------------------
@dataclass
class Advantages:
    """``advantages`` [S] and ``keep`` [S] (False: a zero-variance group dropped), with counts in ``stats``."""

    advantages: torch.Tensor
    keep: torch.Tensor
    stats: dict


def _nanstd(x: torch.Tensor, dim=None) -> torch.Tensor:  # TRL's nanstd: unbiased, NaNs ignored
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    n = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    out = torch.sqrt(var * n / (n - 1))
    return out.squeeze(dim) if dim is not None else out.reshape(())


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale_rewards: str = "group",
                     drop_zero_std: bool = False) -> Advantages:
    """Group-relative advantages of ``rewards`` [S] (S = n_groups · group_size, groups consecutive)."""
    if scale_rewards not in _SCALES:
        raise ValueError(f"scale_rewards must be one of {_SCALES}, got {scale_rewards!r}")
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    if rewards.ndim != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [n_groups * group_size], got {tuple(rewards.shape)} with group_size "
                         f"{group_size}")
    g = rewards.view(-1, group_size)
    mean = torch.nanmean(g, dim=1).repeat_interleave(group_size)
    if group_size > 1:
        group_std = _nanstd(g, dim=1).repeat_interleave(group_size)
    else:
        group_std = torch.zeros_like(rewards)
    if scale_rewards == "batch":
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = group_std
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    adv = torch.nan_to_num(adv, nan=0.0)
    zero = torch.isclose(std, torch.zeros_like(std)) | torch.isnan(std)
    zero_group = torch.isclose(group_std, torch.zeros_like(group_std)) | torch.isnan(group_std)
    keep = ~zero_group if drop_zero_std else torch.ones_like(zero_group)
    stats = {"frac_reward_zero_std": float(zero.double().mean()),
             "groups_dropped": int((~keep).sum()) // group_size,
             "advantages/mean": float(adv.mean()), "advantages/std": float(adv.std()) if adv.numel() > 1 else 0.0,
             "advantages/abs_max": float(adv.abs().max()) if adv.numel() else 0.0,
             "unscorable": int(torch.isnan(rewards).sum())}
    return Advantages(adv, keep, stats)


# ---- log-probs -----------------------------------------------------------------------------------
def policy_logprobs(model, batch: dict, *, temperature: float = 1.0, entropy: bool = False,
                    chunk_size: int = 1024) -> TokenLogprobs:
    """Log-probs [N] of the completion tokens of a packed rollout batch through ``model`` (a
    ``LlamaForCausalLM``), in the order of ``batch["token_seq"]``; ``entropy=True`` adds each token's."""
    hidden = model.model(batch["input_ids"], **{k: batch[k] for k in _LAYOUT if k in batch})
    return token_logprobs(hidden, head_weight(model.lm_head), batch["labels"], cu_seqlens=batch.get("cu_seqlens"),
                          chunk_size=chunk_size, temperature=temperature, entropy=entropy)


@torch.no_grad()
def reference_logprobs(model, batch: dict, *, reference_model=None, temperature: float = 1.0, autocast=None,
                       chunk_size: int = 1024) -> torch.Tensor:
    """Reference log-probs [N] (no gradient): ``reference_model`` when given, else ``model`` with its
    adapters disabled (``ftlib.lora.disable_adapters``: no weight copied)."""
    ctx = autocast() if autocast is not None else nullcontext()
    if reference_model is not None:
        with ctx:
            return policy_logprobs(reference_model, batch, temperature=temperature, chunk_size=chunk_size).logp
    from ..lora import disable_adapters, lora_layers

    if not any(True for _ in lora_layers(model)):
        raise ValueError("reference_logprobs: the model has no adapters to disable; pass reference_model= (a frozen "
                         "copy of the starting model)")
    with disable_adapters(model), ctx:
        return policy_logprobs(model, batch, temperature=temperature, chunk_size=chunk_size).logp


# ---- loss ----------------------------------------------------------------------------------------
@dataclass
class GRPOLossOutput:
    """The micro-batch loss (scalar, with gradient) and its metrics (floats, TRL's names)."""

    loss: torch.Tensor
    stats: dict


def _seq_sum(x: torch.Tensor, seq: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, seq, x)


def grpo_loss(logps: torch.Tensor, advantages: torch.Tensor, token_seq: torch.Tensor, config: GRPOConfig, *,
              old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
              num_items: int | float | None = None, entropy: torch.Tensor | None = None) -> GRPOLossOutput:
    """The GRPO loss of one micro-batch (see the module docstring).

    logps [N]: the policy's log-probs of the N completion tokens (with gradient); advantages [S]
    per sequence of the micro-batch, in its order (``advantages[batch["sample_index"]]`` for a
    ``pack_rollouts`` batch); token_seq [N] int64: each token's sequence in [0, S); old_logps [N]: π_old (None:
    logps detached, μ = 1); ref_logps [N]: needed when beta > 0; num_items: dapo's normaliser
    (default N); entropy [N]: logged when given.
    """
    n_seqs = advantages.shape[0]
    if logps.ndim != 1 or token_seq.shape != logps.shape:
        raise ValueError(f"logps and token_seq must be [N], got {tuple(logps.shape)}, {tuple(token_seq.shape)}")
    if config.beta != 0.0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps (reference_logprobs)")
    old = logps.detach() if old_logps is None else old_logps.to(logps.dtype)
    adv = advantages.to(logps.dtype)[token_seq]  # (N,)
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - config.epsilon_low, 1 + config.epsilon_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if config.beta != 0.0:
        d = ref_logps.to(logps.dtype) - logps
        kl = torch.exp(d) - d - 1
        per_token = per_token + config.beta * kl
    count = _seq_sum(torch.ones_like(per_token), token_seq, n_seqs)  # (S,) tokens per sequence
    n_tok = per_token.numel()
    if config.loss_type == "grpo":
        loss = (_seq_sum(per_token, token_seq, n_seqs) / count.clamp(min=1.0)).mean()
    elif config.loss_type == "bnpo":
        loss = per_token.sum() / max(n_tok, 1)
    elif config.loss_type == "dr_grpo":
        loss = per_token.sum() / (n_seqs * config.max_completion_length)
    else:  # dapo
        loss = per_token.sum() / max(float(num_items if num_items is not None else n_tok), 1.0)

    with torch.no_grad():
        def mean(x):
            return float(x.double().mean()) if n_tok else 0.0

        low = ((coef_1 < 1 - config.epsilon_low) & (adv < 0)).double()
        high = ((coef_1 > 1 + config.epsilon_high) & (adv > 0)).double()
        has = count > 0
        stats = {"clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
                 "clip_ratio/region_mean": mean(torch.maximum(low, high)),
                 "clip_ratio/low_min": float((_seq_sum(low, token_seq, n_seqs)[has] / count[has]).min()) if n_tok else 0.0,
                 "clip_ratio/high_max": float((_seq_sum(high, token_seq, n_seqs)[has] / count[has]).max()) if n_tok else 0.0,
                 "ratio/mean": mean(coef_1), "loss": float(loss)}
        if config.beta != 0.0:
            stats["kl"] = mean(kl)
        if entropy is not None:
            stats["entropy"] = mean(entropy)
    return GRPOLossOutput(loss, stats)
