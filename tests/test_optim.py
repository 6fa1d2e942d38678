"""Optimizer wrapper: accumulation invariance, fp16 loss scaling, NaN trace, groups, state."""

import copy
from collections import deque
from pathlib import Path

import pytest
import torch
from _torchrun import run_torchrun
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ftlib.clip import AGCClipper, ClipStats, GlobalNormClipper, PerLayerClipper, ZScoreClipper, grad_norm
from ftlib.losses import cross_entropy_sum
from ftlib.nan_trace import NanTrace
from ftlib.optim import TrainOptimizer, make_adamw, param_groups

V, H = 11, 6


class TinyLM(nn.Module):
    """Embedding -> causal running mean (tokens mix with their past only) -> LM head."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, H)
        self.proj = nn.Linear(H, H)
        self.head = nn.Linear(H, V)

    def forward(self, input_ids):
        x = torch.tanh(self.proj(self.embed(input_ids)))  # (B, T, H)
        steps = torch.arange(1, input_ids.shape[1] + 1, dtype=x.dtype)[None, :, None]
        return self.head(x.cumsum(1) / steps)  # (B, T, V), causal: right padding changes nothing


def make_sequences(seed, n):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n):
        length = int(torch.randint(2, 10, (1,), generator=g))
        ids = torch.randint(0, V, (length,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, length - 1, (1,), generator=g))] = -100  # a prompt without loss
        seqs.append((ids, labels))
    return seqs


def collate(seqs):
    """Right-pad to the longest sequence of this micro-batch; padding carries no loss."""
    t = max(len(ids) for ids, _ in seqs)
    input_ids = torch.zeros(len(seqs), t, dtype=torch.long)
    labels = torch.full((len(seqs), t), -100)
    for i, (ids, lab) in enumerate(seqs):
        input_ids[i, : len(ids)], labels[i, : len(lab)] = ids, lab
    return input_ids, labels


def reference_grads(seqs):
    """One batch holding every sequence, mean loss over all target tokens."""
    model = TinyLM()
    input_ids, labels = collate(seqs)
    loss_sum, n = cross_entropy_sum(model(input_ids), labels)
    (loss_sum / n).backward()
    return float(loss_sum.detach() / n), {k: p.grad.clone() for k, p in model.named_parameters()}


def split(seqs, sizes):
    out, i = [], 0
    for s in sizes:
        out.append(seqs[i : i + s])
        i += s
    return out


def accumulate(micro_batches, up_front):
    model = TinyLM()
    opt = TrainOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    if up_front:
        opt.set_window_tokens(sum(int((collate(mb)[1][:, 1:] != -100).sum()) for mb in micro_batches))
    for mb in micro_batches:
        input_ids, labels = collate(mb)
        loss_sum, n = cross_entropy_sum(model(input_ids), labels)
        opt.backward(loss_sum, n)
    opt.prepare_grads()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return opt.step(), grads


@st.composite
def windows(draw):
    n = draw(st.integers(1, 8))
    sizes, left = [], n
    while left:
        sizes.append(draw(st.integers(1, left)))
        left -= sizes[-1]
    return draw(st.integers(0, 10_000)), n, sizes


@settings(max_examples=25, deadline=None)
@given(windows(), st.booleans())
def test_accumulation_invariance_any_split(window, up_front):
    """Invariant: any split of the same sequences (uneven lengths, padded per micro-batch) into
    micro-batches gives the loss and gradients of one batch holding them all (fp32, tight)."""
    seed, n, sizes = window
    seqs = make_sequences(seed, n)
    ref_loss, ref = reference_grads(seqs)
    result, grads = accumulate(split(seqs, sizes), up_front)
    assert result.loss == pytest.approx(ref_loss, rel=1e-6)
    assert result.num_tokens == sum(int((lab[1:] != -100).sum()) for _, lab in seqs)
    for k in ref:
        torch.testing.assert_close(grads[k], ref[k], rtol=1e-5, atol=1e-7, msg=k)


def test_batch1_x_accum8_equals_batch8_x_accum1_and_mean_of_means_does_not():
    """Invariant: batch 1 x accumulation 8 == batch 8 x accumulation 1 == uneven 3+1+4, and the
    per-micro-batch mean (the common bug) would differ for these uneven lengths."""
    seqs = make_sequences(7, 8)
    _, ref = reference_grads(seqs)
    for sizes in ([1] * 8, [8], [3, 1, 4]):
        _, grads = accumulate(split(seqs, sizes), up_front=False)
        for k in ref:
            torch.testing.assert_close(grads[k], ref[k], rtol=1e-5, atol=1e-7)
    model = TinyLM()  # the bug: mean per micro-batch, averaged over micro-batches
    for mb in split(seqs, [1] * 8):
        loss_sum, n = cross_entropy_sum(model(collate([mb[0]])[0]), collate([mb[0]])[1])
        (loss_sum / n / 8).backward()
    assert not torch.allclose(model.head.weight.grad, ref["head.weight"], rtol=1e-3, atol=1e-5)


def test_accumulated_step_matches_single_batch_adamw_step():
    seqs = make_sequences(3, 6)
    models = []
    for sizes in ([6], [2, 3, 1]):
        model = TinyLM()
        opt = TrainOptimizer(make_adamw(param_groups(model, lr=1e-2, weight_decay=0.1)))
        for _ in range(3):
            for mb in split(seqs, sizes):
                input_ids, labels = collate(mb)
                opt.backward(*cross_entropy_sum(model(input_ids), labels))
            opt.step(GlobalNormClipper(0.5))
        models.append(model)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _one_backward(model, opt, seed=0):
    input_ids, labels = collate(make_sequences(seed, 3))
    with opt.autocast():
        logits = model(input_ids)
    opt.backward(*cross_entropy_sum(logits, labels))


def test_fp16_overflow_skips_step_backs_off_scale_and_keeps_weights():
    """Invariant: an injected overflow skips the update (weights bit-identical), multiplies the
    loss scale by backoff and counts the skip; clean steps then grow the scale on schedule."""
    model = TinyLM()
    opt = TrainOptimizer(make_adamw(model.parameters(), lr=1e-2), precision="fp16", init_scale=2.0**10,
                         growth_interval=2, backoff_factor=0.25)
    _one_backward(model, opt)
    assert opt.step().loss_scale == 2.0**10  # one clean step: no growth yet
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    _one_backward(model, opt)
    model.proj.weight.grad[0, 0] = float("inf")  # overflow
    result = opt.step()
    assert result.skipped and result.loss_scale == 2.0**8
    assert opt.skipped_steps == 1 and opt.steps == 1
    for k, p in model.named_parameters():
        assert torch.equal(p, before[k]), k
    for _ in range(2):
        _one_backward(model, opt)
        result = opt.step()
    assert not result.skipped and result.loss_scale == 2.0**9 and opt.steps == 3


def test_fp16_grads_are_unscaled_before_normalisation():
    """Invariant: with fp16 loss scaling the gradients seen by the clipper/optimizer equal the fp32 ones."""
    grads = []
    for precision in ("fp32", "fp16"):
        model = TinyLM()
        opt = TrainOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), precision=precision, init_scale=2.0**12)
        input_ids, labels = collate(make_sequences(5, 4))
        opt.backward(*cross_entropy_sum(model(input_ids), labels))  # fp32 forward: only the scale differs
        opt.prepare_grads()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_non_finite_grads_skip_and_count(precision):
    model = TinyLM()
    opt = TrainOptimizer(make_adamw(model.parameters(), lr=1e-2), precision=precision)
    before = [p.detach().clone() for p in model.parameters()]
    _one_backward(model, opt)
    model.head.bias.grad[1] = float("nan")
    result = opt.step()
    assert result.skipped and opt.skipped_steps == 1 and opt.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # the window is closed


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_window_without_target_tokens_skips_and_counts(precision):
    """A window whose labels are all -100 after a real step: AdamW's momentum and weight decay
    would still move every weight; the window is skipped and counted, its loss is undefined."""
    model = TinyLM()
    opt = TrainOptimizer(make_adamw(param_groups(model, lr=1e-2, weight_decay=0.1), lr=1e-2), precision=precision,
                         init_scale=16.0)
    clipper = ZScoreClipper(warmup=1)
    _one_backward(model, opt)
    assert not opt.step(clipper).skipped  # a real step: the optimizer now has momentum
    calls, scale = clipper.step, opt.scaler.get_scale() if opt.scaler is not None else None
    before = [p.detach().clone() for p in model.parameters()]
    input_ids, labels = collate(make_sequences(1, 3))
    with opt.autocast():
        logits = model(input_ids)
    opt.backward(*cross_entropy_sum(logits, torch.full_like(labels, -100)))
    result = opt.step(clipper)
    assert result.skipped and result.skip_reason == "no target tokens" and result.num_tokens == 0
    assert result.loss != result.loss  # NaN, not 0.0
    assert (opt.steps, opt.skipped_steps) == (1, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "an empty window moved the weights"
    assert clipper.step == calls  # the clipper's norm history did not absorb the empty window
    assert all(p.grad is None for p in model.parameters())
    if opt.scaler is not None:
        assert opt.scaler.get_scale() == scale and opt._skip_calls == deque()  # not an overflow
    _one_backward(model, opt, seed=2)  # the next real window steps as usual
    after = opt.step(clipper)
    assert not after.skipped and after.skip_reason is None and opt.steps == 2
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class PlantForwardNaN(nn.Module):
    def forward(self, x):
        return x * torch.where(torch.arange(x.shape[-1]) == 2, float("nan"), 1.0)


class _NaNBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


class PlantBackwardNaN(nn.Module):
    def forward(self, x):
        return _NaNBackward.apply(x)


@pytest.mark.parametrize("plant, where", [
    (PlantForwardNaN, "forward output of 'body.1' (PlantForwardNaN)"),
    (PlantBackwardNaN, "backward of 'body.1' (PlantBackwardNaN)"),
])
def test_nan_trace_names_the_planted_module(plant, where):
    """Invariant: the trace names the module where a NaN was planted, in forward or in backward."""
    model = nn.Sequential()
    model.body = nn.Sequential(nn.Linear(4, 5), plant(), nn.Linear(5, 3))
    trace = NanTrace(model)
    opt = TrainOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), nan_trace=trace)
    opt.backward(model(torch.randn(2, 4)).sum(), 6)
    result = opt.step()
    assert result.skipped
    assert result.nan_source is not None and result.nan_source.startswith(where), result.nan_source
    assert trace.first is None  # reset for the next window
    trace.remove()


def test_nan_trace_is_silent_when_all_finite():
    model = TinyLM()
    trace = NanTrace(model)
    input_ids, labels = collate(make_sequences(0, 2))
    cross_entropy_sum(model(input_ids), labels)[0].backward()
    assert trace.first is None
    trace.remove()


class DoRAish(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.lora_A = nn.Linear(4, 2, bias=False)
        self.lora_B = nn.Linear(2, 4, bias=False)
        self.lora_magnitude_vector = nn.ParameterDict({"default": nn.Parameter(torch.ones(4, 1))})
        self.base.weight.requires_grad_(False)


def test_param_groups_decay_and_lora_plus():
    model = nn.Sequential()
    model.embed = nn.Embedding(10, 4)
    model.norm = nn.RMSNorm(4)
    model.attn = DoRAish()
    model.head = nn.Linear(4, 10)
    model.head.weight = model.embed.weight  # tied: must appear once
    groups = param_groups(model, lr=1e-3, weight_decay=0.1, no_decay_embeddings=True, lora_plus_ratio=16)
    by_name = {n: g for g in groups for n in g["param_names"]}
    assert sorted(by_name) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert by_name["attn.lora_A.weight"]["weight_decay"] == 0.1 and by_name["attn.lora_A.weight"]["lr"] == 1e-3
    assert by_name["attn.lora_B.weight"]["lr"] == pytest.approx(16e-3)
    assert by_name["attn.lora_B.weight"]["weight_decay"] == 0.1
    for n in ("embed.weight", "norm.weight", "attn.base.bias", "head.bias",
              "attn.lora_magnitude_vector.default"):
        assert by_name[n]["weight_decay"] == 0.0, n
    plain = param_groups(model, lr=1e-3, weight_decay=0.1)
    assert {n: g["weight_decay"] for g in plain for n in g["param_names"]}["embed.weight"] == 0.1
    opt = make_adamw(groups, lr=1e-3)  # groups feed straight into AdamW (foreach on CPU)
    assert opt.defaults["foreach"] is True


def test_state_dict_round_trip_gives_identical_future():
    """Invariant: a wrapper restored from state_dict (optimizer, scaler, counters) continues exactly."""
    def run(model, opt, seeds):
        for s in seeds:
            _one_backward(model, opt, s)
            if s == 2:
                model.head.weight.grad[0, 0] = float("inf")
            opt.step()

    model = TinyLM()
    opt = TrainOptimizer(make_adamw(model.parameters(), lr=1e-2), precision="fp16", init_scale=2.0**6,
                         growth_interval=3)
    run(model, opt, [0, 1, 2, 3])
    state = copy.deepcopy(opt.state_dict())  # as a checkpoint would: no tensors shared with opt
    model2 = TinyLM()
    model2.load_state_dict(model.state_dict())
    opt2 = TrainOptimizer(make_adamw(model2.parameters(), lr=1e-2), precision="fp16")
    opt2.load_state_dict(state)
    assert (opt2.steps, opt2.skipped_steps, opt2.scaler.get_scale()) == (3, 1, opt.scaler.get_scale())
    run(model, opt, [4, 5, 6])
    run(model2, opt2, [4, 5, 6])
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert opt.scaler.get_scale() == opt2.scaler.get_scale()


class FSDPLike(nn.Linear):
    def __init__(self):
        super().__init__(2, 2)
        self.calls = []

    def set_requires_gradient_sync(self, flag):
        self.calls.append(flag)


def test_grad_sync_context_turns_sync_off_only_for_non_final_micro_batches():
    model = FSDPLike()
    opt = TrainOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with opt.grad_sync(model, enabled=False):
        assert model.calls == [False]
    assert model.calls == [False, True]
    with opt.grad_sync(model, enabled=True):
        pass
    assert model.calls == [False, True]


def test_bad_optimizer_input_raises():
    model = TinyLM()
    with pytest.raises(ValueError, match="learning rate"):
        param_groups(model, lr=-1e-3)
    with pytest.raises(ValueError, match="learning rate"):
        make_adamw(model.parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="unknown AdamW impl"):
        make_adamw(model.parameters(), impl="fast")
    with pytest.raises(ValueError, match="unknown precision"):
        TrainOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), precision="fp8")
    opt = TrainOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="no backward"):
        opt.step()
    with pytest.raises(ValueError, match="0-d"):
        opt.backward(torch.ones(2, requires_grad=True), 2)
    opt.set_window_tokens(5)
    _one_backward(model, opt)
    with pytest.raises(RuntimeError, match="before the window's first backward"):
        opt.set_window_tokens(5)
    with pytest.raises(ValueError, match="set_window_tokens\\(5\\)"):
        opt.step()
    assert all(p.grad is None for p in model.parameters())  # the bad window was dropped


class _PartialNormClipper:
    """A user's clipper whose reported norm covers only some gradients (no reports_global_norm)."""

    def __call__(self, named):
        first = [p for p in named if isinstance(p, torch.Tensor) or p[0].startswith("proj")]
        norm = grad_norm(first)
        return ClipStats(norm, norm, norm < 0, torch.ones(()))


