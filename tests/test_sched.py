"""LR schedules: bounds, continuity, monotonicity, edge cases, plateau logic, state round trips."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ftlib.sched import WSD, LRScheduler, PlateauCosine, ReduceOnPlateau, WarmupDecay

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def closed_form(draw):
    total = draw(st.integers(1, 5000))
    warmup = draw(st.integers(0, total))
    r = draw(st.sampled_from([0.0, 0.1, draw(st.floats(0.0, 1.0))]))
    if draw(st.booleans()):
        return WarmupDecay(total, warmup=warmup, decay=draw(st.sampled_from(["cosine", "linear", "constant"])),
                           min_lr_ratio=r)
    decay = draw(st.integers(0, total - warmup))
    return WSD(total, warmup=warmup, decay=decay, shape=draw(st.sampled_from(["linear", "cosine", "1-sqrt"])),
               min_lr_ratio=r)


def phases(s):
    """Boundaries between monotone phases: [0, W] rises, [W, T] (never rises), beyond T flat."""
    return [0.0, s.warmup, s.total]


def grid(s, n=300):
    ts = [s.total * i / n for i in range(n + 1)] + [s.warmup, s.total, s.total * 1.5 + 3]
    if isinstance(s, WSD):
        ts.append(s.total - s.decay_len)
    return sorted(ts)


@SETTINGS
@given(closed_form())
def test_lr_within_min_and_peak(s):
    """Invariant: 0 <= f(t) <= 1 everywhere; after warmup min_lr_ratio <= f(t) <= 1."""
    for t in grid(s):
        f = s(t)
        assert 0.0 <= f <= 1.0 + 1e-12
        if t >= s.warmup:
            assert s.min_lr_ratio - 1e-12 <= f


@SETTINGS
@given(closed_form())
def test_monotone_within_each_phase(s):
    """Invariant: f rises during warmup and never rises afterwards (decay phases, holding past T)."""
    ts = grid(s)
    warm = [s(t) for t in ts if t <= s.warmup]
    after = [s(t) for t in ts if t >= s.warmup]
    assert all(a <= b + 1e-12 for a, b in zip(warm, warm[1:]))
    assert all(a + 1e-12 >= b for a, b in zip(after, after[1:]))


@SETTINGS
@given(closed_form())
def test_continuous_at_phase_boundaries(s):
    """Invariant: f has no jump at warmup end, decay start (WSD) or total: f(b - d) -> f(b + d)."""
    bounds = [s.warmup, s.total] + ([s.total - s.decay_len] if isinstance(s, WSD) else [])
    # 1-sqrt has an infinite slope at its start: |jump| ~ sqrt(d / decay length), so d is taken
    # relative to the shortest phase (a 1-step decay in a 5000-step run would otherwise jump 7e-5)
    lengths = [s.warmup, s.total - s.warmup] + ([s.decay_len] if isinstance(s, WSD) else [])
    d = 1e-12 * min([x for x in lengths if x > 0], default=s.total)
    for b in bounds:
        assert abs(s(max(b - d, 0.0)) - s(b + d)) < 1e-5
        assert abs(s(b) - s(b + d)) < 1e-5


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_warmup_edge_cases(decay):
    # no warmup: the first step is at peak
    assert WarmupDecay(10, warmup=0, decay=decay)(0) == 1.0
    # warmup == total: only warmup, then the factor holds at peak
    s = WarmupDecay(10, warmup=10, decay=decay, min_lr_ratio=0.1)
    assert s(5) == 0.5 and s(10) == 1.0 and s(100) == 1.0
    # beyond total: hold the value at total
    s = WarmupDecay(10, warmup=2, decay=decay, min_lr_ratio=0.1)
    assert s(10) == s(11) == s(1e9) == (1.0 if decay == "constant" else pytest.approx(0.1))
    # warmup as a ratio of total
    assert WarmupDecay(200, warmup_ratio=0.1).warmup == 20.0


@SETTINGS
@given(st.integers(1, 300), st.floats(0.0, 0.5))
def test_cosine_equals_torch_cosine_annealing(total, r):
    """Invariant: without warmup, the cosine factor equals torch's CosineAnnealingLR(T_max=total,
    eta_min=r) at every step up to total."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    ref = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=r)
    s = WarmupDecay(total, decay="cosine", min_lr_ratio=r)
    for t in range(total + 1):
        assert abs(opt.param_groups[0]["lr"] - s(t)) < 1e-6
        opt.step()
        ref.step()


