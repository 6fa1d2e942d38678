"""Gradient clippers: equality with clip_grad_norm_, bounds, direction, AGC, z-score, FSDP2."""

import math
from pathlib import Path

import pytest
import torch
from _torchrun import run_torchrun
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ftlib.clip import AGCClipper, GlobalNormClipper, PerLayerClipper, ZScoreClipper, grad_norm

SETTINGS = settings(max_examples=25, deadline=None)
shapes_st = st.lists(
    st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple), min_size=1, max_size=5
)


def make_params(shapes, seed, grad_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = nn.Parameter(torch.randn(s, generator=g))
        p.grad = torch.randn(s, generator=g) * grad_scale
        params.append(p)
    return params


def flat_grads(params):
    return torch.cat([p.grad.reshape(-1) for p in params])


def clone_params(params):
    out = []
    for p in params:
        q = nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        out.append(q)
    return out


@SETTINGS
@given(shapes_st, st.integers(0, 10_000), st.floats(1e-3, 10.0), st.sampled_from([1.0, 2.0, 3.0, math.inf]),
       st.floats(0.01, 100.0))
def test_global_norm_equals_clip_grad_norm_(shapes, seed, max_norm, norm_type, grad_scale):
    """Invariant: GlobalNormClipper gives the same norm and gradients as clip_grad_norm_ (fp32 rounding)."""
    a = make_params(shapes, seed, grad_scale)
    b = clone_params(a)
    ref = torch.nn.utils.clip_grad_norm_(b, max_norm, norm_type=norm_type, foreach=True)
    stats = GlobalNormClipper(max_norm, norm_type)(a)
    torch.testing.assert_close(stats.norm_before, ref, rtol=1e-5, atol=1e-6)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def _clippers(names):
    return [
        GlobalNormClipper(0.5),
        PerLayerClipper([(r"^l0\.", 0.3), (r".", 0.7)]),
        ZScoreClipper(z=1.0, warmup=0),
        AGCClipper(0.05),
    ]


@SETTINGS
@given(shapes_st, st.integers(0, 10_000), st.floats(0.01, 50.0), st.integers(0, 3))
def test_every_clipper_bounds_its_norm_and_keeps_direction(shapes, seed, grad_scale, which):
    """Invariant: after clipping, norm <= bound (per group for per-layer), and each clipped group's
    gradient keeps its direction (cosine similarity 1); AGC scales each unit by a factor in (0, 1]."""
    params = make_params(shapes, seed, grad_scale)
    named = [(f"l{i}.weight", p) for i, p in enumerate(params)]
    before = [p.grad.clone() for p in params]
    clipper = _clippers(None)[which]
    if isinstance(clipper, ZScoreClipper):
        # seed the history with two equal small norms, so the bound is that norm (std 0)
        for _ in range(2):
            small = clone_params(params)
            for p in small:
                p.grad.mul_(0.01)
            clipper(small)
        bound = float(clipper.bound())
        assert math.isfinite(bound)
    stats = clipper(named)
    after = [p.grad for p in params]
    assert float(stats.norm_after) <= float(stats.norm_before) * (1 + 1e-6)
    # the reported norms are the real ones
    torch.testing.assert_close(stats.norm_before, torch.cat([b.reshape(-1) for b in before]).norm(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.norm_after, grad_norm(params), rtol=1e-5, atol=1e-6)
    if isinstance(clipper, GlobalNormClipper):
        assert float(grad_norm(params)) <= 0.5 * (1 + 1e-5)
    if isinstance(clipper, ZScoreClipper):
        assert float(grad_norm(params)) <= bound * (1 + 1e-5)
    if isinstance(clipper, PerLayerClipper):
        for (n, p) in named:
            assert float(p.grad.norm()) <= (0.3 if n.startswith("l0.") else 0.7) * (1 + 1e-5)
    if isinstance(clipper, AGCClipper):
        for b, a in zip(before, after):
            units_b = b.reshape(b.shape[0], -1) if b.ndim >= 2 else b.reshape(1, -1)
            units_a = a.reshape(a.shape[0], -1) if a.ndim >= 2 else a.reshape(1, -1)
            cos = nn.functional.cosine_similarity(units_a, units_b, dim=1)
            torch.testing.assert_close(cos, torch.ones_like(cos), atol=1e-5, rtol=0)
    else:
        groups = [[i] for i in range(len(params))] if isinstance(clipper, PerLayerClipper) else [range(len(params))]
        for grp in groups:
            fb = torch.cat([before[i].reshape(-1) for i in grp])
            fa = torch.cat([after[i].reshape(-1) for i in grp])
            cos = nn.functional.cosine_similarity(fa, fb, dim=0)
            assert abs(float(cos) - 1.0) < 1e-5


@SETTINGS
@given(shapes_st, st.integers(0, 10_000), st.integers(0, 3))
def test_below_the_bound_nothing_changes(shapes, seed, which):
    """Invariant: gradients whose norm is below every bound come out bit-identical, scale 1."""
    params = make_params(shapes, seed, grad_scale=1e-4)
    for p in params:  # big weights: the AGC bound 0.05 * ||W_i|| is far above 1e-4 * ||G_i||
        p.data.mul_(100.0).add_(torch.sign(p.data) + (p.data == 0))
    before = [p.grad.clone() for p in params]
    clipper = _clippers(None)[which]
    if isinstance(clipper, ZScoreClipper):
        for _ in range(2):  # mean = twice this norm, std 0: the bound is 2x the norm
            seed_params = clone_params(params)
            for p in seed_params:
                p.grad.mul_(2.0)
            clipper(seed_params)
    stats = clipper([(f"l{i}.weight", p) for i, p in enumerate(params)])
    for b, p in zip(before, params):
        assert torch.equal(b, p.grad)
    assert float(stats.scale) == 1.0 and not bool(stats.clipped)


@SETTINGS
@given(shapes_st, st.integers(0, 10_000), st.floats(1e-3, 0.5), st.floats(0.1, 100.0))
def test_agc_bounds_every_unit_ratio(shapes, seed, lam, grad_scale):
    """Invariant: after AGC, ||G_i|| / max(||W_i||, eps) <= lambda for every output unit i, and
    units already inside the bound are untouched."""
    eps = 1e-3
    params = make_params(shapes, seed, grad_scale)
    before = [p.grad.clone() for p in params]
    AGCClipper(lam, eps=eps)(params)
    for p, b in zip(params, before):
        rows = (lambda t: t.reshape(t.shape[0], -1) if t.ndim >= 2 else t.reshape(1, -1))
        w, g, g0 = rows(p.detach()), rows(p.grad), rows(b)
        limit = lam * w.norm(dim=1).clamp(min=eps)
        assert bool((g.norm(dim=1) <= limit * (1 + 1e-5)).all())
        inside = g0.norm(dim=1) <= limit
        assert torch.equal(g[inside], g0[inside])


@SETTINGS
@given(st.integers(0, 10_000), st.integers(1, 8), st.floats(2.0, 1e4))
def test_zscore_never_clips_in_warmup_and_bounds_spikes_after(seed, warmup, spike):
    """Invariant: during warm-up no call clips (even a spike); after it a spike above m + z*std is
    scaled to exactly that bound, and the history absorbs the bound, not the spike."""
    g = torch.Generator().manual_seed(seed)
    clipper = ZScoreClipper(z=2.0, beta=0.9, warmup=warmup)
    p = nn.Parameter(torch.zeros(16))
    for i in range(warmup):
        p.grad = torch.randn(16, generator=g) * (spike if i == warmup - 1 else 1.0)
        before = p.grad.clone()
        stats = clipper([p])
        assert torch.equal(p.grad, before) and not bool(stats.clipped)
    for _ in range(3):  # settle after a warm-up spike
        p.grad = torch.randn(16, generator=g)
        clipper([p])
    bound = float(clipper.bound())
    p.grad = torch.randn(16, generator=g)
    p.grad.mul_(bound * spike / p.grad.norm())
    mean_before, w = float(clipper.mean), 0.9 * float(clipper.weight) + 1.0
    stats = clipper([p])
    assert bool(stats.clipped)
    assert abs(float(p.grad.norm()) - bound) <= 1e-4 * bound
    assert abs(float(clipper.mean) - (mean_before + (bound - mean_before) / w)) <= 1e-5 * bound


def test_zscore_state_round_trip_gives_identical_future():
    """Invariant: a clipper restored from state_dict clips every later step exactly like the original."""
    g = torch.Generator().manual_seed(0)
    norms = torch.rand(40, generator=g) * 3 + torch.tensor([10.0 if i % 7 == 0 else 0.0 for i in range(40)])
    a = ZScoreClipper(z=1.5, beta=0.8, warmup=5)
    p = nn.Parameter(torch.zeros(4))
    for n in norms[:20]:
        p.grad = torch.full((4,), float(n) / 2)
        a([p])
    b = ZScoreClipper(z=1.5, beta=0.8, warmup=5)
    b.load_state_dict(a.state_dict())
    for n in norms[20:]:
        p.grad = torch.full((4,), float(n) / 2)
        sa = a([p]).scale
        p.grad = torch.full((4,), float(n) / 2)
        sb = b([p]).scale
        assert float(sa) == float(sb)


def test_non_finite_norm_does_not_touch_zscore_ema():
    clipper = ZScoreClipper(z=2.0, warmup=0)
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    clipper([p])
    state = clipper.state_dict()
    p.grad = torch.tensor([1.0, float("nan"), 1.0])
    clipper([p])
    after = clipper.state_dict()
    assert after.pop("step") == state.pop("step") + 1 and after == state


def test_per_layer_groups_by_module_and_uses_first_matching_rule():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 10
    stats = PerLayerClipper([(r"^0\.", 1.0)])(model)
    layer0 = torch.cat([model[0].weight.grad.reshape(-1), model[0].bias.grad])
    assert abs(float(layer0.norm()) - 1.0) < 1e-4  # weight and bias share one layer norm
    assert torch.equal(model[1].weight.grad, torch.full((3, 3), 10.0))  # no rule, no default: untouched
    assert float(stats.extra["layers_clipped"]) == 1.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: GlobalNormClipper(0.0),
        lambda: GlobalNormClipper(-1.0),
        lambda: GlobalNormClipper(float("nan")),
        lambda: ZScoreClipper(z=0.0),
        lambda: ZScoreClipper(beta=1.0),
        lambda: AGCClipper(clipping=-0.1),
        lambda: PerLayerClipper([("mlp", 0.0)]),
        lambda: PerLayerClipper([]),
    ],
)
def test_bad_clip_bounds_raise(make):
    with pytest.raises(ValueError, match="must be|needs"):
        make()


