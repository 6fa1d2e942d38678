"""The paths around the model, for the new families: PEFT adapters both ways (Phi-3's fused
``qkv_proj`` / ``gate_up_proj`` as PEFT targets them), DoRA, QLoRA (NF4), merged export into
``AutoModelForCausalLM``, activation checkpointing, and reward heads (``*ForSequenceClassification``)
both ways. Tiny checkpoints written by transformers (``test_families.hf_model``)."""

import copy

import pytest
import torch
from test_families import hf_model, ids, max_diff

from ftlib.lora import LoRAConfig, apply_lora, load_adapter, merge_and_unload, save_adapter, trainable_params
from ftlib.models import load_pretrained, load_reward_model, save_reward_model, score
from ftlib.train import save_merged

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

FAMILIES = ["qwen3", "gemma2", "gemma3", "phi3-partial-longrope-tied", "olmo2", "smollm3"]
TARGETS = {"phi3-partial-longrope-tied": ["qkv_proj", "gate_up_proj", "o_proj"]}
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    made = {}

    def get(case):
        if case not in made:
            path = tmp_path_factory.mktemp(case)
            hf_model(case).save_pretrained(path)
            made[case] = path
        return transformers.AutoModelForCausalLM.from_pretrained(made[case]).eval(), load_pretrained(made[case])
    return get


def _perturb(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainable_params(model).values():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("case", FAMILIES)
def test_adapters_both_ways(case, dora, pair, tmp_path):
    hf, ours = pair(case)
    targets = TARGETS.get(case, DEFAULT_TARGETS)
    apply_lora(ours, LoRAConfig(r=4, alpha=8, target_modules=targets, use_dora=dora), verbose=False)
    _perturb(ours)
    save_adapter(ours, tmp_path / "ftlib", task_type="CAUSAL_LM")
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ftlib").eval()
    x = ids()
    with torch.no_grad():
        assert max_diff(pm(x).logits, ours(x)) <= 1e-5
    pc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, use_dora=dora)
    pm2 = peft.get_peft_model(copy.deepcopy(hf), pc).eval()
    pm2.save_pretrained(tmp_path / "peft")
    _, fresh = pair(case)
    load_adapter(fresh, tmp_path / "peft")
    with torch.no_grad():
        # PEFT's own random adapter (init_lora_weights=False) moves logits to |z| ~ 3: the bound is 1e-5
        # relative to the logits' scale (fp32 summation order: PEFT adds the adapter after the base GEMM)
        want = pm2(x).logits
        tol = 1e-5 * max(1.0, float(want.abs().max()))
        assert max_diff(fresh(x), want) <= tol
    save_merged(fresh, tmp_path / "merged", dtype=torch.float32)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert max_diff(back(x).logits, want) <= tol


@pytest.mark.parametrize("case", ["qwen3", "gemma3", "phi3-partial-longrope-tied"])
def test_qlora_nf4_equals_its_dequantized_merge(case, pair):
    _, ours = pair(case)
    targets = TARGETS.get(case, DEFAULT_TARGETS)
    q = apply_lora(ours, LoRAConfig(r=4, alpha=8, target_modules=targets, quantize="nf4"), verbose=False)
    _perturb(q)
    want = merge_and_unload(copy.deepcopy(q), dtype=torch.float32)
    x = ids()
    with torch.no_grad():
        assert max_diff(q(x), want(x)) <= 1e-5


@pytest.mark.parametrize("case", ["gemma2", "olmo2", "phi3-partial-longrope-tied"])
def test_activation_checkpointing_same_grads(case, pair):
    _, ours = pair(case)
    x = ids()
    grads = []
    for every in (None, 1):
        ours.zero_grad()
        ours.set_gradient_checkpointing(every)
        ours(x).logsumexp(-1).sum().backward()
        grads.append({n: p.grad.clone() for n, p in ours.named_parameters()})
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


@pytest.mark.parametrize("case", ["qwen3", "gemma3", "phi3-partial-longrope-tied"])
def test_reward_head_both_ways(case, pair, tmp_path):
    hf, _ = pair(case)
    cls = getattr(transformers, type(hf).__name__.replace("ForCausalLM", "ForSequenceClassification"))
    if case == "gemma3":
        cls = transformers.Gemma3TextForSequenceClassification
    cfg = copy.deepcopy(hf.config)
    cfg.num_labels, cfg.pad_token_id = 1, 0
    torch.manual_seed(0)
    seq = cls(cfg).eval()
    seq.model.load_state_dict(hf.model.state_dict())
    seq.save_pretrained(tmp_path / "hf")
    ours = load_reward_model(tmp_path / "hf")
    x = ids()
    with torch.no_grad():
        want = seq(x).logits[:, 0]
        got = score(ours, x.tolist())
    assert max_diff(got, want) <= 1e-5
    save_reward_model(ours, tmp_path / "ours", pad_token_id=0)
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert max_diff(back(x).logits[:, 0], want) <= 1e-5


def test_softcapped_chunked_losses_match_full_logits():
    """chunked_cross_entropy / sequence_logprobs with Gemma-2's final soft-cap: value and both gradients
    equal autograd through capped full logits (float64, chunks smaller than the tokens)."""
    from ftlib.losses import chunked_cross_entropy
    from ftlib.preference import sequence_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 9, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(30, 8, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 30, (2, 9), generator=g)
    labels[0, :3] = -100
    cap = 1.5
    z = torch.tanh((h @ w.t()) / cap) * cap
    want = torch.nn.functional.cross_entropy(z[:, :-1].reshape(-1, 30), labels[:, 1:].reshape(-1), reduction="sum")
    gw = torch.autograd.grad(want, (h, w))
    got, n = chunked_cross_entropy(h, w, labels, chunk_size=4, softcap=cap)
    gg = torch.autograd.grad(got, (h, w))
    assert abs(got.item() - want.item()) < 1e-10 and int(n) == 14
    assert all((a - b).abs().max() < 1e-10 for a, b in zip(gg, gw))
    z = torch.tanh((h @ w.t()) / cap) * cap
    logp = torch.log_softmax(z[:, :-1], -1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    want_s = (logp * (labels[:, 1:] != -100)).sum(-1)
    gw = torch.autograd.grad(want_s.sum(), (h, w))
    got_s = sequence_logprobs(h, w, labels, chunk_size=4, softcap=cap).sum
    gg = torch.autograd.grad(got_s.sum(), (h, w))
    assert (got_s - want_s).abs().max() < 1e-10
    assert all((a - b).abs().max() < 1e-10 for a, b in zip(gg, gw))
    uncapped, _ = chunked_cross_entropy(h, w, labels, chunk_size=4)
    assert abs(uncapped.item() - want.item()) > 1e-3  # the cap is load-bearing here


def test_gemma2_training_loss_equals_transformers(pair):
    from ftlib.losses import causal_lm_loss

    hf, ours = pair("gemma2")
    x = ids()
    total, n = causal_lm_loss(ours, {"input_ids": x, "labels": x})
    with torch.no_grad():
        want = hf(x, labels=x).loss
    assert abs(total.item() / int(n) - want.item()) < 1e-5
