"""KTO: preference tuning from unpaired good / bad examples (Ethayarajh et al. 2024, "KTO").

Data: TRL's unpaired format, one record per example: ``{"prompt": x, "completion": y, "label":
true|false}`` (desirable or not). With π, ρ the summed completion log-probs under the policy and
the reference (adapters disabled)::

    z0   = max(0, mean_j (π(y'_j | x_j) - ρ(y'_j | x_j)))     the reference-KL baseline, no gradient,
           on mismatched pairs: completions rotated by one in the batch, (x_j, y_{j-1})
    desirable     ℓ = λ_D (1 - σ(β (π - ρ - z0)))
    undesirable   ℓ = λ_U (1 - σ(β (z0 - (π - ρ))))
    loss = mean over the batch

(``loss_type="apo_zero_unpaired"``: 1 - σ(β (π - ρ)) and σ(β (π - ρ)), no baseline.) λ_D, λ_U are
``desirable_weight`` / ``undesirable_weight``; the paper advises λ_D n_D / (λ_U n_U) in [1, 4/3].
Equal to TRL's ``KTOTrainer`` loss on the same batch (``kto_loss``), with TRL's metric names.

Layout: ``pack_kto`` puts the B matched documents and the B mismatched ones in one packed row
(``position_ids`` / ``cu_seqlens``, no padding, labels on completion tokens); ``kto_logps`` runs it
once and returns the summed log-probs of both halves, the mismatched half detached (TRL computes
it under ``no_grad``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..losses import head_weight
from ..preference import sequence_logprobs

__all__ = ["KTOConfig", "KTOOutput", "check_kto_records", "kto_logps", "kto_loss", "pack_kto", "reference_kto_logps"]

_KINDS = ("kto", "apo_zero_unpaired")


@dataclass(frozen=True)
class KTOConfig:
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_type: str = "kto"

    def __post_init__(self):
        if self.loss_type not in _KINDS:
            raise ValueError(f"loss_type must be one of {_KINDS}, got {self.loss_type!r}")
        if not self.beta > 0 or self.desirable_weight < 0 or self.undesirable_weight < 0:
            raise ValueError("need beta > 0 and non-negative weights")


def check_kto_records(records: Sequence[dict]) -> None:
    """Raise a ValueError naming the record and field when ``records`` are not TRL's unpaired format."""
    for i, r in enumerate(records):
        for k in ("prompt", "completion", "label"):
            if k not in r:
                raise ValueError(f"KTO record {i}: missing field {k!r} (the unpaired format is prompt, completion, "
                                 "label)")
        if not isinstance(r["label"], bool):
            raise ValueError(f"KTO record {i}: 'label' must be true or false, got {r['label']!r}")


def pack_kto(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], labels: Sequence[bool], *,
             kl: bool = True, device=None) -> dict:
    """One packed row: the B documents x_i + y_i, then (``kl``) the B mismatched x_i + y_{i-1}."""
    b = len(prompt_ids)
    if b == 0 or len(completion_ids) != b or len(labels) != b:
        raise ValueError("pack_kto: need as many prompts, completions and labels, at least one")
    docs = [(list(p), list(c)) for p, c in zip(prompt_ids, completion_ids)]
    if kl:
        docs += [(list(prompt_ids[i]), list(completion_ids[i - 1])) for i in range(b)]  # TRL: rotate by one
    ids, lab, pos, cu = [], [], [], [0]
    for p, c in docs:
        if not p or not c:
            raise ValueError("pack_kto: empty prompt or completion")
        ids += p + c
        lab += [-100] * len(p) + c
        pos += list(range(len(p) + len(c)))
        cu.append(len(ids))
    return {"input_ids": torch.tensor([ids], device=device), "labels": torch.tensor([lab], device=device),
            "position_ids": torch.tensor([pos], device=device),
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32, device=device),
            "max_seqlen": max(len(p) + len(c) for p, c in docs),
            "label": torch.tensor(list(labels), dtype=torch.bool, device=device), "n_examples": b}


def kto_logps(model, batch: dict, *, chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed completion log-probs [B] of the matched documents, and [B] of the mismatched ones (detached)."""
    hidden = model.model(batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"],
                         max_seqlen=batch["max_seqlen"])
    s = sequence_logprobs(hidden, head_weight(model.lm_head), batch["labels"], cu_seqlens=batch["cu_seqlens"],
                          chunk_size=chunk_size).sum
    b = batch["n_examples"]
    return s[:b], (s[b : 2 * b].detach() if s.numel() > b else None)  # documents after 2B: fillers


@torch.no_grad()
def reference_kto_logps(model, batch: dict, *, reference_model=None, autocast=None, chunk_size: int = 1024):
    """``kto_logps`` of the reference: ``reference_model``, else ``model`` with its adapters disabled."""
    ctx = autocast() if autocast is not None else nullcontext()
    if reference_model is not None:
        with ctx:
            return kto_logps(reference_model, batch, chunk_size=chunk_size)
    from ..lora import disable_adapters

    with disable_adapters(model), ctx:
        return kto_logps(model, batch, chunk_size=chunk_size)


@dataclass
class KTOOutput:
    loss: torch.Tensor  # scalar: the mean of ``losses``
    losses: torch.Tensor  # [B] per example, in batch order
    kl: torch.Tensor  # the baseline z0
    stats: dict


def kto_loss(policy_logps: torch.Tensor, reference_logps: torch.Tensor, labels: torch.Tensor, config: KTOConfig, *,
             policy_kl_logps: torch.Tensor | None = None, reference_kl_logps: torch.Tensor | None = None) -> KTOOutput:
    """The KTO loss of a batch (see the module docstring); ``*_kl_logps`` are the mismatched pairs' sums."""
    labels = torch.as_tensor(labels, dtype=torch.bool, device=policy_logps.device)
    if config.loss_type == "kto":
        if policy_kl_logps is None or reference_kl_logps is None:
            raise ValueError("loss_type='kto' needs policy_kl_logps and reference_kl_logps (pack_kto(kl=True))")
        kl = (policy_kl_logps - reference_kl_logps).mean().detach().clamp(min=0)
    else:
        kl = torch.zeros((), dtype=policy_logps.dtype, device=policy_logps.device)
    logratio = policy_logps - reference_logps.to(policy_logps.dtype)
    if config.loss_type == "kto":
        good = 1 - F.sigmoid(config.beta * (logratio - kl))
        bad = 1 - F.sigmoid(config.beta * (kl - logratio))
    else:
        good = 1 - F.sigmoid(config.beta * logratio)
        bad = F.sigmoid(config.beta * logratio)
    losses = torch.where(labels, config.desirable_weight * good, config.undesirable_weight * bad)
    loss = losses.mean()
    with torch.no_grad():
        rewards = config.beta * logratio
        stats = {"kl": float(kl), "loss": float(loss)}
        for name, m in (("chosen", labels), ("rejected", ~labels)):
            if bool(m.any()):
                stats[f"rewards/{name}"] = float(rewards[m].mean())
                stats[f"logps/{name}"] = float(policy_logps[m].mean())
        if bool(labels.any()) and bool((~labels).any()):
            stats["rewards/margins"] = stats["rewards/chosen"] - stats["rewards/rejected"]
    return KTOOutput(loss, losses, kl, stats)
