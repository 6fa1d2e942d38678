"""Cosine with warm restarts (SGDR): equality with torch, cycle boundaries, warm-up, peak decay."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.sched import CosineRestarts, LRScheduler


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 4), st.sampled_from([0.0, 0.1, 0.37]), st.sampled_from([1.0, 3e-4]))
def test_equals_torch_cosine_annealing_warm_restarts(T_0, T_mult, r, base_lr):
    """Invariant: without warm-up or peak decay, every step's LR equals torch's
    CosineAnnealingWarmRestarts (eta_min = r * base_lr) over at least four cycles."""
    p = torch.nn.Parameter(torch.zeros(1))
    ours_opt, ref_opt = torch.optim.SGD([p], lr=base_lr), torch.optim.SGD([p], lr=base_lr)
    ours = LRScheduler(ours_opt, CosineRestarts(T_0, T_mult=T_mult, min_lr_ratio=r))
    ref = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(ref_opt, T_0=T_0, T_mult=T_mult, eta_min=r * base_lr)
    n = T_0 * (1 + T_mult + T_mult**2 + T_mult**3) + 3  # four cycles and into the fifth
    for step in range(min(n, 3000)):
        assert ours.get_last_lr()[0] == pytest.approx(ref.get_last_lr()[0], rel=1e-12, abs=1e-15), step
        ours_opt.step(), ref_opt.step()
        ours.step(), ref.step()


@settings(max_examples=40, deadline=None)
@given(st.floats(0.5, 50.0), st.floats(1.0, 3.0), st.floats(0.0, 0.5), st.floats(0.3, 1.0),
       st.sampled_from([None, 0.0, 0.2, 0.45]))
def test_bounds_restarts_and_continuity(T_0, T_mult, r, gamma, warmup_ratio):
    """Invariants: r <= f <= peak_i inside cycle i (0 <= f during the first warm-up); f jumps up only at a
    cycle start, to peak_i without warm-up or to r with one (continuous from the previous cycle's end)."""
    s = CosineRestarts(T_0, T_mult=T_mult, min_lr_ratio=r, peak_decay=gamma, warmup_ratio=warmup_ratio)
    starts, start, length = [], 0.0, T_0
    for _ in range(5):
        starts.append(start)
        start, length = start + length, length * T_mult
    for i, st_i in enumerate(starts[1:], start=1):
        peak = max(r, gamma**i)
        at_start = s(st_i + 1e-9 * T_0)  # just past the boundary (a float sum of cycle lengths)
        assert at_start == pytest.approx(r if warmup_ratio else peak, abs=1e-6)
        before = s(st_i - 1e-9 * T_0)  # the end of the previous cycle: the floor
        assert before == pytest.approx(r, abs=1e-6)
    ts = [starts[-1] * k / 2000 for k in range(2001)]
    for a, b in zip(ts, ts[1:]):
        i, _, _ = s.cycle(b)
        f = s(b)
        lo = 0.0 if i == 0 else r
        assert lo - 1e-12 <= f <= max(r, gamma**i) + 1e-12
        if f > s(a) + 1e-9 and not warmup_ratio:  # without warm-up f only rises at a restart
            assert s.cycle(a)[0] < i


def test_warmup_then_cosine_in_each_cycle():
    """Closed form at chosen points: T_0 = 10, T_mult = 2, warm-up of 2 per cycle, peak decay 0.5, r = 0.1."""
    s = CosineRestarts(10, T_mult=2, min_lr_ratio=0.1, peak_decay=0.5, warmup=2)
    assert s(0) == 0.0 and s(1) == pytest.approx(0.5) and s(2) == pytest.approx(1.0)
    assert s(6) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the first cosine (2 + 8 / 2)
    assert s.cycle(10) == (1, 0.0, 20.0) and s(10) == pytest.approx(0.1)  # second cycle starts at r
    assert s(11) == pytest.approx(0.1 + (0.5 - 0.1) / 2) and s(12) == pytest.approx(0.5)  # peak 0.5
    assert s(12 + 9) == pytest.approx(0.1 + 0.4 * 0.5)
    assert s.cycle(30) == (2, 0.0, 40.0) and s(32) == pytest.approx(0.25)


def test_token_driven_cycles_count_tokens():
    p = torch.nn.Parameter(torch.zeros(1))
    sched = LRScheduler(torch.optim.SGD([p], lr=1.0), CosineRestarts(1000))
    sched.step(amount=500)
    assert sched.get_last_lr()[0] == pytest.approx(0.5)
    sched.step(amount=500)
    assert sched.get_last_lr()[0] == pytest.approx(1.0)  # restart after 1000 tokens
    assert CosineRestarts(1000).cycle(10**12 + 250) == (10**9, 250.0, 1000.0)


def test_state_round_trip_continues_the_cycle():
    p = torch.nn.Parameter(torch.zeros(1))
    a = LRScheduler(torch.optim.SGD([p], lr=1.0), CosineRestarts(7, T_mult=2, min_lr_ratio=0.05))
    for _ in range(12):
        a.step()
    b = LRScheduler(torch.optim.SGD([p], lr=1.0), CosineRestarts(7, T_mult=2, min_lr_ratio=0.05))
    b.load_state_dict(a.state_dict())
    for _ in range(30):
        a.step(), b.step()
        assert a.get_last_lr() == b.get_last_lr()


@pytest.mark.parametrize("kw, msg", [
    (dict(T_0=0), "T_0 must be"), (dict(T_0=math.inf), "T_0 must be"), (dict(T_0=5, T_mult=0.5), "T_mult must be"),
    (dict(T_0=5, peak_decay=0.0), "peak_decay"), (dict(T_0=5, warmup=5), "warmup must be in"),
    (dict(T_0=5, warmup_ratio=1.0), "warmup_ratio"), (dict(T_0=5, warmup=1, warmup_ratio=0.1), "not both"),
    (dict(T_0=5, min_lr_ratio=1.5), "min_lr_ratio"),
])
def test_bad_config_raises(kw, msg):
    with pytest.raises(ValueError, match=msg):
        CosineRestarts(**kw)
