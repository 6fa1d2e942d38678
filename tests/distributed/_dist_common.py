"""What tests/test_distributed.py and its torchrun worker share: tiny models, data, and the loop.

A case is a tiny Llama (odd vocabulary and LoRA rank, so shards are uneven) with LoRA, QLoRA
(NF4 + DoRA + activation checkpointing) or full fine-tuning, trained from a rank-sharded packed
loader with 2 micro-batches per optimizer step. On W ranks each rank takes ``BATCH`` rows of
every global step; the one-process reference takes ``BATCH * W`` rows: the same tokens per
optimizer step, so the token-normalised losses and updates must agree.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ftlib.clip import AGCClipper, GlobalNormClipper, ZScoreClipper
from ftlib.data import TokenLoader
from ftlib.lora import LoRAConfig, apply_lora, lora_layers
from ftlib.losses import chunked_cross_entropy
from ftlib.models import LlamaConfig, LlamaForCausalLM
from ftlib.optim import TrainOptimizer, make_adamw, param_groups
from ftlib.sched import LRScheduler, WarmupDecay

CFG = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)
WORLD, BATCH, ACCUM, SEQ = 2, 2, 2, 16
STEPS, SAVE_AT = 4, 2
LORA = dict(r=3, alpha=8, target_modules="all-linear")
CASES = {
    "lora": dict(lora=LORA, clip="zscore"),
    "qlora": dict(lora=dict(LORA, quantize="nf4", double_quant=True, use_dora=True), grad_ckpt=True, clip="agc"),
    "full": dict(lora=None, clip="global"),
    "full_tied": dict(lora=None, tie=True, clip="global"),
}


class Docs:
    """Documents of 3-14 tokens; the first 1-2 tokens of each carry no loss (a prompt)."""

    def __init__(self, n: int = 90, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(3, 15, size=n).astype(np.int64)
        self.docs = []
        for n_tok in self.lengths:
            ids = rng.integers(1, CFG["vocab_size"], size=int(n_tok))
            mask = np.ones(int(n_tok), np.uint8)
            mask[: int(rng.integers(1, 3))] = 0
            self.docs.append((ids, mask))

    def __getitem__(self, i):
        return self.docs[i]


class LossModule(nn.Module):
    """batch -> (summed token loss, target tokens): the module whose forward FSDP2/DDP wrap."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch):
        keys = ("position_ids", "cu_seqlens", "max_seqlen")
        hidden = self.model.model(batch["input_ids"], **{k: batch[k] for k in keys if k in batch})
        return chunked_cross_entropy(hidden, self.model.lm_head.weight, batch["labels"])


def build(case: str) -> LossModule:
    c = CASES[case]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG, tie_word_embeddings=c.get("tie", False)))
    if c["lora"] is not None:
        apply_lora(model, LoRAConfig(**c["lora"]), verbose=False)
        with torch.no_grad():  # a trained-like adapter: every gradient is non-zero from the first step
            g = torch.Generator().manual_seed(1)
            for _, layer in lora_layers(model):
                layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.1)
    if c.get("grad_ckpt"):
        model.set_gradient_checkpointing(every=1)
    return LossModule(model)


def make_clipper(case: str):
    return {"zscore": lambda: ZScoreClipper(z=0.05, beta=0.5, warmup=1), "agc": lambda: AGCClipper(0.02),
            "global": lambda: GlobalNormClipper(0.3)}[CASES[case]["clip"]]()


def parts(case: str, module: LossModule, rank: int, world: int):
    """(optimizer, schedule, clipper, loader) for ``module`` (built after sharding)."""
    opt = TrainOptimizer(make_adamw(param_groups(module.model, lr=1e-2, weight_decay=0.01), lr=1e-2))
    sched = LRScheduler(opt.optimizer, WarmupDecay(total=STEPS, warmup=1, decay="cosine", min_lr_ratio=0.1))
    loader = TokenLoader(Docs(), batch_size=BATCH * WORLD // world, pad_id=0, seq_len=SEQ, seed=3, rank=rank,
                         world_size=world)
    return opt, sched, make_clipper(case), loader


def train(module, opt, sched, clip, loader, start: int = 0, stop: int = STEPS, on_micro=None, on_step=None,
          device=None) -> list:
    """Optimizer steps ``start`` .. ``stop`` - 1; one record per step."""
    records = []
    it = iter(loader)
    for step in range(start, stop):
        for m in range(ACCUM):
            batch = next(it)
            if device is not None:
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            with opt.grad_sync(module, enabled=m == ACCUM - 1):
                opt.backward(*module(batch))
            if on_micro is not None:
                on_micro(m)
        res = opt.step(clip)
        sched.step(1, loss=res.loss)
        records.append({"loss": res.loss, "tokens": res.num_tokens, "grad_norm": res.grad_norm,
                        "skipped": res.skipped, "clip": res.clip})
        if on_step is not None:
            on_step(step + 1, records[-1])
    return records


def full_value(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def saved_weights(module: LossModule) -> dict[str, torch.Tensor]:
    """The trained tensors (trainable ones for LoRA, every weight otherwise), whole, under HF names."""
    lora = has_lora(module)
    return {n: full_value(p) for n, p in module.model.named_parameters() if p.requires_grad or not lora}


def has_lora(module: LossModule) -> bool:
    return any(True for _ in lora_layers(module.model))
