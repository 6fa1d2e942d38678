"""apply_lora on plain modules: targeting, freezing, gradients, disable, merge, QLoRA, LoRA+."""

import copy
import warnings

import pytest
import torch
from torch import nn

from ftlib.lora import (
    LoRAConfig,
    LoRALinear,
    NF4Linear,
    apply_lora,
    count_params,
    disable_adapters,
    lora_layers,
    merge_and_unload,
    merge_lora,
    trainable_params,
    unmerge_lora,
)
from ftlib.optim import param_groups


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d // 2, bias=False)
        self.o_proj = nn.Linear(d // 2, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.o_proj(torch.relu(self.v_proj(self.norm(self.q_proj(x)))))


class Toy(nn.Module):
    def __init__(self, d=64, vocab=11):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d), Block(d)])
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


@pytest.fixture
def toy():
    torch.manual_seed(0)
    return Toy()


IDS = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])


def _perturb(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B.weight.normal_(0, 0.1)
            if layer.use_dora:
                layer.lora_magnitude_vector.mul_(1.1)


def test_targets_by_suffix_regex_and_all_linear(toy):
    m = apply_lora(copy.deepcopy(toy), LoRAConfig(target_modules=["q_proj", "v_proj"]))
    assert sorted(n for n, _ in lora_layers(m)) == [f"layers.{i}.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")]
    m = apply_lora(copy.deepcopy(toy), LoRAConfig(target_modules=r"layers\.1\.(q|o)_proj"))
    assert sorted(n for n, _ in lora_layers(m)) == ["layers.1.o_proj", "layers.1.q_proj"]
    m = apply_lora(copy.deepcopy(toy), LoRAConfig(target_modules="all-linear"))
    assert len(list(lora_layers(m))) == 6 and isinstance(m.lm_head, nn.Linear)


def test_rank_and_alpha_patterns(toy):
    cfg = LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"],
                     rank_pattern={r"layers\.0\.q_proj": 2}, alpha_pattern={"v_proj": 3})
    m = apply_lora(toy, cfg)
    layers = dict(lora_layers(m))
    assert layers["layers.0.q_proj"].r == 2 and layers["layers.1.q_proj"].r == 4
    assert layers["layers.0.v_proj"].scaling == pytest.approx(3 / 4)
    assert layers["layers.0.q_proj"].scaling == pytest.approx(8 / 2)


@pytest.mark.parametrize("use_dora", [False, True])
def test_init_equals_base_and_merge_round_trip(toy, use_dora):
    ref = toy(IDS)
    m = apply_lora(copy.deepcopy(toy), LoRAConfig(target_modules="all-linear", use_dora=use_dora))
    assert torch.equal(m(IDS), ref)
    _perturb(m)
    m.eval()
    weights = {n: layer.base_layer.weight.detach().clone() for n, layer in lora_layers(m)}
    y = m(IDS)
    merge_lora(m)
    assert torch.allclose(m(IDS), y, atol=1e-5, rtol=0)
    unmerge_lora(m)
    for n, layer in lora_layers(m):
        assert torch.allclose(layer.base_layer.weight, weights[n], atol=1e-6, rtol=1e-6), n
    assert torch.allclose(m(IDS), y, atol=1e-5, rtol=0)