@SETTINGS
@given(st.integers(1, 200), st.integers(0, 200), st.floats(0.0, 0.5))
def test_warmup_linear_equals_torch_sequential(total, warmup, r):
    """Invariant: warmup + linear decay equals torch's LinearLR warmup chained with LinearLR decay."""
    assume(1 <= warmup <= total - 1)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler
    ref = sched.SequentialLR(
        opt,
        [sched.LinearLR(opt, start_factor=1e-12, end_factor=1.0, total_iters=warmup),
         sched.LinearLR(opt, start_factor=1.0, end_factor=r, total_iters=total - warmup)],
        milestones=[warmup],
    )
    s = WarmupDecay(total, warmup=warmup, decay="linear", min_lr_ratio=r)
    for t in range(total + 1):
        assert abs(opt.param_groups[0]["lr"] - s(t)) < 1e-6
        opt.step()
        ref.step()


def test_wsd_holds_then_decays_to_min():
    s = WSD(100, warmup=10, decay_ratio=0.2, shape="1-sqrt", min_lr_ratio=0.05)
    assert s(5) == 0.5 and s(10) == s(50) == s(80) == 1.0
    assert s(90) == pytest.approx(0.05 + 0.95 * (1 - math.sqrt(0.5)))
    assert s(100) == pytest.approx(0.05)


def expected_decay_start(losses, warmup, window, threshold, patience, cap, total):
    """The declarative rule: the first t_i (= i + 1) that is >= cap, or where the last `patience`
    observations j were all checks (t_j >= warmup, a full window) with range < threshold."""

    def passes(j):
        return (j + 1 >= warmup and j + 1 >= window
                and max(losses[j - window + 1: j + 1]) - min(losses[j - window + 1: j + 1]) < threshold)

    for i in range(len(losses)):
        t = i + 1
        if t < warmup:
            continue
        if t >= cap or (i + 1 >= patience and all(passes(j) for j in range(i - patience + 1, i + 1))):
            return min(float(t), float(total))
    return None


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(20, 80), st.integers(0, 10), st.integers(2, 6), st.integers(1, 4),
       st.floats(0.05, 0.5))
def test_plateau_hybrid_decays_exactly_when_window_criterion_first_holds(seed, total, warmup, window, patience,
                                                                         threshold):
    """Invariant: decay starts at the first step where the loss-window range has been below the
    threshold for `patience` consecutive checks (or at the cap), never earlier; the LR holds at
    peak up to that step and falls after it."""
    g = torch.Generator().manual_seed(seed)
    n = total
    # a loss that falls, with noise whose size varies: plateaus come and go
    noise = torch.rand(n, generator=g) * torch.rand(n, generator=g).pow(4)
    losses = (3.0 * torch.exp(-torch.arange(n) / 8.0) + noise).tolist()
    cap = float(total - 3)
    warmup = min(warmup, total - 5)
    s = PlateauCosine(total, warmup=warmup, window=window, threshold=threshold, patience=patience, cap=cap)
    p = torch.nn.Parameter(torch.zeros(1))
    sched = LRScheduler(torch.optim.SGD([p], lr=1.0), s)
    lrs = []
    for loss in losses:
        sched.step(loss=loss)
        lrs.append((sched.progress, sched.get_last_lr()[0]))
    want = expected_decay_start(losses, warmup, window, threshold, patience, cap, total)
    assert s.decay_start == want
    for t, lr in lrs:
        if warmup <= t <= want:
            assert lr == 1.0
        elif t > want and t < total:
            assert lr < 1.0


