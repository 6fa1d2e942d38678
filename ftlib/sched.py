"""Learning-rate schedules as multipliers of each parameter group's base LR.

A schedule maps progress t (optimizer steps, or tokens seen, in the unit you choose for
``total`` and ``warmup``) to a factor f(t) in [0, 1]; :class:`LRScheduler` sets every group's
``lr = base_lr_of_group * f(t)``, so per-group multipliers (LoRA+, layer-wise LR) compose.
Driving t by tokens keeps warmup the same length in data when packing or variable batch sizes
change the number of tokens per step.

Closed forms (W = warmup, T = total, r = min_lr_ratio, p = progress through the decay phase):

- warmup:            f(t) = t / W                                         for t < W
- cosine decay:      f(t) = r + (1 - r) * (1 + cos(pi p)) / 2,   p = (t - W) / (T - W)
- linear decay:      f(t) = r + (1 - r) * (1 - p)
- constant:          f(t) = 1
- WSD (warmup-stable-decay; Hu et al. 2024 "MiniCPM", Hägele et al. 2024 "Scaling Laws and
  Compute-Optimal Training beyond Fixed Training Durations"): warmup, 1 until T - D, then a
  decay over the last D to r, shaped linear, cosine or ``1-sqrt`` (1 - sqrt(p)).
- cosine with warm restarts (SGDR, Loshchilov & Hutter 2017, arXiv:1608.03983): cycle i lasts
  T_i = T_0 * T_mult^i and starts at S_i = T_0 (T_mult^i - 1) / (T_mult - 1) (i T_0 for
  T_mult = 1); inside it, at tau = t - S_i, with peak P_i = max(r, gamma^i) (gamma = per-cycle
  peak decay) and an optional warm-up of w_i: f = s_i + (P_i - s_i) tau / w_i while tau < w_i
  (s_0 = 0, s_i = r after the first cycle), then f = r + (P_i - r) (1 + cos(pi p)) / 2 with
  p = (tau - w_i) / (T_i - w_i). Without warm-up and decay it is
  ``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts`` with eta_min = r * base_lr.

Warmup is given to the schedule, one way: ``warmup=W`` (in the unit of ``total``) or
``warmup_ratio=w`` (W = w T), not both; the schedule's ``.warmup`` is the length it resolved
(``WarmupDecay(total, warmup_ratio=0.03).warmup``). ``resolve_warmup`` is its deprecated spelling.

Past T every schedule holds its value at T; with W == T the decay phase is empty and the
factor stays at 1. Warmup and decay formulas are those of Hugging Face's
``get_cosine_with_min_lr_schedule_with_warmup`` / ``get_linear_schedule_with_warmup``.

Stateful schedules (``observe(loss, t)`` feeds them the training loss; ``state_dict()``):

- :class:`PlateauCosine`: warmup, hold at 1 until the training loss plateaus — the range
  max - min of the last ``window`` losses is below ``threshold`` for ``patience`` consecutive
  checks — or t reaches ``cap`` (with or without observed losses); the decay then starts at
  that t and is a cosine to r at T.
- :class:`ReduceOnPlateau`: multiply the factor by ``factor`` when a metric has not improved
  (relative ``threshold``) for ``patience`` observations, with a cooldown; the rule of
  ``torch.optim.lr_scheduler.ReduceLROnPlateau`` (mode="min", threshold_mode="rel").
"""

from __future__ import annotations

import math
import warnings
from collections import deque

import torch

__all__ = [
    "CosineRestarts",
    "LRScheduler",
    "PlateauCosine",
    "ReduceOnPlateau",
    "WSD",
    "WarmupDecay",
]

_DECAYS = ("cosine", "linear", "constant")
_WSD_SHAPES = ("linear", "cosine", "1-sqrt")


