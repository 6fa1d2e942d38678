"""PEFT-format adapters: interoperability with peft both ways, merged export, bad files.

Skipped when transformers / peft are not installed (both are dev extras).
"""

import copy
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ftlib.lora import (
    LoRAConfig,
    apply_lora,
    load_adapter,
    lora_layers,
    merge_and_unload,
    save_adapter,
    trainable_params,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VARIANTS = {"lora": {}, "rslora": {"use_rslora": True}, "dora": {"use_dora": True}}


@pytest.fixture(scope="module")
def base():
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


IDS = torch.tensor([[3, 14, 15, 9, 26, 5, 35], [8, 9, 7, 9, 3, 2, 38]])


def _logits(model):
    with torch.no_grad():
        out = model(input_ids=IDS)
    return out.logits if hasattr(out, "logits") else out


def _perturb(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainable_params(model).values():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ftlib_adapter_loads_in_peft(base, variant, tmp_path):
    m = copy.deepcopy(base)
    save = ["lm_head"] if variant == "lora" else []
    apply_lora(m, LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             modules_to_save=save, **VARIANTS[variant]))
    _perturb(m)
    save_adapter(m, tmp_path, task_type="CAUSAL_LM")
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    torch.testing.assert_close(_logits(pm), _logits(m), atol=1e-5, rtol=1e-5)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["use_dora"] == (variant == "dora")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_peft_adapter_loads_in_ftlib(base, variant, tmp_path):
    pc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "o_proj", "up_proj"], init_lora_weights=False,
                         rank_pattern={"up_proj": 2} if variant == "lora" else {},
                         modules_to_save=["lm_head"] if variant == "rslora" else None, **VARIANTS[variant])
    pm = peft.get_peft_model(copy.deepcopy(base), pc).eval()
    with torch.no_grad():  # make the trained copy of lm_head differ from the base's
        for n, p in pm.named_parameters():
            if "modules_to_save" in n:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    pm.save_pretrained(tmp_path)
    m = load_adapter(copy.deepcopy(base), tmp_path).eval()
    assert len(list(lora_layers(m))) == 6
    torch.testing.assert_close(_logits(m), _logits(pm), atol=1e-5, rtol=1e-5)


