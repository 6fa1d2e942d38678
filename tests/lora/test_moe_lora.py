"""LoRA on stacked MoE experts against PEFT 0.21 (``target_parameters``), fp32 on tiny random checkpoints.

ftlib's adapter (random non-zero factors) loads in ``peft.PeftModel.from_pretrained`` with equal
logits and PEFT's (``init_lora_weights=False``) loads in ftlib with equal logits, for Qwen3-MoE,
Mixtral and Qwen2-MoE, with one or both stacked weights adapted (PEFT keys them by nesting depth);
merging keeps the logits; the grouped low-rank product equals the merged weight in float64 with
every gradient.
"""

import sys
from pathlib import Path

import pytest
import torch

from ftlib.lora import (
    LoRAConfig,
    apply_lora,
    disable_adapters,
    load_adapter,
    merge_and_unload,
    merge_lora,
    save_adapter,
    trainable_params,
    unmerge_lora,
)
from ftlib.lora.experts import ExpertLoRA, LoRAExperts, from_peft_layout, to_peft_layout
from ftlib.models import load_pretrained
from ftlib.models.moe import MoEExperts

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_moe import hf_model, ids, max_diff  # noqa: E402

BOTH = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
CASES = [("qwen3_moe", BOTH), ("mixtral", BOTH), ("qwen2_moe", BOTH), ("qwen3_moe", ["down_proj"]),
         ("mixtral", ["gate_up_proj"])]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_lora")
    made = {}

    def get(case):
        if case not in made:
            made[case] = root / case
            hf_model(case).save_pretrained(made[case])
        return made[case]
    return get


