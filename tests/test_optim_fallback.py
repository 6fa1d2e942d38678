"""TrainOptimizer precision fallback: fp16 -> bf16 / fp32 after K overflow skips within W steps."""

import copy
import json
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ftlib.optim import TrainOptimizer, make_adamw, resolve_precision


class Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _batch(i):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def train_step(model, opt, i, overflow):
    """One window: forward under the wrapper's autocast, summed loss, an injected overflow if asked."""
    x, y = _batch(i)
    with opt.autocast():
        out = model(x)
    loss_sum = ((out.float() - y) ** 2).sum()
    opt.backward(loss_sum, y.numel())
    if overflow:
        model.a.weight.grad[0, 0] = float("inf")  # what an fp16 overflow leaves in a gradient
    return opt.step()


def reference_fallback_call(pattern, k, w):
    """Brute force: the first call n whose window (n - w, n] holds k skips; the switch applies from n + 1."""
    skips = [i for i, s in enumerate(pattern) if s]
    for n in skips:
        if sum(1 for j in skips if n - w < j <= n) >= k:
            return n + 1
    return None


@settings(max_examples=30, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=30), st.integers(1, 4), st.integers(0, 6),
       st.sampled_from(["bf16", "fp32"]))
def test_switch_happens_exactly_at_the_kth_skip_in_the_window(pattern, k, extra, fallback):
    """Invariant: the precision is fp16 (with loss scaling) up to and including the step that makes
    K skips within the last W steps, and the fallback (no scaler) from the next step on; never earlier."""
    w = k + extra
    model = Net()
    opt = TrainOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), precision="fp16", fallback=fallback,
                         fallback_after=k, fallback_window=w, init_scale=2.0**8)
    want = reference_fallback_call(pattern, k, w)
    for i, overflow in enumerate(pattern):
        in_fp16 = want is None or i < want
        assert opt.precision == ("fp16" if in_fp16 else fallback), i
        assert (opt.scaler is not None) == in_fp16
        with opt.autocast():
            dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32
        assert dtype == {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[opt.precision]
        result = train_step(model, opt, i, overflow)
        assert result.skipped == overflow
        assert result.precision == ("fp16" if want is None or i + 1 < want else fallback)
    assert opt.fell_back_at == want


@pytest.mark.parametrize("pattern, want", [
    ([True, False, False, True], None),  # 2 skips 3 calls apart: never both inside a window of 3
    ([True, False, True], 3),  # 2 skips within 3 calls: fp16 for calls 0-2, bf16 from call 3
    ([True, False, False, True, False, True], 6),  # the first skip left the window, the second and third count
])
def test_window_edges(pattern, want):
    model = Net()
    opt = TrainOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), precision="fp16", fallback="bf16",
                         fallback_after=2, fallback_window=3, init_scale=2.0**8)
    for i, overflow in enumerate(pattern):
        train_step(model, opt, i, overflow)
    assert opt.fell_back_at == want == reference_fallback_call(pattern, 2, 3)


def test_logged_once_and_recorded_in_the_state(caplog):
    model = Net()
    opt = TrainOptimizer(make_adamw(model.parameters(), lr=1e-3), precision="fp16", fallback="bf16",
                         fallback_after=2, fallback_window=3, init_scale=2.0**8)
    with caplog.at_level(logging.WARNING, logger="ftlib.optim"):
        for i, overflow in enumerate([True, False, True, True, True, False]):
            train_step(model, opt, i, overflow)
    msgs = [r.getMessage() for r in caplog.records if r.name == "ftlib.optim"]
    assert len(msgs) == 1 and "switching to bf16" in msgs[0] and "from step 3" in msgs[0], msgs
    state = opt.state_dict()
    assert state["precision"] == "bf16" and state["scaler"] is None
    assert state["fallback"] == {"requested_precision": "fp16", "to": "bf16", "skip_calls": [0, 2],
                                 "fell_back_at": 3}
    json.dumps(state["fallback"])  # plain values: fits a JSON train-state file
    assert opt.skipped_steps == 4  # skips after the switch still skip (non-finite), but no longer count


PATTERN = [False, True, False, True, False, False, True, False, False, True, True, False, False, False]


def _run(model, opt, start, stop):
    for i in range(start, stop):
        train_step(model, opt, i, PATTERN[i])


def _fresh(fallback="bf16"):
    model = Net()
    opt = TrainOptimizer(make_adamw(model.parameters(), lr=1e-2), precision="fp16", fallback=fallback,
                         fallback_after=3, fallback_window=6, init_scale=2.0**10, growth_interval=2)
    return model, opt


@pytest.mark.parametrize("split", [2, 5, 7, 11])
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(split):
    """A run stopped at ``split`` (before the fallback with skips pending, or after it) and resumed from
    its state dicts falls back at the same step and ends with bit-identical weights, on CPU."""
    model, opt = _fresh()
    _run(model, opt, 0, len(PATTERN))
    assert opt.fell_back_at == 7  # skips at 1, 3, 6: the third within 6 steps

    first, opt1 = _fresh()
    _run(first, opt1, 0, split)
    saved_model = copy.deepcopy(first.state_dict())
    saved_opt = copy.deepcopy(opt1.state_dict())  # as a checkpoint would: no shared tensors
    resumed, opt2 = _fresh()  # constructed exactly as at the start: fp16 with fallback
    resumed.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    assert opt2.precision == ("bf16" if split >= 7 else "fp16")
    _run(resumed, opt2, split, len(PATTERN))
    assert opt2.fell_back_at == 7 and opt2.precision == "bf16"
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    assert opt2.steps == opt.steps and opt2.skipped_steps == opt.skipped_steps


def test_fallen_back_state_refused_by_a_different_fallback():
    model, opt = _fresh("bf16")
    _run(model, opt, 0, 9)
    other, opt2 = _fresh("fp32")
    with pytest.raises(ValueError, match="precision='bf16'"):
        opt2.load_state_dict(copy.deepcopy(opt.state_dict()))


def test_auto_precision(monkeypatch):
    model = Net()
    opt = TrainOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), precision="auto")
    assert opt.precision == "bf16" and opt.scaler is None and opt.fallback is None  # CPU: bf16
    assert resolve_precision("cpu") == ("bf16", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert resolve_precision("cuda") == ("fp16", "fp32")  # a V100 / T4
    assert resolve_precision("cuda", fallback="fp32") == ("fp16", "fp32")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_precision("cuda") == ("bf16", None)


@pytest.mark.parametrize("kw, msg", [
    (dict(precision="bf16", fallback="fp32"), "applies to precision='fp16'"),
    (dict(precision="fp16", fallback="fp8"), "unknown fallback"),
    (dict(precision="fp16", fallback="fp32", fallback_after=5, fallback_window=4), "fallback_after <= fallback_window"),
    (dict(precision="fp16", fallback="fp32", fallback_after=0), "fallback_after"),
    (dict(precision="fp17"), "unknown precision"),
])
def test_bad_fallback_config_raises(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TrainOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1), **kw)
