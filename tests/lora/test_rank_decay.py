"""LoRA rank decay: output bound, exact gradient maps, optimizer continuity, budgets, PEFT files."""

import copy
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ftlib.lora import (
    ExponentialRank,
    LoRAConfig,
    LoRALinear,
    RankDecay,
    StepRanks,
    apply_lora,
    get_lora_config,
    load_adapter,
    lora_layers,
    lora_spectrum,
    merge_lora,
    save_adapter,
    shrink_lora,
    trainable_params,
)
from ftlib.losses import cross_entropy_sum
from ftlib.optim import TrainOptimizer


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()  # tiny tensors: threads only contend on a shared machine
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def delta(layer):
    """s B A in float64 (LoRALinear.delta_weight is fp32)."""
    return layer.scaling * (layer.lora_B.weight.detach().double() @ layer.lora_A.weight.detach().double())


def make_layer(out_f, in_f, r, seed=0, rslora=False, dtype=torch.float64):
    torch.manual_seed(seed)
    base = nn.Linear(in_f, out_f, dtype=dtype)
    layer = LoRALinear(base, r, alpha=2.0 * r if not rslora else 3.0, use_rslora=rslora, adapter_dtype=dtype)
    with torch.no_grad():  # a trained-looking update: B no longer zero, A moved off its init
        layer.lora_B.weight.normal_()
        layer.lora_A.weight.add_(0.3 * torch.randn_like(layer.lora_A.weight))
    return layer


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 24), st.integers(1, 24), st.integers(1, 8), st.data(), st.integers(0, 10_000), st.booleans())
def test_output_moves_by_at_most_the_discarded_singular_values(out_f, in_f, r, data, seed, rslora):
    """Invariant: after shrinking to k, every token's output moves by <= s sigma_{k+1} ||x||, the update's
    Frobenius change is s sqrt(sum of discarded sigma^2), and what is kept is dW's top-k spectrum
    (the best rank-k approximation), all without an [out, in] matrix inside shrink_lora."""
    k = data.draw(st.integers(1, r))
    layer = make_layer(out_f, in_f, r, seed, rslora)
    x = torch.randn(17, in_f, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    dw0 = delta(layer)
    full_sv = torch.linalg.svdvals(dw0)  # test-side reference only
    with torch.no_grad():
        y0 = layer(x)
        rep = shrink_lora(layer, k)
        y1 = layer(x)
    assert layer.r == k and layer.lora_A.weight.shape == (k, in_f) and layer.lora_B.weight.shape == (out_f, k)
    lim = rep.max_discarded * torch.linalg.vector_norm(x, dim=1)
    moved = torch.linalg.vector_norm(y1 - y0, dim=1)
    assert bool((moved <= lim * (1 + 1e-9) + 1e-10).all()), (moved - lim).max()
    dw1 = delta(layer)
    assert float(torch.linalg.matrix_norm(dw0 - dw1)) == pytest.approx(rep.discarded_frobenius, rel=1e-7, abs=1e-9)
    n = min(r, out_f, in_f)
    torch.testing.assert_close(torch.tensor(rep.singular_values[:n], dtype=torch.float64), full_sv[:n],
                               rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(torch.linalg.svdvals(dw1)[:min(k, n)], full_sv[:min(k, n)], rtol=1e-9, atol=1e-9)
    if k < n:
        assert rep.max_discarded == pytest.approx(float(full_sv[k]), rel=1e-9, abs=1e-12)


def _grads(layer, x, w):
    layer.zero_grad(set_to_none=True)
    (layer(x) * w).sum().backward()
    return layer.lora_A.weight.grad.clone(), layer.lora_B.weight.grad.clone()


@pytest.mark.parametrize("keep", [[0, 1, 2], [0, 2, 4], [1]])
def test_pending_gradients_are_mapped_exactly(keep):
    """The mapped gradients of the old factors equal the gradients taken at the new factors."""
    layer = make_layer(9, 11, 5, seed=3)
    x = torch.randn(13, 11, dtype=torch.float64)
    w = torch.randn(13, 9, dtype=torch.float64)
    _grads(layer, x, w)  # leaves .grad on both factors, as mid-window
    shrink_lora(layer, keep=keep)
    mapped = layer.lora_A.weight.grad.clone(), layer.lora_B.weight.grad.clone()
    fresh = _grads(layer, x, w)
    for m, f in zip(mapped, fresh):
        torch.testing.assert_close(m, f, rtol=1e-9, atol=1e-10)


def test_a_zero_update_keeps_a_live_a_factor():
    """A fresh adapter (B = 0): the shrunk A keeps LoRA's init scale, B stays 0, so training can proceed."""
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(8, 6), 4, 8.0)
    rms = float(layer.lora_A.weight.detach().norm()) / 2.0
    shrink_lora(layer, 2)
    assert torch.count_nonzero(layer.lora_B.weight) == 0
    norms = layer.lora_A.weight.norm(dim=1)
    torch.testing.assert_close(norms, torch.full((2,), rms), rtol=1e-5, atol=0)


class Toy(nn.Module):
    def __init__(self, d=16, vocab=13):
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(vocab, d)
        self.q_proj, self.down_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + torch.tanh(self.q_proj(h)).cumsum(1) / torch.arange(1, ids.shape[1] + 1)[None, :, None]
        return self.lm_head(h + self.down_proj(torch.relu(h)))


IDS = torch.randint(0, 13, (4, 12), generator=torch.Generator().manual_seed(0))


def _train(model, opt, steps, decay=None):
    losses = []
    for _ in range(steps):
        loss_sum, n = cross_entropy_sum(model(IDS), IDS)
        opt.zero_grad()
        (loss_sum / n).backward()
        opt.step()
        losses.append(float(loss_sum.detach() / n))
        if decay is not None:
            decay.step()
    return losses


@pytest.mark.parametrize("mode", ["project", "reset"])
def test_optimizer_keeps_working_without_being_rebuilt(mode):
    model = apply_lora(Toy(), LoRAConfig(r=6, alpha=12, target_modules=["q_proj", "down_proj"]), verbose=False)
    params = dict(trainable_params(model))
    opt = torch.optim.AdamW(params.values(), lr=1e-2)
    decay = RankDecay(model, StepRanks([(5, 3), (9, 2)]), optimizer=opt, optimizer_state=mode)
    _train(model, opt, 12, decay)
    assert decay.ranks() == {"q_proj": 2, "down_proj": 2}
    assert dict(trainable_params(model)) == params  # the same Parameter objects, now [2, in] / [out, 2]
    for name, p in params.items():
        state = opt.state[p]
        assert state["exp_avg"].shape == p.shape and state["exp_avg_sq"].shape == p.shape, name
        assert bool((state["exp_avg_sq"] >= 0).all())
    if mode == "reset":  # reset at step 9, then 3 more steps: Adam restarted its step counter
        assert float(opt.state[params["q_proj.lora_A.weight"]]["step"]) == 3
    else:
        assert float(opt.state[params["q_proj.lora_A.weight"]]["step"]) == 12


def test_unknown_optimizer_state_is_refused_before_any_change():
    model = apply_lora(Toy(), LoRAConfig(r=4, alpha=8, target_modules=["q_proj"]), verbose=False)
    opt = torch.optim.AdamW(trainable_params(model).values(), lr=1e-2)
    _train(model, opt, 1)
    p = model.q_proj.lora_A.weight
    opt.state[p]["state1"] = torch.zeros_like(p)  # e.g. a quantised moment
    with pytest.raises(ValueError, match="state1.*optimizer_state='reset'"):
        RankDecay(model, StepRanks([(1, 2)]), optimizer=opt).step()
    assert model.q_proj.r == 4 and p.shape == (4, 16)
    RankDecay(model, StepRanks([(1, 2)]), optimizer=opt, optimizer_state="reset").step()
    assert model.q_proj.r == 2 and p not in opt.state


def _tiny_llama(seed=0):
    from ftlib.models import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


@pytest.mark.parametrize("mode", ["project", "reset"])
def test_training_continues_lower_than_restarting_the_adapter(mode):
    """Train r=8 adapters for 40 steps, decay to r=2 and train 25 more: the loss ends well below a freshly
    initialised r=2 adapter trained for 25 steps (targets: a teacher = base + a rank-2 update per layer)."""
    base = _tiny_llama()
    with torch.no_grad():
        base.lm_head.weight.normal_(0.0, 2.0 / 32**0.5)  # logits of a trained-like range
    teacher = copy.deepcopy(base)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for mod in teacher.modules():
            if isinstance(mod, nn.Linear) and mod is not teacher.lm_head:
                out_f, in_f = mod.weight.shape
                mod.weight.add_(0.15 * torch.randn(out_f, 2, generator=g) @ torch.randn(2, in_f, generator=g))
    ids = torch.randint(0, 64, (8, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        labels = torch.full_like(ids, -100)
        labels[:, 1:] = teacher(ids)[:, :-1].argmax(-1)  # the teacher's next-token choices
    cfg = LoRAConfig(r=8, alpha=16, target_modules="all-linear")

    def run(model, steps, opt=None):
        opt = opt or TrainOptimizer(torch.optim.AdamW(trainable_params(model).values(), lr=1e-2))
        losses = []
        for _ in range(steps):
            opt.backward(*cross_entropy_sum(model(ids), labels))
            losses.append(opt.step().loss)
        return opt, losses

    model = apply_lora(copy.deepcopy(base), cfg, verbose=False)
    opt, before = run(model, 40)
    decay = RankDecay(model, StepRanks([(1, 2)]), optimizer=opt, optimizer_state=mode)
    reports = decay.step()
    assert {r.new_rank for r in reports} == {2} and len(reports) == 14
    _, after = run(model, 25, opt)
    restarted = apply_lora(copy.deepcopy(base), cfg.replace(r=2, alpha=4), verbose=False)
    _, fresh = run(restarted, 25)
    print(f"{mode}: loss at start {before[0]:.3f}, before the cut {before[-1]:.3f}, after it {after[0]:.3f}, "
          f"25 steps later {after[-1]:.3f}; a fresh r=2 adapter after 25 steps {fresh[-1]:.3f}")
    assert after[0] < 0.6 * before[0]  # the cut keeps part of what was learned
    assert after[-1] < 0.6 * fresh[-1], (after[-1], fresh[-1])


def test_schedules_and_patterns():
    s = ExponentialRank(0.5, r_end=2, every=10)
    assert [s(t, 16) for t in (0, 9, 10, 19, 20, 30, 40, 100)] == [16, 16, 8, 8, 4, 2, 2, 2]
    assert ExponentialRank(0.9, r_end=1)(1, 16) == 14  # floor(14.4)
    sr = StepRanks([(3, 6), (8, 2)])
    assert [sr(t, 8) for t in (0, 2, 3, 7, 8, 50)] == [8, 8, 6, 6, 2, 2]
    with pytest.raises(ValueError, match="never grows"):
        StepRanks([(1, 4), (2, 6)])
    with pytest.raises(ValueError, match="steps must increase"):
        StepRanks([(3, 4), (3, 2)])
    model = apply_lora(Toy(), LoRAConfig(r=8, alpha=16, target_modules=["q_proj", "down_proj"]), verbose=False)
    decay = RankDecay(model, StepRanks([(2, 4)]), patterns={"down_proj": StepRanks([(1, 3)]), "q_proj": None})
    assert list(decay.layers) == ["down_proj"]  # q_proj exempt
    assert decay.step() and decay.ranks() == {"down_proj": 3}
    assert decay.step() == [] and model.q_proj.r == 8


def test_budget_moves_rank_to_the_important_layer():
    model = apply_lora(Toy(), LoRAConfig(r=6, alpha=6, target_modules=["q_proj", "down_proj"]), verbose=False)
    with torch.no_grad():
        model.q_proj.lora_B.weight.normal_(std=10.0)  # q_proj's update dominates
        model.down_proj.lora_B.weight.normal_(std=0.01)
    decay = RankDecay(model, StepRanks([(1, 3)]), budget=True, min_rank=1)
    reps = {r.name: r for r in decay.step()}
    assert decay.ranks() == {"q_proj": 5, "down_proj": 1}  # a budget of 3 + 3, one kept for down_proj
    assert reps["q_proj"].kept == [0, 1, 2, 3, 4]


def test_sensitivity_importance_is_the_first_order_loss_change():
    """observe() scores component i by |s sigma_i u_i^T G v_i|, G = dL/d(dW): brute force with full matrices."""
    model = apply_lora(Toy(), LoRAConfig(r=4, alpha=8, target_modules=["q_proj"]), verbose=False)
    layer = model.q_proj
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    decay = RankDecay(model, StepRanks([(1, 2)]), importance="sensitivity", ema=0.0, budget=True)
    with pytest.raises(RuntimeError, match="needs observe"):
        decay.targets(1)
    captured = {}
    h = layer.register_forward_hook(lambda m, i, o: captured.update(x=i[0].detach(), y=o))
    loss_sum, n = cross_entropy_sum(model(IDS), IDS)
    h.remove()
    captured["y"].retain_grad()
    (loss_sum / n).backward()
    decay.observe()
    gy, x = captured["y"].grad.reshape(-1, 16).double(), captured["x"].reshape(-1, 16).double()
    g = gy.t() @ x  # (out, in) dL/dW_eff
    dw = delta(layer)
    u, s, vh = torch.linalg.svd(dw)
    brute = [abs(float(s[i] * (u[:, i] @ g @ vh[i]))) for i in range(4)]
    assert decay.layers["q_proj"].importance == pytest.approx(brute, rel=1e-5, abs=1e-9)


def test_refusals():
    dora = apply_lora(Toy(), LoRAConfig(r=4, alpha=8, target_modules=["q_proj"], use_dora=True), verbose=False)
    with pytest.raises(ValueError, match="DoRA"):
        RankDecay(dora, StepRanks([(1, 2)]))
    merged = merge_lora(apply_lora(Toy(), LoRAConfig(r=4, alpha=8, target_modules=["q_proj"]), verbose=False))
    with pytest.raises(RuntimeError, match="merged"):
        shrink_lora(merged.q_proj, 2)
    with pytest.raises(ValueError, match="no LoRA layer has a schedule"):
        RankDecay(Toy(), StepRanks([(1, 2)]))
    plain = apply_lora(Toy(), LoRAConfig(r=4, alpha=8, target_modules=["q_proj"]), verbose=False)
    with pytest.raises(ValueError, match=r"integer in \[1, 4\]"):
        shrink_lora(plain.q_proj, 5)


def test_state_round_trip_through_a_saved_adapter(tmp_path):
    model = apply_lora(Toy(), LoRAConfig(r=8, alpha=16, target_modules=["q_proj", "down_proj"]), verbose=False)
    sched = ExponentialRank(0.5, r_end=2, every=2)
    decay = RankDecay(model, sched)
    for _ in range(3):
        decay.step()
    save_adapter(model, tmp_path)
    state = json.loads(json.dumps(decay.state_dict()))
    resumed = load_adapter(Toy(), tmp_path)
    assert {n: layer.r for n, layer in lora_layers(resumed)} == {"q_proj": 4, "down_proj": 4}
    d2 = RankDecay(resumed, sched)
    d2.load_state_dict(state)
    for _ in range(3):
        decay.step(), d2.step()
    assert d2.ranks() == decay.ranks() == {"q_proj": 2, "down_proj": 2}
    with pytest.raises(ValueError, match="load the adapter saved with this state"):
        RankDecay(Toy_adapted(), sched).load_state_dict(state)


def Toy_adapted():
    return apply_lora(Toy(), LoRAConfig(r=8, alpha=16, target_modules=["q_proj", "down_proj"]), verbose=False)


# ---- PEFT interop ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rslora", [False, True])
def test_decayed_adapter_loads_in_peft_with_equal_logits(tmp_path, rslora):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).eval()
    model = apply_lora(copy.deepcopy(base), LoRAConfig(
        r=8, alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], rank_pattern={"down_proj": 6},
        use_rslora=rslora), verbose=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainable_params(model).values():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    decay = RankDecay(model, None, patterns={r"layers\.0\.self_attn\.q_proj": StepRanks([(1, 3)]),
                                             "v_proj": StepRanks([(1, 2)]), "down_proj": ExponentialRank(0.5)})
    decay.step()
    ranks = decay.ranks()
    assert ranks["model.layers.0.self_attn.q_proj"] == 3 and model.model.layers[1].self_attn.q_proj.r == 8
    assert ranks["model.layers.1.mlp.down_proj"] == 3 and ranks["model.layers.0.self_attn.v_proj"] == 2
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35], [8, 9, 7, 9, 3, 2, 38]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    save_adapter(model, tmp_path, task_type="CAUSAL_LM")
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["rank_pattern"][r"model\.layers\.0\.self_attn\.q_proj"] == 3
    assert "down_proj" not in saved["rank_pattern"]  # expanded: sorted first, it would shadow the decayed names
    s = 16 / (math.sqrt(6) if rslora else 6)  # down_proj started at rank 6 (the pattern), alpha 16
    want_alpha = s * (math.sqrt(3) if rslora else 3)
    assert saved["alpha_pattern"][r"model\.layers\.1\.mlp\.down_proj"] == pytest.approx(want_alpha)
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    back = load_adapter(copy.deepcopy(base), tmp_path).eval()
    assert get_lora_config(back).rank_pattern == get_lora_config(model).rank_pattern
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, want, atol=1e-6, rtol=1e-6)
    assert lora_spectrum(back.model.layers[0].self_attn.q_proj).shape == (3,)


def test_shrink_lora_then_save_adapter_writes_each_layers_rank(tmp_path):
    """shrink_lora on one layer, outside RankDecay: the file names that layer's rank and alpha,
    so PEFT and ftlib both load it and compute what the model computes."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).eval()
    model = apply_lora(copy.deepcopy(base), LoRAConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"]),
                       verbose=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainable_params(model).values():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    shrink_lora(model.model.layers[1].self_attn.v_proj, 3, name="model.layers.1.self_attn.v_proj")
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35], [8, 9, 7, 9, 3, 2, 38]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    save_adapter(model, tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["r"] == 8 and saved["rank_pattern"] == {r"model\.layers\.1\.self_attn\.v_proj": 3}
    assert saved["alpha_pattern"] == {r"model\.layers\.1\.self_attn\.v_proj": pytest.approx(6.0)}  # s = 2 kept
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    back = load_adapter(copy.deepcopy(base), tmp_path).eval()
    assert back.model.layers[1].self_attn.v_proj.r == 3 and back.model.layers[0].self_attn.v_proj.r == 8
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(back(input_ids=ids).logits, want, atol=1e-6, rtol=1e-6)
    load_adapter(model, tmp_path)  # into the shrunk model itself: the configs agree
