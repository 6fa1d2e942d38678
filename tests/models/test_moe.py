"""Mixture-of-experts families against transformers 5.25 on tiny random checkpoints (fp32, CPU).

Per case (``CASES``: Qwen3-MoE with and without ``norm_topk_prob``, a window and dense layers;
Mixtral with and without a window; Qwen2-MoE with its shared expert and ``decoder_sparse_step``):
a checkpoint saved by transformers (per-expert hub tensors) loads in ftlib with max |d logits| and
|d aux loss| <= 1e-5, ftlib's sharded save loads in ``AutoModelForCausalLM`` with the same logits,
a packed row equals its documents run alone (logits, and the load-balancing loss equals
transformers' over the documents' tokens), and greedy decoding equals transformers' for 32 tokens.
Weights are drawn wide so each routed term moves the logits: ``test_feature_is_load_bearing``
switches one feature off and sees the parity fail.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ftlib.models import generate, load_config, load_pretrained, save_pretrained
from ftlib.models.config import LlamaConfig
from ftlib.models.moe import MoEExperts, RouterStats, grouped_linear

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
Q_MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16)
T = 24

CASES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(Q_MOE, head_dim=16)),
    "qwen3_moe-norm-window-dense": ("Qwen3MoeConfig", dict(Q_MOE, head_dim=16, norm_topk_prob=True,
                                                            use_sliding_window=True, sliding_window=8,
                                                            mlp_only_layers=[1], attention_bias=True)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=16)),
    "mixtral-window": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=3, intermediate_size=16,
                                             sliding_window=8)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(Q_MOE, shared_expert_intermediate_size=24, decoder_sparse_step=2)),
    "qwen2_moe-norm": ("Qwen2MoeConfig", dict(Q_MOE, shared_expert_intermediate_size=24, norm_topk_prob=True,
                                              num_experts_per_tok=3)),
}


def hf_model(case):
    cfg_name, extra = CASES[case]
    cfg = getattr(transformers, cfg_name)(**{**TINY, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # wide random weights: every expert's term moves the logits
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 0.1) + (1.0 if "norm" in name else 0.0))
    return model


def ids(b=2, t=T, seed=1):
    return torch.randint(3, TINY["vocab_size"], (b, t), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    made = {}

    def get(case):
        if case not in made:
            made[case] = root / case
            hf_model(case).save_pretrained(made[case])
        return made[case]
    return get


def hf_aux(hf, x, attention_mask=None):
    out = hf(x, attention_mask=attention_mask, output_router_logits=True)
    return out.logits, out.aux_loss


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_aux_loss_match_transformers_both_ways(case, folders, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders(case)).eval()
    ours = load_pretrained(folders(case))
    x = ids()
    stats = RouterStats()
    with torch.no_grad():
        want, want_aux = hf_aux(hf, x)
        got = ours(x, router_stats=stats)
    assert max_diff(got, want) <= 1e-5, (case, max_diff(got, want))
    assert abs(stats.load_balancing_loss().item() - want_aux.item()) <= 1e-5
    assert len(stats.logits) == sum(ours.config.layer_is_moe(i) for i in range(3))
    files = save_pretrained(ours, tmp_path, max_shard_size="30KB")
    assert len(files) > 3  # sharded, with an index
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        assert max_diff(back(x).logits, want) <= 1e-5


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_padded_batch_aux_loss_counts_real_tokens_only(case, folders):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders(case)).eval()
    ours = load_pretrained(folders(case))
    x = ids()
    mask = torch.ones_like(x)
    mask[0, :7] = 0  # left padding
    stats = RouterStats()
    with torch.no_grad():
        want, want_aux = hf_aux(hf, x, mask)
        got = ours(x, attention_mask=mask, router_stats=stats)
    real = mask.bool()
    assert max_diff(got[real], want[real]) <= 1e-5
    assert abs(stats.load_balancing_loss().item() - want_aux.item()) <= 1e-5
    unmasked = RouterStats(token_mask=torch.ones_like(mask))
    with torch.no_grad():
        ours(x, attention_mask=mask, router_stats=unmasked)
    assert abs(unmasked.load_balancing_loss().item() - want_aux.item()) > 1e-4  # the pads would count


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_row_equals_documents_alone(case, folders):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders(case)).eval()
    ours = load_pretrained(folders(case))
    lens = [9, 1, 14]  # one document longer than the windows
    row = ids(1, sum(lens), seed=2)
    cu = torch.tensor([0, 9, 10, 24], dtype=torch.int32)
    stats = RouterStats()
    docs = [row[:, s:e] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    with torch.no_grad():
        packed = ours(row, cu_seqlens=cu, router_stats=stats)[0]
        alone = torch.cat([ours(d)[0] for d in docs])
        hf_router = [hf(d, output_router_logits=True).router_logits for d in docs]
    assert max_diff(packed, alone) <= 1e-5
    per_layer = tuple(torch.cat([r[i] for r in hf_router]) for i in range(len(hf_router[0])))
    family = transformers.models.__dict__[hf.config.model_type]
    lbl = getattr(family, f"modeling_{hf.config.model_type}").load_balancing_loss_func
    want = lbl(per_layer, ours.config.num_experts, ours.config.num_experts_per_tok)
    assert abs(stats.load_balancing_loss().item() - want.item()) <= 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_generate_matches_transformers(case, folders):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders(case)).eval()
    ours = load_pretrained(folders(case))
    prompt = ids(1, 5, seed=3)
    hf.generation_config.eos_token_id = None
    want = hf.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=0)[:, 5:]
    got = generate(ours, prompt, max_new_tokens=32)
    assert torch.equal(got, want), (got, want)


def _no_shared(block):
    block.shared_expert = None


def _flip_norm(block):
    block.gate.norm_topk_prob = not block.gate.norm_topk_prob


def _first_choice_only(block):
    block.gate.top_k = 1


@pytest.mark.parametrize("case,breaker", [
    ("qwen2_moe", _no_shared), ("qwen3_moe-norm-window-dense", _flip_norm), ("mixtral", _flip_norm),
    ("qwen3_moe", _flip_norm), ("qwen3_moe", _first_choice_only),
])
def test_feature_is_load_bearing(case, breaker, folders):
    """Switching one MoE feature off in ftlib's loaded model breaks the parity above (the check can fail)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders(case)).eval()
    ours = load_pretrained(folders(case))
    for layer in ours.model.layers:
        if layer.moe:
            breaker(layer.mlp)
    x = ids()
    with torch.no_grad():
        assert max_diff(ours(x), hf(x).logits) > 1e-2


