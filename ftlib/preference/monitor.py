"""A watch for likelihood displacement during preference tuning (DPO can widen the margin while the
chosen responses' likelihood falls too: Razin et al. 2024, "Unintentional unalignment"; Pal et al.
2024, "Smaug").

``LikelihoodDisplacementMonitor`` watches the logged means (``PreferenceOutput.stats()``, TRL's names
``logps/chosen``, ``rewards/margins``, ...) and warns when the chosen log-probs fall steadily while
the margin grows.
"""

from __future__ import annotations

import math
import warnings
from collections import deque

__all__ = ["LikelihoodDisplacementMonitor", "LikelihoodDisplacementWarning"]


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
