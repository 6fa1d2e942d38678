"""A tiny ftlib Llama and its transformers twin, both in float64, for the TRL equality tests.

transformers' RMSNorm computes in fp32 whatever its input; the twin's norms are made float64 so
that the two models differ only by rounding at fp64 level.
"""

from __future__ import annotations

import types

import torch

from ftlib.models import LlamaConfig, LlamaForCausalLM, save_pretrained


def _rms_norm_fp64(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def fp64_twins(path, head_scale: float):
    """(config, ftlib model in float32, transformers twin in float64 with float64 norms).

    The ftlib model is seeded (0) and its head scaled by ``head_scale`` (logits of a trained-like
    range), saved to ``path`` and loaded by transformers from there."""
    import transformers

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False)
    ours = LlamaForCausalLM(cfg)
    with torch.no_grad():
        ours.lm_head.weight.mul_(head_scale)
    save_pretrained(ours, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    for mod in hf.modules():
        if type(mod).__name__ == "LlamaRMSNorm":
            mod.forward = types.MethodType(_rms_norm_fp64, mod)
    return cfg, ours, hf
