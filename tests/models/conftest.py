"""Tiny model configs shared by the model tests (written here, nothing downloaded)."""

import pytest
import torch

from ftlib.models import LlamaConfig, LlamaForCausalLM


def tiny_config(model_type: str = "llama", **overrides) -> LlamaConfig:
    base = dict(
        model_type=model_type, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
    )
    if model_type == "qwen2":
        base.update(qkv_bias=True, tie_word_embeddings=True)
    base.update(overrides)
    return LlamaConfig(**base)


def tiny_model(model_type: str = "llama", seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(model_type, **overrides))
    # non-trivial norms and biases so a wrong load or a skipped term shows up
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def make_model():
    return tiny_model


@pytest.fixture(scope="session")
def make_config():
    return tiny_config


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models gain nothing from intra-op threads; on a shared 2-core runner they lose ~20x to contention.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