def test_only_adapters_and_modules_to_save_train(toy):
    m = apply_lora(toy, LoRAConfig(target_modules=["q_proj", "o_proj"], use_dora=True, modules_to_save=["lm_head"]))
    names = set(trainable_params(m))
    assert names == {f"layers.{i}.{p}.{t}" for i in (0, 1) for p in ("q_proj", "o_proj")
                     for t in ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")} | {"lm_head.weight"}
    opt = torch.optim.AdamW(trainable_params(m).values(), lr=1e-2)
    m(IDS).float().logsumexp(-1).mean().backward()
    opt.step()
    for n, p in m.named_parameters():
        if n in names:
            assert p.grad is not None, n
        else:
            assert p.grad is None and not p.requires_grad, f"frozen {n} got a gradient"
    state_ids = {id(p) for p in opt.state}
    assert state_ids == {id(p) for p in trainable_params(m).values()}
    c = count_params(m)
    assert c.trainable == sum(p.numel() for p in trainable_params(m).values())
    assert c.total == sum(p.numel() for p in m.parameters()) and 0 < c.fraction < 1
    assert "trainable params" in str(c)


def test_disable_adapters(toy):
    ref = toy(IDS)
    m = apply_lora(copy.deepcopy(toy), LoRAConfig(target_modules="all-linear", use_dora=True))
    _perturb(m)
    y = m(IDS)
    with disable_adapters(m):
        assert torch.equal(m(IDS), ref)
    assert torch.equal(m(IDS), y)
    merge_lora(m)
    with pytest.raises(RuntimeError, match="unmerge_lora"):
        with disable_adapters(m):
            pass


def test_disable_adapters_warns_about_modules_to_save(toy):
    m = apply_lora(toy, LoRAConfig(target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with pytest.warns(UserWarning, match="modules_to_save"):
        with disable_adapters(m):
            pass


def test_lora_plus_groups(toy):
    m = apply_lora(toy, LoRAConfig(target_modules=["q_proj"], use_dora=True, modules_to_save=["lm_head", "norm"]))
    groups = param_groups(m, lr=1e-4, lora_plus_ratio=16, weight_decay=0.1)
    setting = {n: (g["lr"], g["weight_decay"]) for g in groups for n in g["param_names"]}
    assert sorted(setting) == sorted(trainable_params(m))  # every trainable parameter exactly once
    for name, (lr, wd) in setting.items():
        want_lr = 1.6e-3 if "lora_B" in name else 1e-4
        want_wd = 0.0 if ("lora_magnitude_vector" in name or "norm" in name) else 0.1
        assert (lr, wd) == (pytest.approx(want_lr), want_wd), name
    assert any("lora_B" in n for n in setting) and any("lora_magnitude_vector" in n for n in setting)
    torch.optim.AdamW(groups)  # accepted by torch optimizers
    with pytest.raises(ValueError):
        param_groups(m, lr=1e-4, lora_plus_ratio=0)


@pytest.mark.parametrize("quantize_modules", ["targets", "all"])
def test_qlora(toy, quantize_modules):
    cfg = LoRAConfig(target_modules=["q_proj", "v_proj"], quantize="nf4", quantize_modules=quantize_modules,
                     double_quant=True, use_dora=True)
    m = apply_lora(copy.deepcopy(toy), cfg)
    kinds = {n: type(mod) for n, mod in m.named_modules()}
    assert kinds["layers.0.q_proj.base_layer"] is NF4Linear
    assert kinds["layers.0.o_proj"] is (NF4Linear if quantize_modules == "all" else nn.Linear)
    assert kinds["lm_head"] is nn.Linear  # skipped by default
    # the quantized model at init equals the model with dequantized weights
    deq = copy.deepcopy(m)
    merge_and_unload(deq, dtype=None)
    assert not any(isinstance(x, (NF4Linear, LoRALinear)) for x in deq.modules())
    assert torch.allclose(m(IDS), deq(IDS), atol=1e-5)
    _perturb(m)
    loss = m(IDS).pow(2).mean()
    loss.backward()
    assert all(p.grad is None for n, p in m.named_parameters() if not p.requires_grad)
    assert all(p.grad is not None for p in trainable_params(m).values())
    with pytest.raises(RuntimeError, match="merge_and_unload"):
        merge_lora(m)
    y = m(IDS)
    out = merge_and_unload(m, dtype=torch.float32)
    assert all(type(x) is not NF4Linear for x in out.modules())
    assert torch.allclose(out(IDS), y, atol=1e-5)


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_merge_and_unload_keeps_the_base_dtype(toy, base_dtype, quantize):
    """Default: every merged (or dequantized) layer in its base's dtype, so the model stays one dtype
    and runs; an fp32 model is not left half bf16."""
    m = apply_lora(toy.to(base_dtype), LoRAConfig(target_modules=["q_proj", "v_proj"], quantize=quantize,
                                                  quantize_modules="all"))
    _perturb(m)
    y = m(IDS)
    merge_and_unload(m)
    assert {p.dtype for p in m.parameters()} == {base_dtype}
    assert type(m.layers[0].q_proj) is nn.Linear and type(m.layers[0].o_proj) is nn.Linear
    tol = 1e-5 if base_dtype == torch.float32 else 5e-2
    torch.testing.assert_close(m(IDS), y, atol=tol, rtol=tol)


def test_merge_and_unload_dtype_converts_the_whole_model(toy):
    """A dtype converts every floating parameter and persistent buffer (ties kept), leaving
    non-persistent buffers (e.g. a RoPE inv_freq in fp32) alone."""
    toy.lm_head.weight = toy.embed.weight  # tied
    toy.register_buffer("scale", torch.ones(3))
    toy.register_buffer("inv_freq", torch.ones(3), persistent=False)
    m = apply_lora(toy, LoRAConfig(target_modules=["q_proj"]))
    _perturb(m)
    y = m(IDS)
    merge_and_unload(m, dtype=torch.bfloat16)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert m.scale.dtype == torch.bfloat16 and m.inv_freq.dtype == torch.float32
    assert m.lm_head.weight is m.embed.weight
    torch.testing.assert_close(m(IDS).float(), y, atol=5e-2, rtol=5e-2)


class TiedConfig:
    tie_word_embeddings = True


def _tied_toy():
    torch.manual_seed(0)
    m = Toy()
    m.lm_head.weight = m.embed.weight
    m.config = TiedConfig()
    return m


def test_modules_to_save_on_a_tied_head_trains_an_untied_copy():
    """As PEFT: the head trains its own copy, the embedding keeps the frozen original; with
    ensure_weight_tying the shared matrix trains for both."""
    m = _tied_toy()
    emb = m.embed.weight.detach().clone()
    with pytest.warns(UserWarning, match=r"lm_head.weight is tied to \['embed.weight'\]; training an untied copy"):
        apply_lora(m, LoRAConfig(target_modules=["q_proj"], modules_to_save=["lm_head"]))
    assert m.lm_head.weight is not m.embed.weight and not m.embed.weight.requires_grad
    assert "lm_head.weight" in trainable_params(m) and "embed.weight" not in trainable_params(m)
    assert m.config.tie_word_embeddings is False  # a later tie_weights() must not overwrite the trained head
    opt = torch.optim.SGD(trainable_params(m).values(), lr=1.0)
    m(IDS).logsumexp(-1).mean().backward()
    opt.step()
    assert torch.equal(m.embed.weight, emb) and not torch.equal(m.lm_head.weight, emb)

    m = _tied_toy()
    apply_lora(m, LoRAConfig(target_modules=["q_proj"], modules_to_save=["lm_head"], ensure_weight_tying=True))
    assert m.lm_head.weight is m.embed.weight and m.embed.weight.requires_grad
    assert m.config.tie_word_embeddings is True
    opt = torch.optim.SGD(trainable_params(m).values(), lr=1.0)
    m(IDS).logsumexp(-1).mean().backward()
    opt.step()
    assert not torch.equal(m.embed.weight, emb)


def test_lora_on_a_tied_head_merges_without_touching_the_embedding():
    """Invariant: merging computes what the adapted model computed; the embedding never takes the
    head's update; unmerge re-ties exactly; merge_and_unload leaves the head untied."""
    m = _tied_toy()
    emb = m.embed.weight.detach().clone()
    apply_lora(m, LoRAConfig(target_modules=["lm_head", "q_proj"]))
    _perturb(m)
    y = m(IDS)
    merge_lora(m)
    assert torch.equal(m.embed.weight, emb)
    torch.testing.assert_close(m(IDS), y, atol=1e-5, rtol=1e-6)  # logits ~75: a few fp32 ulps
    assert "lm_head._ftlib_tied_base" not in dict(m.named_parameters())
    unmerge_lora(m)
    assert m.lm_head.base_layer.weight is m.embed.weight and torch.equal(m.embed.weight, emb)
    torch.testing.assert_close(m(IDS), y, atol=1e-5, rtol=1e-6)
    merge_lora(m)  # merged, then exported
    merge_and_unload(m)
    assert type(m.lm_head) is nn.Linear and m.lm_head.weight is not m.embed.weight
    assert torch.equal(m.embed.weight, emb) and m.config.tie_word_embeddings is False
    torch.testing.assert_close(m(IDS), y, atol=1e-5, rtol=1e-6)
    with pytest.raises(ValueError, match="ensure_weight_tying=True with a LoRA target 'lm_head'.*lora_embedding_A/B"):
        apply_lora(_tied_toy(), LoRAConfig(target_modules=["lm_head"], ensure_weight_tying=True))


def test_bad_input(toy):
    with pytest.raises(ValueError, match="matched no module"):
        apply_lora(copy.deepcopy(toy), LoRAConfig(target_modules=["qkv_proj"]))
    with pytest.raises(ValueError, match="modules_to_save"):
        apply_lora(copy.deepcopy(toy), LoRAConfig(target_modules=["q_proj"], modules_to_save=["head"]))
    with pytest.raises(TypeError, match="embed' is an Embedding; ftlib adapts linear layers only"):
        apply_lora(copy.deepcopy(toy), LoRAConfig(target_modules=["embed"]))
    with pytest.raises(TypeError, match="only linear"):
        apply_lora(copy.deepcopy(toy), LoRAConfig(target_modules=["norm"]))
    for bad in (dict(r=0), dict(r=-2), dict(r=True), dict(r=2.0), dict(dropout=1.0), dict(alpha=0), dict(rank_pattern={"q": 0}),
                dict(init="xavier"), dict(quantize="int8"), dict(target_modules=[])):
        with pytest.raises(ValueError):
            LoRAConfig(**bad)
    m = apply_lora(copy.deepcopy(toy), LoRAConfig(target_modules=["q_proj"]))
    with pytest.raises(RuntimeError, match="already"):
        apply_lora(m, LoRAConfig(target_modules=["v_proj"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with disable_adapters(m):  # no modules_to_save: no warning
            pass


@pytest.mark.parametrize("cfg", [
    LoRAConfig(r=8, alpha=16, target_modules="all-linear"),
    LoRAConfig(r=8, alpha=16, target_modules="all-linear", use_dora=True, quantize="nf4", double_quant=True),
], ids=["lora", "qdora"])
def test_training_reduces_loss(toy, cfg):
    # a tiny fitting run: adapters alone must be able to fit a fixed batch
    m = apply_lora(toy, cfg)
    opt = torch.optim.AdamW(param_groups(m, lr=1e-2, lora_plus_ratio=4))
    targets = torch.tensor([[2, 3, 4, 5, 6], [7, 8, 9, 10, 1]])
    losses = []
    for _ in range(40):
        loss = nn.functional.cross_entropy(m(IDS).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses[::8]


def test_qlora_frees_each_full_precision_weight_as_it_goes(monkeypatch):
    """Invariant (memory at 8B scale): while apply_lora quantizes target k, the full-precision
    weights of targets 0..k-1 are already unreachable, so the peak is one model plus one layer,
    not the full-precision model plus its NF4 copy."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = Toy()
    seen: list[weakref.ref] = []
    alive_at_call: list[int] = []
    real = NF4Linear.from_linear.__func__

    def spy(cls, linear, **kw):
        gc.collect()
        alive_at_call.append(sum(r() is not None for r in seen))
        seen.append(weakref.ref(linear.weight))
        return real(cls, linear, **kw)

    monkeypatch.setattr(NF4Linear, "from_linear", classmethod(spy))
    apply_lora(model, LoRAConfig(target_modules=["q_proj", "v_proj", "o_proj"], quantize="nf4"))
    assert len(alive_at_call) == 6
    assert alive_at_call == [0] * 6, alive_at_call


def test_merge_and_unload_frees_each_replaced_layer(monkeypatch):
    """Invariant (memory at 8B scale): while merge_and_unload builds layer k's merged weight, the
    base weights of layers 0..k-1 are unreachable, so exporting a bf16 model peaks near one model,
    not two."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = apply_lora(Toy(), LoRAConfig(target_modules=["q_proj", "v_proj", "o_proj"], use_dora=True))
    seen: list[weakref.ref] = []
    alive_at_call: list[int] = []
    real = LoRALinear.to_linear

    def spy(self, dtype=None):
        gc.collect()
        alive_at_call.append(sum(r() is not None for r in seen))
        seen.append(weakref.ref(self.base_layer.weight))
        return real(self, dtype)

    monkeypatch.setattr(LoRALinear, "to_linear", spy)
    merge_and_unload(model, dtype=torch.float32)
    assert alive_at_call == [0] * 6, alive_at_call


def test_qlora_names_the_layer_with_a_non_finite_weight(toy):
    with torch.no_grad():
        toy.layers[1].v_proj.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match="layers.1.v_proj.*non-finite"):
        apply_lora(toy, LoRAConfig(target_modules=["q_proj", "v_proj"], quantize="nf4"))