def _check_ratio(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def resolve_warmup(total: float, warmup: float | None = None, warmup_ratio: float | None = None) -> float:
    """Deprecated: give the schedule ``warmup=`` or ``warmup_ratio=`` itself and read its ``.warmup``.

    Kept one release for existing scripts; ``WarmupDecay(total, warmup_ratio=r).warmup`` is the same number."""
    warnings.warn("ftlib.sched.resolve_warmup is deprecated; pass warmup_ratio= (or warmup=) to the schedule "
                  "(WarmupDecay, WSD, PlateauCosine) and read its .warmup", DeprecationWarning, stacklevel=2)
    return _warmup_length(total, warmup, warmup_ratio)


def _warmup_length(total: float, warmup: float | None = None, warmup_ratio: float | None = None, *,
                   name: str = "warmup") -> float:
    """Warmup length in units of ``total``, from an absolute length or a ratio of ``total`` (one of them).

    ``name`` is the phase the length is for, as errors name it (WSD resolves its ``decay`` here too).
    """
    if not total > 0 or not math.isfinite(total):
        raise ValueError(f"total must be a finite number > 0, got {total}")
    if warmup is not None and warmup_ratio is not None:
        raise ValueError(f"give {name} or {name}_ratio, not both")
    if warmup_ratio is not None:
        warmup = _check_ratio(f"{name}_ratio", warmup_ratio) * total
    warmup = 0.0 if warmup is None else float(warmup)
    if warmup < 0:
        raise ValueError(f"{name} must be >= 0, got {warmup}")
    if warmup > total:
        raise ValueError(f"{name} ({warmup}) is longer than total ({total})")
    return warmup


def _decay(shape: str, p: float, r: float) -> float:
    """Decay from 1 at p = 0 to r at p = 1."""
    p = min(max(p, 0.0), 1.0)
    if shape == "cosine":
        return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * p))
    if shape == "linear":
        return r + (1.0 - r) * (1.0 - p)
    if shape == "1-sqrt":
        return r + (1.0 - r) * (1.0 - math.sqrt(p))
    return 1.0  # constant


class WarmupDecay:
    """Linear warmup, then cosine / linear / constant decay to ``min_lr_ratio`` at ``total``."""

    def __init__(
        self,
        total: float,
        *,
        warmup: float | None = None,
        warmup_ratio: float | None = None,
        decay: str = "cosine",
        min_lr_ratio: float = 0.0,
    ):
        if decay not in _DECAYS:
            raise ValueError(f"unknown schedule {decay!r}; choose one of {', '.join(_DECAYS)}")
        self.warmup = _warmup_length(total, warmup, warmup_ratio)
        self.total, self.decay = float(total), decay
        self.min_lr_ratio = _check_ratio("min_lr_ratio", min_lr_ratio)

    def __call__(self, t: float) -> float:
        t = min(max(float(t), 0.0), self.total)
        if t < self.warmup:
            return t / self.warmup
        if self.total == self.warmup:
            return 1.0
        return _decay(self.decay, (t - self.warmup) / (self.total - self.warmup), self.min_lr_ratio)


class WSD:
    """Warmup-stable-decay: warmup, hold at 1, decay over the last ``decay`` (or ``decay_ratio``)."""

    def __init__(
        self,
        total: float,
        *,
        warmup: float | None = None,
        warmup_ratio: float | None = None,
        decay: float | None = None,
        decay_ratio: float | None = 0.1,
        shape: str = "1-sqrt",
        min_lr_ratio: float = 0.0,
    ):
        if shape not in _WSD_SHAPES:
            raise ValueError(f"unknown WSD decay shape {shape!r}; choose one of {', '.join(_WSD_SHAPES)}")
        self.warmup = _warmup_length(total, warmup, warmup_ratio)
        self.total, self.shape = float(total), shape
        if decay is not None:
            decay_ratio = None
        self.decay_len = _warmup_length(total, decay, decay_ratio, name="decay")  # same checks: 0 <= D <= T
        if self.warmup + self.decay_len > self.total:
            raise ValueError(f"warmup ({self.warmup}) + decay ({self.decay_len}) exceed total ({self.total})")
        self.min_lr_ratio = _check_ratio("min_lr_ratio", min_lr_ratio)

    def __call__(self, t: float) -> float:
        t = min(max(float(t), 0.0), self.total)
        if t < self.warmup:
            return t / self.warmup
        start = self.total - self.decay_len
        if t <= start or self.decay_len == 0:
            return 1.0
        return _decay(self.shape, (t - start) / self.decay_len, self.min_lr_ratio)