@pytest.mark.parametrize("make_clipper", [
    lambda: AGCClipper(0.01, exclude=("head",)),
    lambda: PerLayerClipper([("proj", 1.0)]),
    lambda: _PartialNormClipper(),
], ids=["agc_exclude", "per_layer_no_default", "user_partial_norm"])
def test_non_finite_grad_outside_the_clipped_set_still_skips(make_clipper):
    """Invariant: a NaN in any gradient the optimizer steps skips the step, whatever the clipper
    leaves alone (AGC's exclude, per-layer parameters without a bound) or reports."""
    model = TinyLM()
    opt = TrainOptimizer(make_adamw(param_groups(model, lr=1e-2), lr=1e-2))
    before = [p.detach().clone() for p in model.parameters()]
    _one_backward(model, opt)
    model.head.weight.grad[0, 0] = float("nan")
    result = opt.step(make_clipper())
    assert result.skipped and opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_float64_model_steps_in_float64():
    """A float64 model: normalisation, clipping and the step stay float64 and equal plain SGD on the
    mean token loss (computed in float64) to 1e-12."""
    model, ref = TinyLM().double(), TinyLM().double()
    opt = TrainOptimizer(torch.optim.SGD(param_groups(model, lr=0.1), lr=0.1))  # named groups
    input_ids, labels = collate(make_sequences(0, 3))
    opt.backward(*cross_entropy_sum(model(input_ids), labels))
    loss_sum, n = cross_entropy_sum(ref(input_ids), labels)
    (loss_sum / n).backward()
    clipper = GlobalNormClipper(0.05)
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    result = opt.step(clipper)
    with torch.no_grad():
        for p in ref.parameters():
            p.sub_(0.1 * p.grad)
    assert not result.skipped and result.grad_norm == pytest.approx(float(norm), rel=1e-12)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for clipper in (ZScoreClipper(warmup=0), AGCClipper(), PerLayerClipper([(".", 1.0)])):
        opt.backward(*cross_entropy_sum(model(input_ids), labels))
        assert not opt.step(clipper).skipped


