"""torch.compile: a decoder block with LoRA (dropout on) compiles whole, and packed batches do not recompile."""

import pytest
import torch
import torch._dynamo

from ftlib.lora import LoRAConfig, apply_lora


def _packed(lens, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    ids = torch.randint(0, vocab, (1, t), generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    return ids, pos, cu, max(lens)


@pytest.fixture
def lora_model(make_model):
    torch._dynamo.reset()
    model = make_model("qwen2", num_hidden_layers=2)
    apply_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.1, target_modules="all-linear"), verbose=False)
    return model.train()


def test_block_with_lora_has_no_graph_break(lora_model):
    """torch._dynamo.explain over one block with LoRA, dropout and the packed SDPA path: one graph."""
    from ftlib.models.llama import BatchPlan
    from ftlib.models.rope import rope_cos_sin, rope_inv_freq

    ids, pos, cu, longest = _packed([5, 9, 2])
    plan = BatchPlan.build(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=longest)
    cfg = lora_model.config
    plan.cos, plan.sin = rope_cos_sin(rope_inv_freq(cfg.head_dim, cfg.rope_theta), pos, torch.float32)
    x = lora_model.model.embed_tokens(ids)
    explain = torch._dynamo.explain(lora_model.model.layers[0])(x, plan)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1


def test_compiled_block_trains_without_recompiling_per_step(lora_model):
    """fullgraph=True on a block (a graph break would raise); packed batches with ever new document
    layouts then reuse the compiled graph (after at most one recompilation that makes the layout
    dynamic), and the compiled block's output equals the eager one."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    compiles = []

    def count(gm, example_inputs):
        compiles.append(gm)
        return make_boxed_func(gm.forward)

    block = lora_model.model.layers[0]
    eager_forward = block.forward
    block.compile(backend=aot_autograd(fw_compiler=count, bw_compiler=lambda gm, _: make_boxed_func(gm.forward)),
                  fullgraph=True)
    warm = None
    for i, lens in enumerate([[5, 9, 2], [16], [1, 2, 3, 4, 6], [8, 8], [3, 13]]):
        ids, pos, cu, longest = _packed(lens, seed=i)
        logits = lora_model(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=longest)
        torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
        if i == 1:
            warm = len(compiles)
    assert all(p.grad is not None for n, p in lora_model.named_parameters() if "lora_" in n)
    assert len(compiles) == warm, f"recompiled after warm-up: {len(compiles)} compilations, {warm} after step 2"
    lora_model.eval()  # no dropout: compiled and eager agree on the same weights
    with torch.no_grad():
        compiled = lora_model(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=longest)
        block.forward = eager_forward
        block._compiled_call_impl = None
        torch.testing.assert_close(compiled, lora_model(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=longest),
                                   rtol=1e-5, atol=1e-5)
