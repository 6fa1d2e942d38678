"""What the context-parallel tests and their torchrun worker share: a tiny GQA Llama with LoRA, a packed row, and
the two bugs put in on purpose (rewrites of ``_segment_plan``'s (half, q0, q1, k0, k1) segments).

The row holds documents of uneven lengths whose boundaries fall inside the zigzag chunks and
across ranks for 2 and 4 ranks (and one token of padding: 47 tokens split into 2P chunks).
"""

from __future__ import annotations

import torch

from ftlib.lora import LoRAConfig, apply_lora
from ftlib.losses import causal_lm_loss
from ftlib.models import LlamaConfig, LlamaForCausalLM

CFG = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)
DOCS = (9, 14, 3, 21)  # 47 tokens: padded to 48 on 2 and 4 ranks (chunks of 12 and 6)


def build(qlora: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG))
    nf4 = dict(quantize="nf4", double_quant=True) if qlora else {}
    apply_lora(model, LoRAConfig(r=3, alpha=8, target_modules="all-linear", **nf4), verbose=False)
    for name, p in model.named_parameters():  # nonzero B, so every adapter factor has a gradient to compare
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model.float().train()


def packed_batch(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = sum(DOCS)
    ids = torch.randint(1, CFG["vocab_size"], (1, t), generator=g)
    labels = ids.clone()
    starts = torch.tensor((0,) + DOCS).cumsum(0)
    labels[0, starts[:-1]] = -100  # the first token of every document carries no loss
    return {"input_ids": ids, "labels": labels, "cu_seqlens": starts.to(torch.int32)}


def one_process(model, *batches) -> tuple[float, dict[str, torch.Tensor]]:
    """The reference: summed loss / count of the batches and the gradient of every trainable tensor, one process."""
    model.zero_grad(set_to_none=True)
    losses, counts = zip(*(causal_lm_loss(model, b) for b in batches))
    mean = sum(losses) / sum(counts)
    mean.backward()
    return float(mean.detach()), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def skip_first_block(plan, chunk):
    """Bug 1: every key segment longer than a chunk loses its first chunk of keys (a block that never arrives)."""
    return [(h, q0, q1, k0 + chunk if k1 - k0 > chunk else k0, k1) for h, q0, q1, k0, k1 in plan]


def mirrored_off_by_one(plan, total):
    """Bug 2: the mirrored chunk's key segments end one key late (its causal diagonal one key ahead)."""
    return [(h, q0, q1, k0, min(k1 + 1, total) if h == 1 else k1) for h, q0, q1, k0, k1 in plan]