def test_name_matching_clippers_get_names_through_the_optimizer():
    """Groups without param_names: names come from model=, or a name-matching clipper refuses
    (it would match nothing); param_groups() groups carry their names."""
    model = TinyLM()
    rule = PerLayerClipper([(r"^head\.", 1e-3)])
    opt = TrainOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    _one_backward(model, opt)
    with pytest.raises(TypeError, match="unnamed"):
        opt.step(rule)
    for opt in (TrainOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model),
                TrainOptimizer(torch.optim.SGD(param_groups(model, lr=0.1), lr=0.0))):
        model.zero_grad(set_to_none=True)
        _one_backward(model, opt)
        result = opt.step(rule)
        assert result.clip["layers_clipped"] == 1.0  # head matched by name and clipped; the rest unbounded
        assert result.clip["grad_norm_clipped"] < result.grad_norm


@pytest.mark.gpu
def test_8bit_adamw_steps():
    pytest.importorskip("bitsandbytes")
    model = TinyLM().cuda()
    opt = TrainOptimizer(make_adamw(model.parameters(), lr=1e-3, impl="8bit"))
    input_ids, labels = collate(make_sequences(0, 2))
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(*cross_entropy_sum(model(input_ids.cuda()), labels.cuda()))
    assert not opt.step().skipped
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.distributed
def test_ddp_and_fsdp2_accumulation_over_ranks_matches_single_process(tmp_path):
    """Invariant: 2 DDP or FSDP2 ranks with different micro-batch counts and token counts, no sync on
    non-final micro-batches, give the gradients of one process holding every sequence."""
    run_torchrun(Path(__file__).with_name("_dist_optim_worker.py"), tmp_path)
