"""QLoRA on the stacked MoE experts: NF4 stacks per expert, LoRA on top, fp32 on tiny random checkpoints.

The quantized model equals (logits and every adapter gradient) the same adapters on a model whose
weights were replaced by their NF4 round trip computed independently (``nf4_ref`` on each expert's
slice); ``merge_and_unload`` gives the dequantized-merge model with the same logits; the expert weights
take 0.5 byte/param + one fp32 scale per 64 values (double quantization: one byte per 64 + a little).
"""

import math
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from ftlib.kernels.nf4_ref import dequantize_nf4, quantize_nf4
from ftlib.lora import LoRAConfig, apply_lora, merge_and_unload, merge_lora, save_adapter, trainable_params
from ftlib.lora.experts import LoRAExperts
from ftlib.lora.nf4 import NF4Linear
from ftlib.lora.nf4_experts import NF4Experts, NF4Stack
from ftlib.models import load_pretrained

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_moe import hf_model, ids, max_diff  # noqa: E402

BOTH = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTN = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("nf4_experts")
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


def _round_trip(w, blocksize=64):
    """NF4 round trip of a [out, in] weight, from the reference math."""
    codes, absmax = quantize_nf4(w, blocksize)
    return dequantize_nf4(codes, absmax, w.shape, torch.float32, blocksize)


@pytest.mark.parametrize("case,params,double_quant", [("qwen3_moe", BOTH, False), ("mixtral", ["gate_up_proj"], True),
                                                      ("qwen2_moe", BOTH, False)])
def test_qlora_experts_equal_lora_on_the_dequantized_base(case, params, double_quant, folders):
    cfg = LoRAConfig(r=3, alpha=7, target_modules=ATTN, target_parameters=params, quantize="nf4",
                     double_quant=double_quant)
    q = load_pretrained(folders(case))
    with pytest.warns(UserWarning, match="stay in full precision") if len(params) == 1 else nullcontext():
        apply_lora(q, cfg)
    _randomise(q, seed=2)
    stacks = [m for m in q.modules() if isinstance(m, NF4Stack)]
    assert stacks and all(isinstance(m.base_layer, NF4Experts) for m in q.modules() if isinstance(m, LoRAExperts))

    # the reference: plain LoRA on a model whose quantized weights are replaced by their NF4 round trip
    # (single quantization: from the reference math on the original weights; double: the layers' own
    # values, the 8-bit absmax being checked against bitsandbytes in test_nf4.py)
    ref, fp32 = load_pretrained(folders(case)), load_pretrained(folders(case))
    with torch.no_grad():
        for name, mod in q.named_modules():
            if isinstance(mod, NF4Experts):
                target = ref.get_submodule(name.removesuffix(".base_layer"))
                for p in mod.quantized():
                    w = getattr(target, p)
                    w.copy_(getattr(mod, p).dequantize(torch.float32) if double_quant
                            else torch.stack([_round_trip(w[e]) for e in range(w.shape[0])]))
            elif isinstance(mod, NF4Linear) and name.endswith(".base_layer"):  # the adapted attention layers
                w = ref.get_submodule(name.removesuffix(".base_layer")).weight
                w.copy_(mod.dequantize(torch.float32) if double_quant else _round_trip(w))
    apply_lora(ref, cfg.replace(quantize=None))
    apply_lora(fp32, cfg.replace(quantize=None))
    with torch.no_grad():
        for (n, p), (n2, p2), (_, p3) in zip(trainable_params(q).items(), trainable_params(ref).items(),
                                             trainable_params(fp32).items()):
            assert n == n2
            p2.copy_(p)
            p3.copy_(p)
    x = ids()
    got, want = q(x), ref(x)
    assert max_diff(got, want) <= 1e-5
    assert max_diff(got, fp32(x)) > 1e-3  # the quantization is there
    gy = torch.randn_like(got)
    got.backward(gy)
    want.backward(gy)
    for (n, p), p2 in zip(trainable_params(q).items(), trainable_params(ref).values()):
        assert max_diff(p.grad, p2.grad) <= 1e-5 * max(1.0, p2.grad.abs().max().item()), n
    assert any(".mlp.experts.adapters." in n and p.grad.abs().max() > 0 for n, p in trainable_params(q).items())

    with torch.no_grad():  # the dequantized-merge model: same logits, no NF4 left
        merged = merge_and_unload(q)
        assert not any(isinstance(m, (NF4Stack, NF4Experts, LoRAExperts)) for m in merged.modules())
        assert max_diff(merged(x), want) <= 1e-5