def test_ftlib_round_trip_into_adapted_model(base, tmp_path):
    cfg = LoRAConfig(r=2, alpha=4, target_modules="all-linear", use_dora=True)
    m = apply_lora(copy.deepcopy(base), cfg)
    _perturb(m)
    save_adapter(m, tmp_path)
    fresh = apply_lora(copy.deepcopy(base), cfg)
    load_adapter(fresh, tmp_path)
    assert torch.equal(_logits(fresh), _logits(m))
    keys = set(load_file(tmp_path / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.mlp.gate_proj.lora_magnitude_vector" in keys
    assert all(k.startswith("base_model.model.model.layers.") for k in keys)


def test_qlora_adapter_loads_into_nf4_model(base, tmp_path):
    m = apply_lora(copy.deepcopy(base), LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    _perturb(m)
    save_adapter(m, tmp_path)
    q = load_adapter(copy.deepcopy(base), tmp_path, quantize="nf4", double_quant=True)
    want = merge_and_unload(copy.deepcopy(q), dtype=torch.float32)  # dequantized + merged reference
    torch.testing.assert_close(_logits(q), _logits(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_merged_export_reloads_in_transformers(base, tmp_path, quantize):
    m = apply_lora(copy.deepcopy(base), LoRAConfig(r=4, alpha=8, target_modules="all-linear", use_dora=True,
                                                  quantize=quantize))
    _perturb(m)
    if quantize is None:
        merged = merge_and_unload(m, dtype=torch.float32)
    else:
        merged = merge_and_unload(m).to(torch.bfloat16)  # QLoRA -> dequantize, merge, bf16 export
    assert not any(type(x).__module__.startswith("ftlib") for x in merged.modules())
    merged.save_pretrained(tmp_path)
    dtype = torch.float32 if quantize is None else torch.bfloat16
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    got = dict(reloaded.named_parameters())
    for name, p in merged.named_parameters():
        assert torch.equal(got[name], p), name
    # bf16: ``.to(bfloat16)`` also rounded the rotary inv_freq buffer, which a fresh load keeps in fp32
    tol = 0 if quantize is None else 2e-2
    torch.testing.assert_close(_logits(reloaded), _logits(merged), atol=tol, rtol=tol)


def test_bad_adapters(base, tmp_path):
    cfg = LoRAConfig(r=4, alpha=8, target_modules=["q_proj"])
    src = tmp_path / "good"
    save_adapter(apply_lora(copy.deepcopy(base), cfg), src)
    weights = load_file(src / "adapter_model.safetensors")
    conf = json.loads((src / "adapter_config.json").read_text())

    def write(name, w=weights, c=conf, raw=None):
        d = tmp_path / name
        d.mkdir()
        save_file(w, d / "adapter_model.safetensors")
        (d / "adapter_config.json").write_text(raw if raw is not None else json.dumps(c))
        return d

    # shapes that do not fit
    bad = dict(weights)
    k = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    bad[k] = torch.zeros(31, 4)
    plain = copy.deepcopy(base)
    with pytest.raises(ValueError, match=r"q_proj.lora_B.weight has shape \(31, 4\)"):
        load_adapter(plain, write("shape", w=bad))
    assert not list(lora_layers(plain)), "a refused adapter must leave the model untouched"
    # an adapter for another base: module names this model lacks
    other = {k.replace("self_attn.q_proj", "attn.c_attn"): v for k, v in weights.items()}
    with pytest.raises(ValueError, match="another base"):
        load_adapter(copy.deepcopy(base), write("other", w=other, c=dict(conf, target_modules=["c_attn"])))
    # extra tensors for modules the model lacks
    extra = dict(weights, **{"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)})
    with pytest.raises(ValueError, match="another base"):
        load_adapter(copy.deepcopy(base), write("extra", w=extra))
    # base name recorded in the config differs from the model's
    m = copy.deepcopy(base)
    m.config._name_or_path = "org/llama-a"
    with pytest.raises(ValueError, match="org/llama-b"):
        load_adapter(m, write("name", c=dict(conf, base_model_name_or_path="org/llama-b")))
    # missing tensors, bad json, missing fields, unsupported features, missing files
    with pytest.raises(ValueError, match="missing adapter tensors"):
        load_adapter(copy.deepcopy(base), write("missing", w={k: weights[k]}))
    with pytest.raises(ValueError, match="invalid JSON at line 1"):
        load_adapter(copy.deepcopy(base), write("json", raw="{not json"))
    with pytest.raises(ValueError, match="missing field 'r'"):
        load_adapter(copy.deepcopy(base), write("field", c={k2: v for k2, v in conf.items() if k2 != "r"}))
    with pytest.raises(ValueError, match="r must be a positive"):
        load_adapter(copy.deepcopy(base), write("rank", c=dict(conf, r=0)))
    with pytest.raises(ValueError, match="layers_to_transform"):
        load_adapter(copy.deepcopy(base), write("feature", c=dict(conf, layers_to_transform=[0])))
    with pytest.raises(ValueError, match="changes the base weights"):
        load_adapter(copy.deepcopy(base), write("pissa", c=dict(conf, init_lora_weights="pissa")))
    with pytest.raises(ValueError, match="peft_type"):
        load_adapter(copy.deepcopy(base), write("type", c=dict(conf, peft_type="IA3")))
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_adapter(copy.deepcopy(base), tmp_path / "nowhere")
    with pytest.raises(ValueError, match="matched no module"):
        load_adapter(nn.Sequential(nn.Linear(4, 4)), src)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_adapter(copy.deepcopy(base), tmp_path / "none")


def test_load_into_merged_model_is_refused(base, tmp_path):
    """Invariant: loading never changes adapters that are folded into the base weights (a later
    unmerge would subtract the new update from a weight holding the old one); the model is untouched."""
    from ftlib.lora import merge_lora, unmerge_lora

    cfg = LoRAConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj"], use_dora=True)
    m = apply_lora(copy.deepcopy(base), cfg)
    _perturb(m, seed=3)
    save_adapter(m, tmp_path)
    target = apply_lora(copy.deepcopy(base), cfg)
    _perturb(target, seed=4)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    merge_lora(target)
    merged = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(RuntimeError, match="merged"):
        load_adapter(target, tmp_path)
    assert all(torch.equal(v, merged[k]) for k, v in target.state_dict().items())
    unmerge_lora(target)
    for k, v in target.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=1e-5, rtol=1e-5)


# ---- tied embeddings (Qwen2 / Llama-3.2 style): what PEFT 0.21 does, both ways ----------------

TIED = {
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True)),
    "llama3.2": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})),
}


def _tied(arch):
    torch.manual_seed(0)
    m = TIED[arch]().eval()
    assert m.lm_head.weight is m.model.embed_tokens.weight
    return m


def _peft(base, tmp_path, **kw):
    """A PEFT adapter with every trainable tensor (LoRA B included) moved off its init, saved to tmp_path."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's warning about tied layers in the adapter
        pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **kw))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in pm.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    pm.eval().save_pretrained(tmp_path)
    return pm


TIED_CASES = {
    "modules_to_save": dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
    "modules_to_save+ensure_weight_tying": dict(target_modules=["q_proj"], modules_to_save=["lm_head"],
                                                ensure_weight_tying=True),
    "lora_on_tied_head": dict(target_modules=["q_proj", "lm_head"]),
}


@pytest.mark.parametrize("case", list(TIED_CASES))
@pytest.mark.parametrize("arch", list(TIED))
def test_tied_peft_adapter_loads_in_ftlib(arch, case, tmp_path):
    """PEFT -> ftlib on a tied model: the same logits as PEFT's model (PEFT trains an untied copy of a
    saved head; keeps it tied with ensure_weight_tying; LoRA on the head leaves the shared base)."""
    base = _tied(arch)
    pm = _peft(base, tmp_path, **TIED_CASES[case])
    emb = base.model.embed_tokens.weight.detach().clone()
    m = load_adapter(copy.deepcopy(base), tmp_path)
    torch.testing.assert_close(_logits(m), _logits(pm), atol=1e-5, rtol=1e-5)
    if case == "modules_to_save":
        assert torch.equal(m.model.embed_tokens.weight, emb) and m.lm_head.weight is not m.model.embed_tokens.weight
    if case == "lora_on_tied_head":  # merged, the model still computes the same; the embedding is untouched
        from ftlib.lora import merge_lora

        merge_lora(m)
        torch.testing.assert_close(_logits(m), _logits(pm), atol=1e-5, rtol=1e-5)
        assert torch.equal(m.model.embed_tokens.weight, emb)


@pytest.mark.parametrize("case", list(TIED_CASES))
@pytest.mark.parametrize("arch", list(TIED))
def test_tied_ftlib_adapter_loads_in_peft(arch, case, tmp_path):
    """ftlib -> PEFT on a tied model, after a training step: PEFT's model gives ftlib's logits."""
    base = _tied(arch)
    kw = TIED_CASES[case]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = apply_lora(copy.deepcopy(base), LoRAConfig(r=4, alpha=8, **kw))
    opt = torch.optim.SGD(trainable_params(m).values(), lr=0.5)
    for _ in range(2):  # a real step: B leaves zero, the saved head moves
        opt.zero_grad()
        m(input_ids=IDS).logits.logsumexp(-1).mean().backward()
        opt.step()
    save_adapter(m, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    torch.testing.assert_close(_logits(pm), _logits(m.eval()), atol=1e-5, rtol=1e-5)
    assert isinstance(pm, peft.PeftModelForCausalLM)  # task_type CAUSAL_LM by default
    untie_warned = any("training an untied copy" in str(w.message) for w in caught)
    assert untie_warned == (case == "modules_to_save")
    keys = set(load_file(tmp_path / "adapter_model.safetensors"))
    if "ensure_weight_tying" in kw:  # stored under both names, as PEFT writes it
        assert {"base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"} <= keys


@pytest.mark.parametrize("case", ["modules_to_save", "lora_on_tied_head"])
def test_tied_head_merged_export_reloads_in_transformers(case, tmp_path):
    """merge_and_unload leaves a trained head untied and says so in the config: transformers reloads
    the saved model with that head (a tied config would rebuild it from the embedding)."""
    base = _tied("qwen2")
    import warnings as w

    with w.catch_warnings():
        w.simplefilter("ignore")
        m = apply_lora(copy.deepcopy(base), LoRAConfig(r=4, alpha=8, **TIED_CASES[case]))
    _perturb(m)
    want = _logits(m)
    merged = merge_and_unload(m)
    assert merged.config.tie_word_embeddings is False
    merged.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(_logits(reloaded), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reloaded.model.embed_tokens.weight, base.model.embed_tokens.weight)


def test_ftlib_model_with_tied_head_exports_for_transformers(tmp_path):
    """ftlib's own Qwen2 (tied) with modules_to_save=["lm_head"]: merge_and_unload + save_pretrained
    give a checkpoint transformers loads to the same logits, in the model's own dtype."""
    from ftlib.models import LlamaConfig, LlamaForCausalLM, save_pretrained

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(model_type="qwen2", vocab_size=61, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         qkv_bias=True, tie_word_embeddings=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    _perturb(model)
    want = _logits(model)
    save_pretrained(merge_and_unload(model), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["dtype"] == "float32"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(_logits(reloaded), want, atol=1e-5, rtol=1e-5)


def test_adapter_records_its_base_and_task_type(tmp_path):
    """load_pretrained keeps its source; save_adapter writes it as base_model_name_or_path with
    task_type CAUSAL_LM, so PEFT's AutoPeftModelForCausalLM rebuilds base + adapter from the file."""
    from ftlib.models import LlamaConfig, LlamaForCausalLM, load_pretrained, save_pretrained

    torch.manual_seed(0)
    save_pretrained(LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
                    tmp_path / "base")
    m = apply_lora(load_pretrained(tmp_path / "base"), LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    _perturb(m)
    save_adapter(m, tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tmp_path / "base") and cfg["task_type"] == "CAUSAL_LM"
    pm = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    assert isinstance(pm, peft.PeftModelForCausalLM)
    torch.testing.assert_close(_logits(pm), _logits(m), atol=1e-5, rtol=1e-5)
    save_adapter(m, tmp_path / "plain", task_type=None)
    assert json.loads((tmp_path / "plain" / "adapter_config.json").read_text())["task_type"] is None


def test_peft_fields_are_read_by_an_allow_list(base, tmp_path):
    """Every field of a real PEFT 0.21 config is known; a feature ftlib does not implement (at any
    value but its off value), or an unknown field that is set, is refused naming the field."""
    pc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    peft.get_peft_model(copy.deepcopy(base), pc).save_pretrained(tmp_path / "real")
    real = json.loads((tmp_path / "real" / "adapter_config.json").read_text())
    load_adapter(copy.deepcopy(base), tmp_path / "real")  # every default field accepted
    for key, value in [("use_qalora", True), ("trainable_token_indices", [1, 2]),
                       ("lora_ga_config", {"bsz": 2}), ("eva_config", {"rho": 2.0}), ("kasa_config", {"beta": 0.1}),
                       ("layer_replication", [[0, 1]]), ("monteclora_config", {"n": 1}), ("fan_in_fan_out", True),
                       ("some_future_option", {"on": True})]:
        (tmp_path / key).mkdir()
        (tmp_path / key / "adapter_config.json").write_text(json.dumps(dict(real, **{key: value})))
        (tmp_path / key / "adapter_model.safetensors").write_bytes(
            (tmp_path / "real" / "adapter_model.safetensors").read_bytes())
        plain = copy.deepcopy(base)
        with pytest.raises(ValueError, match=f"field '{key}'=.* (is not supported by ftlib|is not one ftlib implements)"):
            load_adapter(plain, tmp_path / key)
        assert not list(lora_layers(plain))
    (tmp_path / "stacked").mkdir()  # target_parameters is read (MoE experts); on a dense model it names the entry
    (tmp_path / "stacked" / "adapter_config.json").write_text(json.dumps(dict(real, target_parameters=["mlp.w"])))
    (tmp_path / "stacked" / "adapter_model.safetensors").write_bytes(
        (tmp_path / "real" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="target_parameters entry 'mlp.w' matched no stacked expert weight"):
        load_adapter(copy.deepcopy(base), tmp_path / "stacked")
    (tmp_path / "newer").mkdir()
    (tmp_path / "newer" / "adapter_config.json").write_text(json.dumps(dict(real, some_future_option=None)))
    (tmp_path / "newer" / "adapter_model.safetensors").write_bytes(
        (tmp_path / "real" / "adapter_model.safetensors").read_bytes())
    load_adapter(copy.deepcopy(base), tmp_path / "newer")  # a newer PEFT's field, switched off


def test_base_name_check_compares_what_the_user_means(base, tmp_path):
    """A local copy of a hub model (same directory name) loads the hub model's adapter; a local
    directory named otherwise warns; two different hub ids are refused."""
    m = apply_lora(copy.deepcopy(base), LoRAConfig(r=2, alpha=4, target_modules=["q_proj"]))
    save_adapter(m, tmp_path / "a", base_model_name_or_path="meta-llama/Llama-3.2-1B")
    local = tmp_path / "models" / "Llama-3.2-1B"
    local.mkdir(parents=True)
    for name, expect in [(str(local), None), (str(tmp_path / "models" / "step-100"), UserWarning),
                         ("org/other", ValueError)]:
        b = copy.deepcopy(base)
        b.name_or_path = name
        if expect is None:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                load_adapter(b, tmp_path / "a")
        elif expect is UserWarning:
            with pytest.warns(UserWarning, match="trained on base 'meta-llama/Llama-3.2-1B'"):
                load_adapter(b, tmp_path / "a")
        else:
            with pytest.raises(ValueError, match="check_base=False"):
                load_adapter(b, tmp_path / "a")