class CosineRestarts:
    """Cosine annealing with warm restarts (SGDR): cycles of length ``T_0 * T_mult^i``.

    ``T_0``: first cycle length (> 0) in the unit of t (steps or tokens); ``T_mult >= 1``: growth
    of each cycle; ``min_lr_ratio``: r, the floor of every cycle (torch's ``eta_min = r * base_lr``);
    ``peak_decay``: gamma in (0, 1], the peak of cycle i is ``max(r, gamma^i)``; ``warmup`` (same
    length every cycle) or ``warmup_ratio`` (a fraction of each cycle): a linear ramp at the start
    of each cycle, from 0 in the first and from r in the later ones, so that restarts do not jump.
    The schedule never ends: past any horizon it keeps cycling. Closed form in the module docstring.
    """

    def __init__(
        self,
        T_0: float,
        *,
        T_mult: float = 1.0,
        min_lr_ratio: float = 0.0,
        peak_decay: float = 1.0,
        warmup: float | None = None,
        warmup_ratio: float | None = None,
    ):
        T_0, T_mult = float(T_0), float(T_mult)
        if not (math.isfinite(T_0) and T_0 > 0):
            raise ValueError(f"T_0 must be a finite number > 0, got {T_0}")
        if not (math.isfinite(T_mult) and T_mult >= 1.0):
            raise ValueError(f"T_mult must be a finite number >= 1 (cycles never shrink), got {T_mult}")
        if not 0.0 < float(peak_decay) <= 1.0:
            raise ValueError(f"peak_decay must be in (0, 1], got {peak_decay}")
        if warmup is not None and warmup_ratio is not None:
            raise ValueError("give warmup or warmup_ratio, not both")
        if warmup is not None and not 0.0 <= float(warmup) < T_0:
            raise ValueError(f"warmup must be in [0, T_0={T_0}) so that every cycle decays, got {warmup}")
        if warmup_ratio is not None and not 0.0 <= float(warmup_ratio) < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}")
        self.T_0, self.T_mult, self.peak_decay = T_0, T_mult, float(peak_decay)
        self.warmup = None if warmup is None else float(warmup)
        self.warmup_ratio = None if warmup_ratio is None else float(warmup_ratio)
        self.min_lr_ratio = _check_ratio("min_lr_ratio", min_lr_ratio)

    def cycle(self, t: float) -> tuple[int, float, float]:
        """(cycle index i, position tau in the cycle, cycle length T_i) at progress t >= 0."""
        t = max(float(t), 0.0)
        if self.T_mult == 1.0:
            i = math.floor(t / self.T_0)
            tau = t - i * self.T_0
            if tau >= self.T_0:  # rounding of t / T_0 just below an integer
                i, tau = i + 1, tau - self.T_0
            return i, max(tau, 0.0), self.T_0
        i, start, length = 0, 0.0, self.T_0  # O(log t) iterations: lengths grow geometrically
        while t >= start + length:
            i, start, length = i + 1, start + length, length * self.T_mult
        return i, t - start, length

    def __call__(self, t: float) -> float:
        i, tau, length = self.cycle(t)
        r = self.min_lr_ratio
        peak = max(r, self.peak_decay**i)
        w = self.warmup if self.warmup is not None else (self.warmup_ratio or 0.0) * length
        if tau < w:
            start = 0.0 if i == 0 else r
            return start + (peak - start) * tau / w
        p = (tau - w) / (length - w)
        return r + (peak - r) * 0.5 * (1.0 + math.cos(math.pi * p))


class PlateauCosine:
    """Warmup, hold at peak until the loss plateaus (or ``cap``), then cosine to ``min_lr_ratio``.

    A check happens at every ``observe`` after warmup once ``window`` losses are held: it passes
    when max - min of the last ``window`` losses is below ``threshold``. The decay starts at the
    progress t of the observation where the ``patience``-th consecutive pass happens, and at
    ``cap`` at the latest (``cap`` defaults to ``total``) whether or not losses are observed, so a
    loop that feeds no loss (or only non-finite ones) still decays from ``cap``.
    """

    def __init__(
        self,
        total: float,
        *,
        warmup: float | None = None,
        warmup_ratio: float | None = None,
        window: int = 50,
        threshold: float = 0.05,
        patience: int = 3,
        cap: float | None = None,
        min_lr_ratio: float = 0.0,
    ):
        self.warmup = _warmup_length(total, warmup, warmup_ratio)
        self.total = float(total)
        if window < 2:
            raise ValueError(f"window must be >= 2 losses, got {window}")
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0, got {threshold}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        cap = self.total if cap is None else float(cap)
        if not self.warmup <= cap <= self.total:
            raise ValueError(f"cap ({cap}) must lie between warmup ({self.warmup}) and total ({self.total})")
        self.window, self.threshold, self.patience, self.cap = int(window), float(threshold), int(patience), cap
        self.min_lr_ratio = _check_ratio("min_lr_ratio", min_lr_ratio)
        self.losses: deque[float] = deque(maxlen=self.window)
        self.passes = 0
        self.decay_start: float | None = None

    def observe(self, loss: float, t: float) -> None:
        """Record the training loss measured at progress ``t``."""
        loss = float(loss)
        if not math.isfinite(loss):
            return  # a skipped (non-finite) step says nothing about the plateau
        self.losses.append(loss)
        if self.decay_start is not None or t < self.warmup:
            return
        if len(self.losses) == self.window:
            self.passes = self.passes + 1 if max(self.losses) - min(self.losses) < self.threshold else 0
        if self.passes >= self.patience or t >= self.cap:
            # past the cap the factor has been decaying from cap already (see __call__)
            self.decay_start = min(float(t), self.cap)

    def __call__(self, t: float) -> float:
        t = min(max(float(t), 0.0), self.total)
        if t < self.warmup:
            return t / self.warmup
        start = self.cap if self.decay_start is None else self.decay_start  # the cap bounds the hold
        if t <= start:
            return 1.0
        span = self.total - start
        return _decay("cosine", (t - start) / span, self.min_lr_ratio) if span > 0 else 1.0

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "passes": self.passes, "decay_start": self.decay_start}

    def load_state_dict(self, state: dict) -> None:
        self.losses = deque((float(x) for x in state["losses"]), maxlen=self.window)
        self.passes = int(state["passes"])
        self.decay_start = None if state["decay_start"] is None else float(state["decay_start"])


