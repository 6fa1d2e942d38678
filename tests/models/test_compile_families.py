"""torch.compile of a tiny model of every dense family, with LoRA: logits and LoRA gradients equal eager.

One model per family (two layers, each family's switches on: q/k norms, sandwich or post norms,
GeGLU, soft-caps and alternating windows, fused projections with partial rotary, no-RoPE
layers), LoRA on every linear layer, compiled whole (``fullgraph=True``: a graph break fails).
Forward and backward of a cross-entropy loss: max |d logits| and max |d grad| <= 1e-5 in fp32.
Two backends: ``aot_eager`` (dynamo's capture and AOT autograd's joint graph, seconds) and the
default ``inductor`` (generated C++ kernels; ~25 s of compiler time per family on a 2-core CPU,
so marked ``slow``: CI runs it, ``-m "not slow"`` skips it locally).
"""

import pytest
import torch
import torch._dynamo

from ftlib.lora import LoRAConfig, apply_lora
from ftlib.models import LlamaConfig, LlamaForCausalLM

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
ALTERNATING = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])
FAMILIES = {
    "llama": dict(),
    "qwen3": dict(head_dim=16, tie_word_embeddings=True, **ALTERNATING),
    "gemma2": dict(head_dim=16, hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=12, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, tie_word_embeddings=True, **ALTERNATING),
    "gemma3_text": dict(head_dim=16, hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=16,
                        rope_scaling={"rope_type": "linear", "factor": 4.0}, **ALTERNATING),
    "phi3": dict(partial_rotary_factor=0.5),
    "olmo2": dict(),
    "smollm3": dict(no_rope_layers=[1, 0]),
}
T = 14  # past the window


def _model(model_type):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(model_type=model_type, **TINY, **FAMILIES[model_type]))
    apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules="all-linear"), verbose=False)
    with torch.no_grad():  # wide weights, norms and adapters (lora_B too): every term moves the logits
        for name, p in model.named_parameters():
            centre = 1.0 if "norm" in name and not model.config.norm_offset else 0.0
            p.copy_(centre + torch.randn_like(p) * (0.3 if "norm" in name else 0.2 if p.dim() > 1 else 0.1))
    return model.train()


def _step(model, forward, ids):
    logits = forward(ids)
    torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


BACKENDS = [pytest.param("aot_eager", id="aot_eager"),  # dynamo's graph and AOT autograd, no code generation
            pytest.param("inductor", id="inductor", marks=pytest.mark.slow)]  # ~25 s of C++ builds a family


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_compiled_family_equals_eager(model_type, backend):
    torch._dynamo.reset()
    model = _model(model_type)
    ids = torch.randint(0, TINY["vocab_size"], (1, T), generator=torch.Generator().manual_seed(1))
    want_logits, want_grads = _step(model, model, ids)
    got_logits, got_grads = _step(model, torch.compile(model, backend=backend, fullgraph=True), ids)
    assert (got_logits - want_logits).abs().max().item() <= 1e-5
    assert got_grads.keys() == want_grads.keys() and any("lora_" in n for n in want_grads)
    for n, g in want_grads.items():
        assert (got_grads[n] - g).abs().max().item() <= 1e-5, n
