"""Early stopping on the held-out loss: patience counted in evaluations, state saved in checkpoints.

After each evaluation with held-out loss ``L``:

    improved  <=>  best is None  or  L < best - min_delta      (then best = L, bad = 0; else bad += 1)
    stopped   <=>  bad >= patience

``min_delta`` is the least decrease that counts as an improvement (absolute, in loss units). The
state (``best``, ``bad``, ``stopped``) is a JSON dict, saved with every checkpoint, so a resumed run
neither forgets its patience nor undoes a stop. Reference: Prechelt, "Early Stopping - But When?"
(1998), the "no improvement in ``patience`` successive evaluations" criterion.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["EarlyStop"]


@dataclass
class EarlyStop:
    """``patience`` evaluations without an improvement of more than ``min_delta`` stop the run (0: never)."""

    patience: int = 0
    min_delta: float = 0.0
    best: float | None = None
    bad: int = 0
    stopped: bool = False

    def __post_init__(self):
        if self.patience < 0:
            raise ValueError(f"EarlyStop: patience must be >= 0 evaluations, got {self.patience}")
        if self.min_delta < 0:
            raise ValueError(f"EarlyStop: min_delta must be >= 0, got {self.min_delta}")

    def update(self, loss: float) -> bool:
        """Count the evaluation that measured ``loss``; True when the run should stop now."""
        if not self.patience:
            return False
        if self.best is None or loss < self.best - self.min_delta:
            self.best, self.bad = float(loss), 0
        else:
            self.bad += 1
        self.stopped = self.stopped or self.bad >= self.patience
        return self.stopped

    def state_dict(self) -> dict:
        """``{"best", "bad", "stopped"}``: what a checkpoint keeps (the settings come from the flags)."""
        return {k: v for k, v in asdict(self).items() if k in ("best", "bad", "stopped")}

    def load_state_dict(self, state: dict) -> None:
        """The counters of ``state_dict()`` back; an unknown key is an error (not dropped)."""
        unknown = set(state) - {"best", "bad", "stopped"}
        if unknown:
            raise ValueError(f"EarlyStop.load_state_dict: unknown keys {sorted(unknown)}")
        self.best = state.get("best", self.best)
        self.bad = int(state.get("bad", self.bad))
        self.stopped = bool(state.get("stopped", self.stopped))
