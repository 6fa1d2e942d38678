"""ftlib.train.plan: optimizer steps per epoch and in all; the plan depends on the world size only
through the global batch."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.train import StepPlan, plan_steps


def test_plan_counts_whole_windows_and_max_steps_overrides_epochs():
    assert plan_steps(10, grad_accum=3, epochs=2) == StepPlan(steps_per_epoch=3, total=6, grad_accum=3)
    assert plan_steps(10, grad_accum=3, epochs=2, max_steps=4).total == 4
    # as in HF Trainer: max_steps wins over epochs, also when it asks for more steps than they give
    assert plan_steps(10, grad_accum=3, epochs=2, max_steps=100).total == 100
    assert plan_steps(10, grad_accum=3, epochs=1, max_steps=7).position(7) == (2, 3)
    assert plan_steps(10, grad_accum=3, epochs=1).position(4) == (1, 3)  # epoch 1, after its first window


def test_plan_refuses_no_step_and_bad_values():
    with pytest.raises(ValueError, match="not enough data for one optimizer step .*2 micro-batches.*grad_accum 3"):
        plan_steps(2, grad_accum=3, epochs=5)
    for kw in ({"grad_accum": 0, "epochs": 1}, {"grad_accum": 1, "epochs": 0}, {"grad_accum": 1.5, "epochs": 1},
               {"grad_accum": 1, "epochs": 1, "max_steps": 0}, {"grad_accum": True, "epochs": 1}):
        with pytest.raises(ValueError):
            plan_steps(10, **kw)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), b=st.integers(1, 8), w=st.integers(1, 8), a=st.integers(1, 8), w2=st.integers(1, 8))
def test_steps_per_epoch_depend_only_on_the_global_batch(n, b, w, a, w2):
    """floor(floor(N / (B W)) / A) = floor(N / (B W A)): ranks and accumulation trade freely at a fixed
    global batch, which is what lets a run resume exactly on another number of ranks."""
    u = b * w * a
    if n < u:
        return
    one = plan_steps(n // (b * w), grad_accum=a, epochs=1)
    assert one.steps_per_epoch == n // u
    if u % (b * w2) == 0:  # the same global batch on w2 ranks
        other = plan_steps(n // (b * w2), grad_accum=u // (b * w2), epochs=1)
        assert other.steps_per_epoch == one.steps_per_epoch