class ReduceOnPlateau:
    """Multiply the factor by ``factor`` after ``patience`` observations without relative improvement."""

    def __init__(
        self,
        *,
        factor: float = 0.1,
        patience: int = 10,
        threshold: float = 1e-4,
        cooldown: int = 0,
        min_lr_ratio: float = 0.0,
    ):
        if not 0.0 < factor < 1.0:
            raise ValueError(f"factor must be in (0, 1), got {factor}")
        if patience < 0 or cooldown < 0:
            raise ValueError(f"patience and cooldown must be >= 0, got {patience}, {cooldown}")
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        self.factor, self.patience, self.threshold, self.cooldown = float(factor), int(patience), float(threshold), int(cooldown)
        self.min_lr_ratio = _check_ratio("min_lr_ratio", min_lr_ratio)
        self.scale, self.best, self.bad, self.cooldown_left = 1.0, math.inf, 0, 0

    def observe(self, metric: float, t: float | None = None) -> None:
        metric = float(metric)
        if metric < self.best * (1.0 - self.threshold):
            self.best, self.bad = metric, 0
        else:
            self.bad += 1
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self.bad = 0
        if self.bad > self.patience:
            self.scale = max(self.scale * self.factor, self.min_lr_ratio)
            self.cooldown_left, self.bad = self.cooldown, 0

    def __call__(self, t: float) -> float:
        return self.scale

    def state_dict(self) -> dict:
        return {"scale": self.scale, "best": self.best, "bad": self.bad, "cooldown_left": self.cooldown_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.best = float(state["scale"]), float(state["best"])
        self.bad, self.cooldown_left = int(state["bad"]), int(state["cooldown_left"])


class LRScheduler:
    """Apply a schedule to a ``torch.optim`` optimizer: ``lr = base_lr * schedule(t)`` per group.

    Base LRs are the groups' ``lr`` at construction (so a LoRA+ group at 16x keeps 16x). Call
    ``step()`` after each optimizer step: it advances t by ``amount`` (1 for step-driven, the
    step's token count for token-driven schedules), feeds ``loss`` to stateful schedules and
    sets the LR for the next step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule, *, progress: float = 0.0):
        self.optimizer, self.schedule = optimizer, schedule
        self.base_lrs = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        for lr in self.base_lrs:
            if lr < 0 or not math.isfinite(lr):
                raise ValueError(f"learning rate must be finite and >= 0, got {lr}")
        for g, lr in zip(optimizer.param_groups, self.base_lrs):
            g["initial_lr"] = lr
        self.progress = float(progress)
        if not (math.isfinite(self.progress) and self.progress >= 0):
            raise ValueError(f"progress must be finite and >= 0, got {progress}")
        self._apply()

    def factor(self) -> float:
        return float(self.schedule(self.progress))

    def _apply(self) -> None:
        f = self.factor()
        for g, lr in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = lr * f

    def step(self, amount: float = 1.0, loss: float | None = None) -> None:
        if not math.isfinite(amount):  # NaN would make every later LR NaN
            raise ValueError(f"amount must be finite, got {amount}")
        if amount < 0:
            raise ValueError(f"progress can only move forward, got amount={amount}")
        self.progress += float(amount)
        if loss is not None and hasattr(self.schedule, "observe"):
            self.schedule.observe(loss, self.progress)
        self._apply()

    def observe(self, metric: float) -> None:
        """Feed a metric measured between steps (e.g. eval loss for ReduceOnPlateau) and re-apply."""
        if not hasattr(self.schedule, "observe"):
            raise TypeError(f"{type(self.schedule).__name__} is a closed-form schedule: it observes nothing")
        self.schedule.observe(metric, self.progress)
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        state = {"progress": self.progress, "base_lrs": list(self.base_lrs)}
        if hasattr(self.schedule, "state_dict"):
            state["schedule"] = self.schedule.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if len(state["base_lrs"]) != len(self.base_lrs):
            raise ValueError(
                f"scheduler state has {len(state['base_lrs'])} param groups, optimizer has {len(self.base_lrs)}"
            )
        self.progress, self.base_lrs = float(state["progress"]), [float(x) for x in state["base_lrs"]]
        if "schedule" in state:
            self.schedule.load_state_dict(state["schedule"])
        self._apply()