def test_plateau_hybrid_rejects_bad_config():
    with pytest.raises(ValueError, match="cap"):
        PlateauCosine(100, warmup=10, cap=5)
    with pytest.raises(ValueError, match="window"):
        PlateauCosine(100, window=1)


@SETTINGS
@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=60), st.integers(0, 5), st.integers(0, 3),
       st.sampled_from([0.5, 0.1]), st.floats(0.0, 0.1))
def test_reduce_on_plateau_equals_torch(metrics, patience, cooldown, factor, threshold):
    """Invariant: ReduceOnPlateau's factor follows torch's ReduceLROnPlateau (mode=min, rel)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    ref = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=factor, patience=patience, cooldown=cooldown,
                                                     threshold=threshold, min_lr=1e-3)
    s = ReduceOnPlateau(factor=factor, patience=patience, cooldown=cooldown, threshold=threshold,
                        min_lr_ratio=1e-3)
    for m in metrics:
        ref.step(m)
        s.observe(m)
        assert opt.param_groups[0]["lr"] == pytest.approx(s(0), rel=1e-9)


def _drive(sched, losses, amounts):
    out = []
    for loss, a in zip(losses, amounts):
        sched.step(amount=a, loss=loss)
        out.append(tuple(sched.get_last_lr()))
    return out


@SETTINGS
@given(st.integers(0, 10_000), st.integers(1, 60), st.sampled_from(["plateau", "rop", "cosine", "wsd"]))
def test_state_round_trip_gives_identical_future(seed, split, kind):
    """Invariant: a scheduler restored from state_dict() produces exactly the LRs the original does."""
    g = torch.Generator().manual_seed(seed)
    losses = (2.0 + torch.rand(80, generator=g) * 0.1).tolist()
    amounts = torch.randint(100, 200, (80,), generator=g).tolist()  # token-driven
    total = float(sum(amounts))

    def make():
        sched = {
            "plateau": lambda: PlateauCosine(total, warmup_ratio=0.1, window=5, threshold=0.08, patience=2),
            "rop": lambda: ReduceOnPlateau(factor=0.5, patience=2),
            "cosine": lambda: WarmupDecay(total, warmup_ratio=0.05, min_lr_ratio=0.1),
            "wsd": lambda: WSD(total, warmup_ratio=0.05, decay_ratio=0.3),
        }[kind]()
        ps = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
        opt = torch.optim.AdamW([{"params": [ps[0]], "lr": 1e-3}, {"params": [ps[1]], "lr": 16e-3}])
        return LRScheduler(opt, sched)

    a = make()
    _drive(a, losses[:split], amounts[:split])
    b = make()
    b.load_state_dict(a.state_dict())
    fa = _drive(a, losses[split:], amounts[split:])
    fb = _drive(b, losses[split:], amounts[split:])
    assert fa == fb
    for lr0, lr1 in fa:  # per-group multipliers compose: the LoRA+ group stays at 16x
        assert lr1 == pytest.approx(16 * lr0, rel=1e-12, abs=1e-18)


def test_observe_between_steps_applies_reduce_on_plateau_at_once():
    p = torch.nn.Parameter(torch.zeros(1))
    sched = LRScheduler(torch.optim.SGD([p], lr=1.0), ReduceOnPlateau(factor=0.5, patience=0))
    sched.observe(1.0)
    sched.observe(2.0)  # no improvement, patience 0: halve now
    assert sched.get_last_lr() == [0.5]
    with pytest.raises(TypeError, match="closed-form"):
        LRScheduler(torch.optim.SGD([p], lr=1.0), WarmupDecay(10)).observe(1.0)


def test_token_driven_warmup_counts_tokens():
    p = torch.nn.Parameter(torch.zeros(1))
    sched = LRScheduler(torch.optim.SGD([p], lr=2.0), WarmupDecay(10_000, warmup=1_000, decay="constant"))
    assert sched.get_last_lr() == [0.0]
    sched.step(amount=250)
    assert sched.get_last_lr() == [0.5]
    sched.step(amount=750)
    assert sched.get_last_lr() == [2.0]


def test_bad_schedule_input_raises():
    with pytest.raises(ValueError, match="unknown schedule 'cosin'"):
        WarmupDecay(100, decay="cosin")
    with pytest.raises(ValueError, match="unknown WSD decay shape"):
        WSD(100, shape="exp")
    with pytest.raises(ValueError, match="longer than total"):
        WarmupDecay(100, warmup=101)
    with pytest.raises(ValueError, match="exceed total"):
        WSD(100, warmup=60, decay=50)
    with pytest.raises(ValueError, match="warmup or warmup_ratio"):
        WarmupDecay(100, warmup=1, warmup_ratio=0.1)
    with pytest.raises(ValueError, match="total"):
        WarmupDecay(0)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        WarmupDecay(100, min_lr_ratio=1.5)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.param_groups[0]["lr"] = -0.1
    with pytest.raises(ValueError, match="learning rate"):
        LRScheduler(opt, WarmupDecay(10))
    with pytest.raises(ValueError, match="forward"):
        LRScheduler(torch.optim.SGD([p], lr=0.1), WarmupDecay(10)).step(amount=-1)
    # a NaN/inf amount (e.g. a token count read from a broken tensor) would make every later LR NaN
    sched = LRScheduler(torch.optim.SGD([p], lr=0.1), WarmupDecay(10))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite"):
            sched.step(amount=bad)
    assert sched.progress == 0.0 and sched.get_last_lr() == [0.1]
    with pytest.raises(ValueError, match="finite"):
        LRScheduler(torch.optim.SGD([p], lr=0.1), WarmupDecay(10), progress=float("nan"))


def test_plateau_hybrid_cap_holds_without_observations():
    """Invariant: the decay starts at ``cap`` at the latest, whether or not (finite) losses were
    observed: a loop that never feeds a loss, or only NaN losses, still gets a cosine from cap to T."""
    s = PlateauCosine(100, warmup=10, cap=50, min_lr_ratio=0.1)
    assert s(50) == 1.0
    assert s(75) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s(100) == pytest.approx(0.1)
    p = torch.nn.Parameter(torch.zeros(1))
    s2 = PlateauCosine(100, warmup=10, cap=50, min_lr_ratio=0.1)
    sched = LRScheduler(torch.optim.SGD([p], lr=1.0), s2)
    for _ in range(75):
        sched.step(loss=float("nan"))
    assert sched.get_last_lr()[0] == pytest.approx(s(75))
    # an observation past the cap (a token-driven step overshooting it) keeps the decay anchored at cap
    s3 = PlateauCosine(100, warmup=10, cap=50)
    s3.observe(1.0, 57.0)
    assert s3.decay_start == 50.0


def test_wsd_errors_name_the_decay_phase():
    """A bad WSD decay length is reported as the decay's, not the warmup's."""
    with pytest.raises(ValueError, match=r"^decay \(150.0\) is longer than total \(100\)$"):
        WSD(total=100, decay=150)
    with pytest.raises(ValueError, match=r"^decay must be >= 0"):
        WSD(total=100, decay=-1)
    with pytest.raises(ValueError, match=r"^decay_ratio must be in \[0, 1\]"):
        WSD(total=100, decay_ratio=1.5)
    with pytest.raises(ValueError, match=r"^warmup \(101.0\) is longer than total"):
        WSD(total=100, warmup=101)


def test_warmup_is_given_to_the_schedule_and_resolve_warmup_is_deprecated():
    """One way to give warmup: ``warmup=`` / ``warmup_ratio=`` on the schedule; the old helper warns
    and returns the schedule's own number for one release."""
    import ftlib.sched

    assert "resolve_warmup" not in ftlib.sched.__all__
    for make in (WarmupDecay, PlateauCosine, WSD):
        assert make(200, warmup_ratio=0.15).warmup == 30.0
    with pytest.warns(DeprecationWarning, match="pass warmup_ratio= .* to the schedule"):
        assert ftlib.sched.resolve_warmup(200, warmup_ratio=0.15) == WarmupDecay(200, warmup_ratio=0.15).warmup