def _randomise(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize("case,params", CASES)
def test_ftlib_adapter_loads_in_peft_with_equal_logits(case, params, folders, tmp_path):
    ours = load_pretrained(folders(case))
    apply_lora(ours, LoRAConfig(r=3, alpha=7, target_modules=["q_proj", "v_proj"], target_parameters=params))
    _randomise(ours)
    x = ids()
    with torch.no_grad():
        mine = ours(x)
    save_adapter(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders(case)).eval()
    with torch.no_grad():
        base = hf(x).logits
    pm = peft.PeftModel.from_pretrained(hf, tmp_path).eval()
    with torch.no_grad():
        theirs = pm(x).logits
    assert max_diff(mine, theirs) <= 1e-5
    assert max_diff(mine, base) > 1e-2  # the adapter moves the logits


@pytest.mark.parametrize("case,params", CASES)
def test_peft_adapter_loads_in_ftlib_with_equal_logits_and_merges(case, params, folders, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders(case)).eval()
    cfg = peft.LoraConfig(r=2, lora_alpha=5, target_modules=["k_proj"], target_parameters=params,
                          init_lora_weights=False)
    torch.manual_seed(1)
    pm = peft.get_peft_model(hf, cfg).eval()
    x = ids()
    with torch.no_grad():
        want = pm(x).logits
    pm.save_pretrained(tmp_path)
    ours = load_adapter(load_pretrained(folders(case)), tmp_path)
    with torch.no_grad():
        assert max_diff(ours(x), want) <= 1e-5
        merge_lora(ours)
        assert max_diff(ours(x), want) <= 1e-5
        unmerge_lora(ours)
        assert max_diff(ours(x), want) <= 1e-5
        with disable_adapters(ours):  # the base model again
            assert max_diff(ours(x), load_pretrained(folders(case))(x)) <= 1e-5  # after unmerge: rounding
            assert max_diff(ours(x), want) > 1e-2
        merged = merge_and_unload(ours)
        assert not any(isinstance(m, LoRAExperts) for m in merged.modules())
        assert max_diff(merged(x), want) <= 1e-5


def test_merged_export_loads_in_transformers_and_unmerged_save_is_refused(folders, tmp_path):
    from ftlib.models import save_pretrained

    ours = load_pretrained(folders("qwen2_moe"))
    apply_lora(ours, LoRAConfig(r=2, target_modules=["o_proj", "gate_proj"], target_parameters=BOTH))
    _randomise(ours, seed=3)
    x = ids()
    with torch.no_grad():
        want = ours(x)
    with pytest.raises(ValueError, match="unmerged adapters"):
        save_pretrained(ours, tmp_path / "adapted")
    save_pretrained(merge_and_unload(ours), tmp_path / "merged")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert max_diff(back(x).logits, want) <= 1e-5


def test_nf4_leaves_unadapted_stacked_experts_unquantized_with_a_warning(folders):
    ours = load_pretrained(folders("qwen3_moe"))
    with pytest.warns(UserWarning, match="stacked expert weights .* not adapted and stay in full precision"):
        apply_lora(ours, LoRAConfig(target_modules=["q_proj"], quantize="nf4"))


def test_router_is_never_adapted_and_experts_only_config(folders):
    ours = load_pretrained(folders("qwen3_moe"))
    with pytest.raises(ValueError, match="names the router"):
        apply_lora(ours, LoRAConfig(target_parameters=["mlp.gate.weight"]))
    with pytest.raises(ValueError, match="matched no stacked expert weight"):
        apply_lora(ours, LoRAConfig(target_parameters=["mlp.experts.w1"]))
    with pytest.raises(ValueError, match="no dropout or DoRA"):
        apply_lora(ours, LoRAConfig(dropout=0.1, target_parameters=BOTH))
    apply_lora(ours, LoRAConfig(r=2, target_modules=[], target_parameters=BOTH))
    names = sorted(trainable_params(ours))
    assert names and all(".mlp.experts.adapters." in n for n in names)
    assert not any(".mlp.gate." in n for n in names)
    assert trainable_params(ours)["model.layers.0.mlp.experts.adapters.gate_up_proj.lora_A"].shape == (6, 2, 32)


def test_mlp_targets_on_an_moe_model_warn_that_routed_experts_are_missed(folders):
    ours = load_pretrained(folders("qwen2_moe"))
    with pytest.warns(UserWarning, match="routed experts"):
        apply_lora(ours, LoRAConfig(target_modules=["gate_proj", "up_proj", "down_proj"]))


def test_default_targets_are_attention_only(folders):
    ours = load_pretrained(folders("qwen3_moe"))
    apply_lora(ours, LoRAConfig())
    assert all(".self_attn." in n for n in trainable_params(ours))


def test_grouped_lora_equals_merged_weight_float64_with_gradients():
    torch.manual_seed(0)
    e, h, i, n, k, r = 4, 6, 5, 9, 2, 3
    base = MoEExperts(h, i, e, "silu").double()
    base.init_weights(0.5)
    adapters = {p: ExpertLoRA(e, *getattr(base, p).shape[1:], r, 6.0, dtype=torch.float64) for p in
                ("gate_up_proj", "down_proj")}
    for a in adapters.values():
        torch.nn.init.normal_(a.lora_B, std=0.5)
    wrapped = LoRAExperts(base, adapters)
    x = torch.randn(n, h, dtype=torch.float64)
    chosen = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    w = torch.rand(n, k, dtype=torch.float64)
    got = wrapped(x, chosen, w)
    merged = MoEExperts(h, i, e, "silu").double()
    with torch.no_grad():
        for p, a in adapters.items():
            getattr(merged, p).copy_(getattr(base, p) + a.scaling * torch.bmm(a.lora_B, a.lora_A))
    assert max_diff(got, merged(x, chosen, w)) <= 1e-12
    gy = torch.randn_like(got)
    for p, a in adapters.items():  # d/dA and d/dB through the grouped products vs through the merged weight
        dA, dB = torch.autograd.grad(wrapped(x, chosen, w), (a.lora_A, a.lora_B), gy)
        lora_a, lora_b = a.lora_A.detach().requires_grad_(), a.lora_B.detach().requires_grad_()
        ref = MoEExperts(h, i, e, "silu").double()
        params = {q: getattr(base, q).detach() for q in ("gate_up_proj", "down_proj")}
        for q, aa in adapters.items():
            fa, fb = (lora_a, lora_b) if q == p else (aa.lora_A.detach(), aa.lora_B.detach())
            params[q] = params[q] + aa.scaling * torch.bmm(fb, fa)
        out = torch.func.functional_call(ref, params, (x, chosen, w))
        rA, rB = torch.autograd.grad(out, (lora_a, lora_b), gy)
        assert max_diff(dA, rA) <= 1e-12 and max_diff(dB, rB) <= 1e-12


def test_peft_layout_round_trip_and_expert_order():
    a = ExpertLoRA(3, 4, 5, 2, 4.0)
    torch.nn.init.normal_(a.lora_B)
    lora_a, lora_b = to_peft_layout(a)
    assert lora_a.shape == (6, 5) and lora_b.shape == (4, 6)
    assert torch.equal(lora_a[2:4], a.lora_A[1])  # expert-major rows
    assert torch.equal(lora_b[:, 1], a.lora_B[1, :, 0])  # column j * E + e
    back_a, back_b = from_peft_layout(lora_a, lora_b, 3)
    assert torch.equal(back_a, a.lora_A) and torch.equal(back_b, a.lora_B)


def test_one_training_step_equals_peft_loss_and_every_adapter_gradient(tmp_path):
    """One step of a padded batch, fp32: loss = mean CE + coef x load-balancing loss (padding left out of
    the router statistics on both sides), LoRA on attention and on the stacked experts. The coefficient
    is raised to 0.5 so the router term moves the gradients (at 0.001 it would hide in rounding)."""
    from ftlib.lora.peft_io import adapter_state_dict
    from ftlib.losses import cross_entropy_sum
    from ftlib.models import RouterStats

    cfg = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
                                      num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                                      router_aux_loss_coef=0.5, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 0.1) + (1.0 if "norm" in name else 0.0))
    hf.save_pretrained(tmp_path / "base")
    ours = load_pretrained(tmp_path / "base")
    apply_lora(ours, LoRAConfig(r=3, alpha=7, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                target_parameters=BOTH))
    _randomise(ours, seed=5)  # B != 0: every factor gets a gradient
    save_adapter(ours, tmp_path / "adapter")
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True).train()

    x = ids(b=3, t=20)
    mask = torch.ones_like(x)
    mask[1, 13:] = 0  # right padding, as a padded batch holds it
    mask[2, 7:] = 0
    labels = torch.where(mask.bool(), x, -100)
    labels[:, :3] = -100  # a prompt without loss
    out = pm(input_ids=x, attention_mask=mask, labels=labels, output_router_logits=True)
    out.loss.backward()
    want = {k.replace(".default", ""): p.grad for k, p in pm.named_parameters() if p.requires_grad}

    ours.train()
    stats = RouterStats()
    s, n = cross_entropy_sum(ours(x, attention_mask=mask, router_stats=stats), labels)
    aux = stats.load_balancing_loss()
    loss = s / n + ours.config.router_aux_loss_coef * aux
    loss.backward()
    assert abs(float(aux.detach()) - float(out.aux_loss.detach())) <= 1e-6
    assert abs(float(loss.detach()) - float(out.loss.detach())) <= 1e-5
    with torch.no_grad():  # the gradients in PEFT's layout: each factor's value replaced by its gradient
        for p in trainable_params(ours).values():
            p.copy_(p.grad)
    got = adapter_state_dict(ours)
    assert sorted(got) == sorted(want) and any(".mlp.experts." in k for k in got)
    for k, g in got.items():
        scale = want[k].abs().max().item()
        assert scale > 0, k
        assert max_diff(g, want[k]) <= 1e-5 * max(1.0, scale), (k, max_diff(g, want[k]), scale)
