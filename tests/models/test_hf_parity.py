"""Parity with Hugging Face transformers on tiny checkpoints (skipped when transformers is absent).

Both directions: a checkpoint saved by ``transformers`` loads in ftlib, and one
saved by ftlib loads in ``transformers``; fp32 logits agree to < 1e-4.
"""

import pytest
import torch

from ftlib.models import load_pretrained, save_pretrained

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
}


def _hf_model(case):
    cfg_cls, model_cls, extra = CASES[case]
    cfg = getattr(transformers, cfg_cls)(**TINY, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # random biases and norms, so every term is exercised
        for name, p in model.named_parameters():
            if name.endswith(".bias") or name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (2, 40), generator=g)  # 40 > original_max_position_embeddings=16


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_checkpoint_loads_in_ftlib(case, tmp_path):
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    assert ours.config.tie_word_embeddings == hf.config.tie_word_embeddings
    ids = _inputs()
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids)
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", sorted(CASES))
def test_ftlib_checkpoint_loads_in_transformers(case, tmp_path):
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "ours", max_shard_size="40KB")  # sharded on purpose
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back).__name__ == CASES[case][1]
    ids = _inputs()
    with torch.no_grad():
        want = ours(ids)
        got = back(ids).logits
    assert (got - want).abs().max().item() < 1e-4
    for name, p in back.state_dict().items():  # the weights themselves are bit-identical
        if "rotary" not in name:
            assert torch.equal(p, ours.state_dict()[name]), name


@pytest.mark.parametrize("case", ["llama3-rope", "qwen2"])
def test_right_padded_batch_matches_transformers(case, tmp_path):
    """Real tokens of a right-padded batch (run by ftlib as varlen segments) give transformers' logits."""
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ids = _inputs()
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask)
    real = mask.bool()
    assert (got[real] - want[real]).abs().max().item() < 1e-4