def test_per_layer_needs_names():
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    with pytest.raises(TypeError, match="names"):
        PerLayerClipper([(".", 1.0)])([p])


def _feed(clipper, norms, size=4):
    """Call ``clipper`` once per norm, on one parameter whose gradient has that norm; the stats."""
    p = nn.Parameter(torch.zeros(size))
    out = []
    for n in norms:
        p.grad = torch.full((size,), float(n) / math.sqrt(size))
        out.append(clipper([p]))
    return out


@SETTINGS
@given(st.lists(st.floats(0.1, 100.0), min_size=2, max_size=25), st.floats(0.5, 0.99))
def test_zscore_history_is_the_weighted_mean_and_unbiased_variance(norms, beta):
    """Invariant: with nothing clipped, the clipper's mean and variance are the closed-form weighted
    mean and reliability-weighted (unbiased for i.i.d. norms) variance of the norms seen, with
    weight beta^age: sum w x / sum w and sum w (x - m)^2 / (sum w - sum w^2 / sum w)."""
    clipper = ZScoreClipper(z=3.0, beta=beta, warmup=10**6)
    x = torch.stack([s.norm_before for s in _feed(clipper, norms)]).double()
    w = beta ** torch.arange(len(norms) - 1, -1, -1, dtype=torch.float64)
    mean = (w * x).sum() / w.sum()
    var = (w * (x - mean) ** 2).sum() / (w.sum() - (w * w).sum() / w.sum())
    torch.testing.assert_close(clipper.mean, mean, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(clipper.var, var, rtol=1e-6, atol=1e-9 * float(mean) ** 2)


def test_zscore_false_clip_rate_on_iid_norms():
    """The false-clip rate the docstring states: i.i.d. Gaussian norms (mean 10, std 1), z = 3,
    beta = 0.98, a 10-step warm-up. An uncorrected variance (0 at the start) clips ~2% of the 50
    steps after the warm-up; the corrected one stays near the Gaussian tail (0.13%)."""
    g = torch.Generator().manual_seed(0)
    clipped = total = 0
    for _ in range(40):
        stats = _feed(ZScoreClipper(z=3.0, beta=0.98, warmup=10), 10 + torch.randn(60, generator=g), size=1)
        flags = [bool(s.clipped) for s in stats]
        assert not any(flags[:10])
        clipped, total = clipped + sum(flags[10:]), total + 50
    rate = clipped / total
    print(f"z-score false-clip rate on i.i.d. norms, 50 steps after a 10-step warm-up: {rate:.4f} ({clipped}/{total})")
    assert rate < 0.01


def test_zscore_warmup_counts_finite_norms_only():
    """Non-finite norms are skipped steps: they neither clip, nor count toward warm-up, nor enter the
    history; the first ``warmup`` finite norms are warm-up even after a run of NaN steps."""
    nan, inf = float("nan"), float("inf")
    clipper = ZScoreClipper(z=3.0, beta=0.9, warmup=3)
    stats = _feed(clipper, [nan, inf, nan, 1.0, 1.1, 1.2, 1.25])
    assert [bool(s.clipped) for s in stats] == [False] * 7
    assert float(clipper.count) == 4 and math.isfinite(float(clipper.bound()))


@pytest.mark.parametrize("warmup", [2, 5])
def test_zscore_clips_from_the_first_step_after_warmup(warmup):
    """The warm-up boundary: ``warmup`` ordinary norms pass untouched, and a spike at the very next
    step is clipped (a warm-up one step too long lets it through)."""
    clipper = ZScoreClipper(z=2.0, beta=0.9, warmup=warmup)
    stats = _feed(clipper, [1.0 + 0.1 * i for i in range(warmup)] + [100.0])
    assert [bool(s.clipped) for s in stats] == [False] * warmup + [True]
    assert float(stats[-1].norm_after) < 2.0


def test_agc_eps_floor_lets_a_zero_weight_learn():
    """A fresh LoRA B is all zeros: AGC clips each unit of its gradient to clipping * eps (same
    direction), not to zero."""
    lam, eps = 0.01, 1e-3
    b = nn.Parameter(torch.zeros(6, 4))
    g = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    b.grad = g.clone()
    stats = AGCClipper(lam, eps=eps)([("layer.lora_B.weight", b)])
    torch.testing.assert_close(b.grad.norm(dim=1), torch.full((6,), lam * eps), rtol=1e-5, atol=0)
    cos = nn.functional.cosine_similarity(b.grad, g, dim=1)
    torch.testing.assert_close(cos, torch.ones(6), rtol=0, atol=1e-6)
    assert bool(stats.clipped)


@pytest.mark.parametrize("which", range(4))
def test_float64_gradients_are_clipped_in_float64(which):
    """float64 gradients: norms accumulate in float64 (exact to ~1e-15, where float32 would give
    ~1e-7) and the clipped gradients equal the float32 run's to float32 rounding."""
    shapes = [(3, 4), (5,), (2, 2, 2)]
    p64 = make_params(shapes, 0, grad_scale=10.0)
    for p in p64:
        p.data, p.grad = p.data.double(), p.grad.double()
    p32 = make_params(shapes, 0, grad_scale=10.0)
    want = torch.cat([p.grad.reshape(-1) for p in p64]).norm()
    results = []
    for params in (p64, p32):
        clipper = _clippers(None)[which]
        if isinstance(clipper, ZScoreClipper):
            for _ in range(2):
                small = clone_params(params)
                for q in small:
                    q.grad.mul_(0.01)
                clipper(small)
        results.append(clipper([(f"l{i}.weight", p) for i, p in enumerate(params)]))
    assert results[0].norm_before.dtype == torch.float64
    torch.testing.assert_close(results[0].norm_before, want, rtol=1e-14, atol=0)
    assert bool(results[0].clipped) and bool(results[1].clipped)
    for a, b in zip(p64, p32):
        assert a.grad.dtype == torch.float64
        torch.testing.assert_close(a.grad, b.grad.double(), rtol=1e-5, atol=1e-6)


def test_name_matching_clippers_refuse_unnamed_parameters():
    """PerLayerClipper rules and AGC's exclude match names: unnamed tensors would match nothing, so
    they are refused with the way out; AGC without exclude needs no names."""
    p = nn.Parameter(torch.zeros(2))
    for clipper in (PerLayerClipper([(".", 1.0)]), AGCClipper(exclude=("lm_head",))):
        p.grad = torch.ones(2)
        with pytest.raises(TypeError, match=r"unnamed.*param_groups\(model"):
            clipper([p])
    p.grad = torch.ones(2)
    AGCClipper()([p])


def test_agc_norms_count_excluded_gradients():
    """AGC leaves excluded parameters alone but reports the norm of every gradient it was given."""
    w, head = nn.Parameter(torch.ones(3, 3)), nn.Parameter(torch.ones(2, 3))
    w.grad, head.grad = torch.full((3, 3), 10.0), torch.full((2, 3), 4.0)
    stats = AGCClipper(0.01, exclude=("head",))([("w", w), ("head", head)])
    assert torch.equal(head.grad, torch.full((2, 3), 4.0))
    torch.testing.assert_close(stats.norm_before, torch.tensor((9 * 100.0 + 6 * 16.0) ** 0.5))
    torch.testing.assert_close(stats.norm_after, torch.cat([w.grad.reshape(-1), head.grad.reshape(-1)]).norm())
    head.grad[0, 0] = float("nan")
    w.grad = torch.full((3, 3), 10.0)
    assert not math.isfinite(float(AGCClipper(0.01, exclude=("head",))([("w", w), ("head", head)]).norm_before))


@pytest.mark.distributed
def test_fsdp2_dtensor_clipping_matches_single_process(tmp_path):
    """Invariant: under FSDP2 (2 ranks, gloo) every clipper computes the full-model norm over all
    shards and every rank scales by the same factor: gathered clipped grads equal the
    single-process result."""
    run_torchrun(Path(__file__).with_name("_dist_clip_worker.py"), tmp_path)
