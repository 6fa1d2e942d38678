"""The DPO family of preference losses, per pair, and the guards against likelihood displacement.

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
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .logprobs import PairLogps

__all__ = ["LOSS_KINDS", "PreferenceLoss", "PreferenceOutput", "dpo_sigmoid_loss", "dpop_penalty", "hinge_loss", "ipo_loss", "orpo_loss", "robust_dpo_loss", "rpo_nll", "simpo_loss"]


LOSS_KINDS = ("sigmoid", "robust", "ipo", "hinge", "simpo", "orpo")
_REFERENCE_FREE = ("simpo", "orpo")


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
