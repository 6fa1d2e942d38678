"""Every dense family against transformers on tiny random checkpoints (fp32, CPU).

One row per family x feature (``CASES``): tied / untied head, sliding window on and off, attention
and final soft-capping, partial rotary, q/k norms, no-RoPE layers and each RoPE scaling at
positions past the original context. For each: a checkpoint saved by transformers loads in
ftlib with max |d logits| <= 1e-5, ftlib's save loads in ``AutoModelForCausalLM`` with the same
logits, a packed row equals each document run alone, and greedy decoding equals transformers'
for 32 tokens. Weights are drawn wider than the default init (and soft-caps small) so every term
moves the logits: each check fails when its feature is switched off (``test_feature_is_load_bearing``).
"""

import pytest
import torch

from ftlib.models import generate, load_pretrained, save_pretrained

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
T = 40  # tokens per row: past the windows (8) and the original contexts (16) below
_LONG = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(2)],
         "long_factor": [1.0 + 2.0 * i for i in range(2)], "original_max_position_embeddings": 16}

CASES = {
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "qwen3-tied-window": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True, use_sliding_window=True,
                                              sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "qwen3-yarn": ("Qwen3Config", dict(head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen3-yarn-attnfactor": ("Qwen3Config", dict(head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "attention_factor": 0.8, "beta_fast": 16.0, "beta_slow": 2.0})),
    "qwen3-dynamic": ("Qwen3Config", dict(head_dim=16, max_position_embeddings=16, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
    "qwen3-linear": ("Qwen3Config", dict(head_dim=16, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "llama-llama3": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "mistral-window": ("MistralConfig", dict(sliding_window=8)),
    "qwen2-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=12, sliding_window=8,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma2-nocap-nowindow": ("Gemma2Config", dict(head_dim=16, sliding_window=64, attn_logit_softcapping=None,
                                                   final_logit_softcapping=None, tie_word_embeddings=False)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"], rope_parameters={
                                            "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                               "rope_theta": 1000000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "phi3": ("Phi3Config", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "phi3-partial-longrope-tied": ("Phi3Config", dict(
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, original_max_position_embeddings=16,
        rope_parameters=dict(_LONG, rope_theta=10000.0, partial_rotary_factor=0.5))),
    "olmo2": ("Olmo2Config", dict(pad_token_id=0, eos_token_id=2)),
    "smollm3": ("SmolLM3Config", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, no_rope_layers=[1, 0])),
}


def hf_model(case, **override):
    cfg_name, extra = CASES[case]
    cfg = getattr(transformers, cfg_name)(**{**TINY, **extra, **override})
    cls = transformers.AutoModelForCausalLM.from_config  # the family's *ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # wide random weights, norms and biases: every term moves the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if "gemma" in cfg.model_type else 1.0))
            else:
                p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 0.1))
    return model


def ids(b=2, t=T, seed=1):
    return torch.randint(3, TINY["vocab_size"], (b, t), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    made = {}

    def get(case):
        if case not in made:
            made[case] = root / case
            hf_model(case).save_pretrained(made[case])
        return made[case]
    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_both_ways(case, folders, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders(case)).eval()
    ours = load_pretrained(folders(case))
    x = ids()
    with torch.no_grad():
        want, got = hf(x).logits, ours(x)
    assert max_diff(got, want) <= 1e-5, (case, max_diff(got, want))
    save_pretrained(ours, tmp_path, max_shard_size="40KB")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        assert max_diff(back(x).logits, want) <= 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_row_equals_documents_alone(case, folders):
    ours = load_pretrained(folders(case))
    lens = [13, 1, 26]  # one document longer than the windows and the original contexts
    row = ids(1, sum(lens), seed=2)
    cu = torch.tensor([0, 13, 14, 40], dtype=torch.int32)
    with torch.no_grad():
        packed = ours(row, cu_seqlens=cu)[0]
        alone = torch.cat([ours(row[:, s:e])[0] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    if CASES[case][1].get("rope_parameters", {}).get("rope_type") in ("dynamic", "longrope"):
        pytest.skip("dynamic / longrope depend on the forward's longest position, so a pack differs by design")
    assert max_diff(packed, alone) <= 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_generate_matches_transformers(case, folders):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders(case)).eval()
    ours = load_pretrained(folders(case))
    prompt = ids(1, 5, seed=3)
    hf.generation_config.eos_token_id = None  # no stop token on either side: 32 tokens, none suppressed
    want = hf.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=0)[:, 5:]
    got = generate(ours, prompt, max_new_tokens=32)
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("case,attr,value", [
    ("gemma2", "softcap", None), ("gemma2", "sliding_window", None), ("gemma3", "rope", "global"),
    ("qwen3", "qk_norm", None), ("olmo2", "qk_norm", None), ("smollm3", "rope", "global"),
    ("mistral-window", "sliding_window", None),
])
def test_feature_is_load_bearing(case, attr, value, folders):
    """Switching one feature off in ftlib's loaded model breaks the parity above (the check can fail)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders(case)).eval()
    ours = load_pretrained(folders(case))
    for layer in ours.model.layers:
        setattr(layer.self_attn, attr, value)
    x = ids()
    with torch.no_grad():
        assert max_diff(ours(x), hf(x).logits) > 1e-2


@pytest.mark.parametrize("case,field", [("gemma2", "final_logit_softcapping"), ("qwen3-yarn", "rope_scaling"),
                                        ("gemma2", "embed_scale")])
def test_config_feature_is_load_bearing(case, field, folders):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders(case)).eval()
    ours = load_pretrained(folders(case))
    setattr(ours.config, field, None if field != "embed_scale" else False)
    x = ids()
    with torch.no_grad():
        assert max_diff(ours(x), hf(x).logits) > 1e-2