@pytest.mark.parametrize("double_quant", [False, True])
def test_expert_weights_take_half_a_byte_per_param_plus_scales(double_quant, folders):
    q = load_pretrained(folders("qwen3_moe"))
    apply_lora(q, LoRAConfig(r=2, target_modules=ATTN, target_parameters=BOTH, quantize="nf4",
                             double_quant=double_quant))
    frozen = [n for n, p in q.named_parameters() if p.is_floating_point() and p.dim() == 3 and not p.requires_grad]
    assert not frozen  # no stacked fp32 base weight left (the 3-D trainable ones are the expert LoRA factors)
    for stack in [m for m in q.modules() if isinstance(m, NF4Stack)]:
        e, o, i = stack.shape
        n, nb = o * i, math.ceil(o * i / 64)
        per_expert = n // 2 + (nb + 4 * math.ceil(nb / 256) + 4 + 4 * 256 if double_quant else 4 * nb)
        assert stack.nbytes() == e * per_expert
        assert stack.nbytes() / (e * n) <= (0.5 + 1 / 64 + (4 * 261) / n if double_quant else 0.5 + 4 / 64) + 1e-12


def test_quantize_modules_all_quantizes_unadapted_experts_and_merge_in_place_is_refused(folders, tmp_path):
    q = load_pretrained(folders("qwen3_moe"))
    apply_lora(q, LoRAConfig(r=2, target_modules=ATTN, quantize="nf4", quantize_modules="all"))
    assert all(m.quantized() == ["gate_up_proj", "down_proj"] for m in q.modules() if isinstance(m, NF4Experts))
    assert any(isinstance(m, NF4Experts) for m in q.modules())
    q = load_pretrained(folders("qwen3_moe"))
    with pytest.warns(UserWarning, match="stay in full precision"):
        apply_lora(q, LoRAConfig(r=2, target_modules=ATTN, quantize="nf4"))
    assert not any(isinstance(m, NF4Experts) for m in q.modules())
    q = load_pretrained(folders("qwen3_moe"))
    apply_lora(q, LoRAConfig(r=2, target_modules=ATTN, target_parameters=BOTH, quantize="nf4"))
    with pytest.raises(RuntimeError, match="NF4"):
        merge_lora(q)
    save_adapter(q, tmp_path)  # the adapter file does not depend on the base's storage
    plain = load_pretrained(folders("qwen3_moe"))
    apply_lora(plain, LoRAConfig(r=2, target_modules=ATTN, target_parameters=BOTH))
    from ftlib.lora import load_adapter

    load_adapter(plain, tmp_path)
    again = load_adapter(load_pretrained(folders("qwen3_moe")), tmp_path, quantize="nf4")  # a PEFT file onto QLoRA
    assert any(isinstance(m, NF4Experts) for m in again.modules())
    for (n, p), p2, p3 in zip(trainable_params(q).items(), trainable_params(plain).values(),
                              trainable_params(again).values()):
        assert torch.equal(p, p2) and torch.equal(p, p3), n
    x = ids()
    with torch.no_grad():
        assert max_diff(again(x), q(x)) == 0.0


def test_nf4_grouped_product_under_bf16_autocast_matches_fp32_and_trains(folders):
    q = load_pretrained(folders("qwen3_moe"))
    apply_lora(q, LoRAConfig(r=2, alpha=4, target_modules=ATTN, target_parameters=BOTH, quantize="nf4"))
    _randomise(q, seed=4)
    x = ids()
    with torch.no_grad():
        want = q(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = q(x)
    rel = max_diff(got, want) / want.abs().max().item()
    assert rel <= 0.05, rel  # bf16 GEMMs on the dequantized experts
    got.float().square().mean().backward()
    grads = {n: p.grad for n, p in trainable_params(q).items() if ".mlp.experts." in n}
    assert grads and all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())