def test_sparse_step_and_dense_layers_follow_the_config(folders):
    ours = load_pretrained(folders("qwen2_moe"))  # decoder_sparse_step=2: layer 1 only
    assert [layer.moe for layer in ours.model.layers] == [False, True, False]
    ours = load_pretrained(folders("qwen3_moe-norm-window-dense"))  # mlp_only_layers=[1]
    assert [layer.moe for layer in ours.model.layers] == [True, False, True]
    assert ours.model.layers[1].mlp.gate_proj.weight.shape == (40, 32)  # intermediate_size, not the experts'


# ------------------------------------------------------------------ hub layout


def test_hub_layout_is_what_transformers_writes(folders, tmp_path):
    for case in ("qwen3_moe", "mixtral", "qwen2_moe"):
        ours = load_pretrained(folders(case))
        save_pretrained(ours, tmp_path / case)
        mine = load_file(str(tmp_path / case / "model.safetensors"))
        theirs = load_file(str(folders(case) / "model.safetensors"))
        assert sorted(mine) == sorted(theirs), case
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert any(".block_sparse_moe.experts.3.w3.weight" in k for k in mine) is False  # qwen2_moe last
    names = load_file(str(tmp_path / "mixtral" / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.4.w3.weight" in names


def test_stacked_checkpoint_loads_too(folders, tmp_path):
    """A checkpoint holding transformers 5's in-memory names (stacked ``experts.gate_up_proj``) loads as well."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders("qwen3_moe")).eval()
    tmp_path.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folders("qwen3_moe") / "config.json").read_text())
    ours = load_pretrained(tmp_path)
    x = ids()
    with torch.no_grad():
        assert max_diff(ours(x), hf(x).logits) <= 1e-5


def _edit_checkpoint(src, dst, edit):
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_hub_layout_errors_name_the_tensor(folders, tmp_path):
    src = folders("qwen3_moe")
    _edit_checkpoint(src, tmp_path / "missing",
                     lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_pretrained(tmp_path / "missing")
    _edit_checkpoint(src, tmp_path / "extra", lambda t: t.update(
        {"model.layers.0.mlp.experts.6.gate_proj.weight": torch.zeros(16, 32)}))
    with pytest.raises(ValueError, match=r"experts\.6\.gate_proj\.weight.*names expert 6.*num_experts=6"):
        load_pretrained(tmp_path / "extra")
    _edit_checkpoint(src, tmp_path / "shape", lambda t: t.update(
        {"model.layers.0.mlp.experts.1.down_proj.weight": torch.zeros(16, 32)}))
    with pytest.raises(ValueError, match=r"experts\.1\.down_proj\.weight.*shape \(16, 32\).*expects \(32, 16\)"):
        load_pretrained(tmp_path / "shape")
    dense = folders("qwen3_moe-norm-window-dense")  # layer 1 is dense there
    _edit_checkpoint(dense, tmp_path / "dense", lambda t: t.update(
        {"model.layers.1.mlp.experts.0.gate_proj.weight": torch.zeros(16, 32)}))
    with pytest.raises(ValueError, match=r"model\.layers\.1 is not a sparse layer"):
        load_pretrained(tmp_path / "dense")


# ------------------------------------------------------------------ config


def test_config_reads_both_expert_count_keys_and_round_trips(folders):
    for case in sorted(CASES):
        cfg = load_config(folders(case))
        d = json.loads((folders(case) / "config.json").read_text())
        assert cfg.num_experts == d.get("num_experts", d.get("num_local_experts"))
        again = LlamaConfig.from_hf_dict(cfg.to_hf_dict())
        assert again == cfg, case
        hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
        assert hf_cfg.num_experts_per_tok == cfg.num_experts_per_tok
        assert getattr(hf_cfg, "norm_topk_prob", True) == cfg.norm_topk_prob


@pytest.mark.parametrize("edit,message", [
    (dict(num_experts_per_tok=7), r"num_experts_per_tok=7 must be in 1\.\.num_experts=6"),
    (dict(num_experts="6"), r"field num_experts must be"),
    (dict(num_local_experts=5), r"num_experts=6 and num_local_experts=5 disagree"),
    (dict(mlp_only_layers=[3]), r"mlp_only_layers entry 3 is not a layer index"),
    (dict(decoder_sparse_step=0), r"decoder_sparse_step"),
])
def test_config_refusals_name_the_field(folders, edit, message):
    d = json.loads((folders("qwen3_moe") / "config.json").read_text())
    d.pop("num_local_experts", None)
    d["num_experts"] = 6
    d.update(edit)
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_dict(d, source="cfg.json")


# ------------------------------------------------------------------ grouped experts and router losses


def test_grouped_experts_equal_a_loop_over_tokens_float64_with_gradients():
    torch.manual_seed(0)
    e, h, i, n, k = 5, 7, 6, 11, 2
    experts = MoEExperts(h, i, e, "silu").double()
    experts.init_weights(0.5)
    x = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    chosen = torch.stack([torch.randperm(e - 1)[:k] for _ in range(n)])  # expert e-1 gets no token
    w = torch.rand(n, k, dtype=torch.float64)
    got = experts(x, chosen, w)
    rows = []
    for t in range(n):
        acc = 0
        for j in range(k):
            g, u = (experts.gate_up_proj[chosen[t, j]] @ x[t]).chunk(2)
            acc = acc + w[t, j] * (experts.down_proj[chosen[t, j]] @ (torch.nn.functional.silu(g) * u))
        rows.append(acc)
    want = torch.stack(rows)
    assert max_diff(got, want) <= 1e-12
    gy = torch.randn_like(want)
    g_got = torch.autograd.grad(got, (x, experts.gate_up_proj, experts.down_proj), gy)
    g_want = torch.autograd.grad(want, (x, experts.gate_up_proj, experts.down_proj), gy)
    for a, b in zip(g_got, g_want):
        assert max_diff(a, b) <= 1e-12
    assert g_got[1][e - 1].abs().max() == 0  # the idle expert


def test_grouped_linear_groups_by_sizes():
    x, wt = torch.randn(6, 3), torch.randn(3, 4, 3)
    got = grouped_linear(x, wt, [2, 0, 4])
    assert max_diff(got, torch.cat([x[:2] @ wt[0].T, x[2:] @ wt[2].T])) == 0


def test_aux_loss_gradient_and_counts_match_transformers(folders):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders("mixtral")).eval()
    ours = load_pretrained(folders("mixtral"))
    x = ids()
    out = hf(x, output_router_logits=True)
    stats = RouterStats()
    ours(x, router_stats=stats)
    name = "model.layers.1.mlp.gate.weight"
    (g_want,) = torch.autograd.grad(out.aux_loss, dict(hf.named_parameters())[name])
    (g_got,) = torch.autograd.grad(stats.load_balancing_loss(), dict(ours.named_parameters())[name])
    assert max_diff(g_got, g_want) <= 1e-6 and g_want.abs().max() > 1e-4
    counts = stats.tokens_per_expert()
    assert counts.shape == (3, 5) and torch.equal(counts.sum(-1), torch.full((3,), 2.0 * x.numel()))
    for layer, z in enumerate(out.router_logits):  # counts are the top-k choices of transformers' router
        want = torch.bincount(torch.topk(z, 2, dim=-1).indices.reshape(-1), minlength=5).float()
        assert torch.equal(counts[layer], want)
    u = stats.utilisation()
    load = counts / (counts.sum(-1, keepdim=True) / 5)
    assert u == {"expert_load_max": float(load.max()), "expert_load_min": float(load.min()),
                 "experts_idle": float((counts == 0).sum())}
    assert u["expert_load_max"] > 1.0 > u["expert_load_min"]
    zl = torch.stack([torch.logsumexp(z, -1).square().mean() for z in out.router_logits]).mean()
    assert abs(stats.z_loss().item() - zl.item()) <= 1e-5


def test_training_loss_with_aux_equals_transformers_and_checkpointing(folders):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders("qwen3_moe")).eval()
    ours = load_pretrained(folders("qwen3_moe"))
    x = ids()
    out = hf(x, labels=x, output_router_logits=True)  # transformers adds coef * aux to its loss
    grads = []
    for every in (None, 1):
        ours.set_gradient_checkpointing(every)
        ours.zero_grad()
        stats = RouterStats()
        logits = ours(x, router_stats=stats)
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 96), x[:, 1:].reshape(-1))
        loss = ce + ours.config.router_aux_loss_coef * stats.load_balancing_loss()
        assert abs(loss.item() - out.loss.item()) <= 1e-5
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in ours.named_parameters()})
    for n in grads[0]:
        assert max_diff(grads[0][n], grads[1][n]) <= 1e-6, n


def test_mixtral_jitter_only_in_training(folders):
    ours = load_pretrained(folders("mixtral")).eval()
    x = ids()
    for layer in ours.model.layers:
        layer.mlp.jitter = 0.5
    with torch.no_grad():
        eval_a, eval_b = ours(x), ours(x)
        ours.train()
        train = ours(x)
    assert torch.equal(eval_a, eval_b) and max_diff(train, eval_a) > 1e-3
