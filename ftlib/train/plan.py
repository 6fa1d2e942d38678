"""Step planning: how many optimizer steps an epoch and a run have, from the loader's length.

An optimizer step is one accumulation window of ``grad_accum`` micro-batches per rank, so with
``M`` micro-batches per epoch and rank (``len(loader)``, equal on every rank):

    steps_per_epoch = floor(M / grad_accum)
    total           = steps_per_epoch * epochs,   or max_steps when given

``max_steps`` overrides ``epochs`` (as ``max_steps`` does in Hugging Face's Trainer): a run of
``max_steps`` longer than the epochs give goes on into further epochs, each in a new order.

The ``M mod grad_accum`` micro-batches at an epoch's end would make a short window; they are not
trained (the next epoch draws a new order, so other units fall into the tail). Step ``s``
(counted from 0) is window ``s mod steps_per_epoch`` of epoch ``s // steps_per_epoch``; the
micro-batches it takes are ``[w * grad_accum, (w + 1) * grad_accum)`` of that epoch.

With ``G = batch_size x world_size`` units per micro-batch step (all ranks) and ``N`` units, a
``drop_last`` loader has ``M = floor(N / G)``, so ``steps_per_epoch = floor(N / (G x grad_accum))``:
the plan depends on the world size only through the global batch ``G x grad_accum`` (units per
optimizer step). That is what lets a run resume on another number of ranks exactly when the
global batch is kept (``ftlib.train.resume``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepPlan", "plan_steps"]


@dataclass(frozen=True)
class StepPlan:
    """``steps_per_epoch`` and ``total`` optimizer steps for ``grad_accum`` micro-batches a step."""

    steps_per_epoch: int
    total: int
    grad_accum: int

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, micro-batches of that epoch already consumed) after ``step`` optimizer steps."""
        epoch, window = divmod(step, self.steps_per_epoch)
        return epoch, window * self.grad_accum


def plan_steps(micro_batches: int, *, grad_accum: int, epochs: int, max_steps: int | None = None) -> StepPlan:
    """The step plan for ``micro_batches`` per epoch and rank; ``ValueError`` when not one step fits."""
    for name, v in (("grad_accum", grad_accum), ("epochs", epochs)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"plan_steps: {name} must be an int >= 1, got {v!r}")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"plan_steps: max_steps must be an int >= 1 or None, got {max_steps!r}")
    steps_per_epoch = micro_batches // grad_accum
    total = steps_per_epoch * epochs
    if max_steps is not None and steps_per_epoch >= 1:
        total = max_steps
    if total < 1:
        raise ValueError(f"not enough data for one optimizer step ({micro_batches} micro-batches per epoch and "
                         f"rank, grad_accum {grad_accum})")
    return StepPlan(steps_per_epoch=steps_per_epoch, total=total, grad_accum=grad_accum)
