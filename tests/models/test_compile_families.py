"""torch.compile of a tiny model of every dense family, with LoRA: logits and LoRA gradients equal eager.

One model per family (two layers, each family's switches on: q/k norms, sandwich or post norms,
GeGLU, soft-caps and alternating windows, fused projections with partial rotary, no-RoPE
layers; Phi-3's ``longrope`` and Qwen3 with ``dynamic`` RoPE, whose tables depend on the longest
position, which the batch plan knows on the host: T, or a packed batch's ``max_seqlen``), LoRA on
every linear layer, compiled whole (``fullgraph=True``: a graph break fails).
Forward and backward of a cross-entropy loss: max |d logits| and max |d grad| <= 1e-5 in fp32.
Two backends: ``aot_eager`` (dynamo's capture and AOT autograd's joint graph, seconds) and the
default ``inductor`` (generated C++ kernels; ~25 s of compiler time per family on a 2-core CPU,
so marked ``slow``: CI runs it, ``-m "not slow"`` skips it locally).
"""

import functools

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
    # RoPE that depends on the longest position (T > the original 8): the length comes from the host
    "phi3-longrope": dict(model_type="phi3", partial_rotary_factor=0.5, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 7.0],
        "original_max_position_embeddings": 8}),
    "qwen3-dynamic": dict(model_type="qwen3", head_dim=16, max_position_embeddings=8,
                          rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
}
T = 14  # past the window and the RoPE cases' original context


def _model(case):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{"model_type": case, **TINY, **FAMILIES[case]}))
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
@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_compiled_family_equals_eager(case, backend):
    torch._dynamo.reset()
    model = _model(case)
    ids = torch.randint(0, TINY["vocab_size"], (1, T), generator=torch.Generator().manual_seed(1))
    want_logits, want_grads = _step(model, model, ids)
    got_logits, got_grads = _step(model, torch.compile(model, backend=backend, fullgraph=True), ids)
    assert (got_logits - want_logits).abs().max().item() <= 1e-5
    assert got_grads.keys() == want_grads.keys() and any("lora_" in n for n in want_grads)
    for n, g in want_grads.items():
        assert (got_grads[n] - g).abs().max().item() <= 1e-5, n


def _packed(lens, seed):
    ids = torch.randint(0, TINY["vocab_size"], (1, sum(lens)), generator=torch.Generator().manual_seed(seed))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    return ids, dict(position_ids=pos, cu_seqlens=cu, max_seqlen=max(lens))


@pytest.mark.parametrize("case", ["phi3-longrope", "qwen3-dynamic"])
def test_compiled_length_dependent_rope_follows_each_batch(case):
    """One compiled model (fullgraph: a device read of the longest position would fail it) over
    plain and packed batches on both sides of the original context (8): short factors / base
    below, long factors / the NTK base above, each equal to eager in logits and gradients."""
    torch._dynamo.reset()
    model = _model(case)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    batches = [(_packed([6], 2)[0], {}), (_packed([T], 3)[0], {}), _packed([5, 9], 4), _packed([3, 4, 4, 3], 5),
               _packed([12, 2], 6)]
    for ids, layout in batches:
        want_logits, want_grads = _step(model, functools.partial(model, **layout), ids)
        got_logits, got_grads = _step(model, functools.partial(compiled, **layout), ids)
        assert (got_logits - want_logits).abs().max().item() <= 1e-5, (ids.shape, layout.get("max_seqlen"))
        for n, g in want_grads.items():
            assert (got_grads[n] - g).abs().max().item() <= 1e-5, n
    # the batches cross the switch: a 5-token document run alone (short) differs from inside the pack of 9 (long)
    ids, layout = batches[2]
    with torch.no_grad():
        assert (model(ids[:, :5]) - model(ids, **layout)[:, :5]).abs().max().item() > 1e-3


@pytest.mark.parametrize("case", ["phi3-longrope", "qwen3-dynamic"])
def test_compiled_with_dynamic_shapes(case):
    """``dynamic=True``: the length is a symbol (the switch a guard on it, the NTK base a symbolic float)
    and the RoPE tables' width stays an int (an int of a symbolic float config field would have no source)."""
    torch._dynamo.reset()
    model = _model(case)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    for t in (6, T):  # training steps: the failure without the int width shows with autograd on
        ids = _packed([t], t)[0]
        want_logits, want_grads = _step(model, model, ids)
        got_logits, got_grads = _step(model, compiled, ids)
        assert (got_logits - want_logits).abs().max().item() <= 1e-5, t
        assert all((got_grads[n] - g).abs().max().item() <= 1e-5 for n, g in want_grads.items()), t


def test_packed_max_seqlen_must_be_the_longest_document():
    """dynamic / longrope take the longest position from max_seqlen; eager refuses one that is not."""
    model = _model("phi3-longrope")
    ids, layout = _packed([5, 7], 7)
    with pytest.raises(ValueError, match="longest position \\+ 1 is 7 but max_seqlen is 9"):
        model(ids, **{**layout, "max_seqlen": 9})
