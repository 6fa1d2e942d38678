"""End-to-end LoRA fine-tuning step: ftlib against transformers + peft on the same job.

    python benchmarks/bench_train.py                   # full run: 2 vocab sizes, all variants (~25 min, 2 idle cores)
    python benchmarks/bench_train.py --quick           # smoke run: vocab 8192, one round, small budget
    python benchmarks/bench_train.py --profile         # ftlib's step by phase (wall and CPU time), top ops
    python benchmarks/bench_train.py --device cuda --gpu-1b --budget-s 90   # GPU table: Llama-3.2-1B shape, bf16, MFU
    python benchmarks/bench_train.py --family qwen3_moe --quick      # the MoE job (below), ftlib vs transformers + peft
    python benchmarks/bench_train.py --family qwen3                  # the dense job shaped as Qwen3 (below)

Duration knobs: ``--tokens`` / ``--tokens-large`` (real-token budget per run), ``--rounds`` /
``--rounds-large``, ``--variants``, ``--vocab``, ``--budget-s`` (no run starts after it, a running
one stops there).

The job (every variant in its own subprocess, from the same initial weights and adapter): a
Llama-shaped model (6 layers, hidden 512, GQA 8/4, SwiGLU 1408, untied head, fp32 on CPU;
``--gpu-1b``: Llama-3.2-1B's shape, bf16 weights, bf16 autocast, fp32 adapters), LoRA r=16 /
alpha=32 on every linear layer with dropout 0.05, AdamW (lr 3e-3, fused), global-norm clipping
at 1.0 (the Trainer's default). Data: documents of a synthetic language (Zipfian unigrams plus a
sparse random successor table, so the loss moves within a few steps) with log-normal lengths
(median 150 tokens, sigma 1: a long tail), cut at ``--max-len`` 1024 tokens as a formatter's
``max_length`` would; the first quarter of each document is its prompt (no loss). Real tokens
per micro-batch: ``--seq-len`` (2048; 1024 at the larger vocab sizes, whose logits dominate
memory): ftlib packs documents into rows of that length (best-fit decreasing), the padded
variants take ``round(seq_len / mean length)`` documents per batch (as many real tokens on
average). Each variant trains on the same budget of real tokens, then scores the same held-out
documents.

``--family qwen3``: the same job on a Qwen3-shaped model of the same width and depth: RMSNorm on
each head's q and k before RoPE, an explicit ``head_dim`` 128 with 8 query heads (q_proj widens
512 -> 1024, as Qwen3-0.6B's 1024 -> 2048), SwiGLU 3 x hidden = 1536, the head tied to the
embeddings, RoPE base 1e6; both libraries build it from the same config.json (``Qwen3ForCausalLM``
on the transformers side), LoRA and every rule as for the Llama job.

``--family qwen3_moe``: the same job on a Qwen3-MoE-shaped model (6 layers, hidden 512, GQA 8/4,
head_dim 64, q/k norms, 8 routed experts of width 352, top-2 renormalised: 704 active MLP columns a
token against the dense job's 1408), LoRA r=16 / alpha=32 without dropout (PEFT's ``target_parameters``
adapter takes none) on every linear layer and, per expert, on the stacked ``mlp.experts.gate_up_proj``
/ ``down_proj`` (``target_parameters``); the router stays frozen. Both libraries add
``router_aux_loss_coef`` (0.001) x the load-balancing loss over the real tokens to the training
loss (transformers: ``output_router_logits=True``, its default grouped-mm experts; ftlib:
``RouterStats`` with the pads masked). TFLOP/s is not counted for it (nan).

Variants:
  ftlib            ftlib's model, packed rows (cu_seqlens: no token sees another document), the
                   SDPA varlen attention path, fused-gradient chunked cross-entropy
  ftlib-compile    the same with every decoder block under torch.compile(fullgraph=True)
  hf-pad           transformers (sdpa) + peft, random order, dynamic padding
  hf-group         transformers (sdpa) + peft, length-grouped dynamic padding (transformers'
                   LengthGroupedSampler, the Trainer's ``group_by_length``, a fixed number of
                   documents per batch: a batch of long documents holds several times the tokens)
  hf-budget        the same length-grouped order cut into batches of at most ``--pad-budget`` x
                   ``--seq-len`` padded tokens (a token budget, as careful users bucket; 1.125: as
                   many real tokens per step as a packed row, 97 % of them real)
  hf-sorted        the whole corpus sorted by length (ties in random order), cut into the same
                   token-budget batches, the batches shuffled: 99.5 % real tokens, the least
                   padding a padded layout gets
  hf-sorted-mp     hf-sorted with ``torch.set_float32_matmul_precision("medium")``, which lets torch
                   route fp32 matmuls to oneDNN (on a CPU where MKL takes its AVX2 path, such as
                   AMD's with AVX-512, ~2.3x faster GEMMs). "medium" permits bf16 arithmetic inside
                   them: the worker measures a GEMM's error against float64, and the variant counts
                   as correct (a reference) only when it stays at fp32 level (<= 1e-5; oneDNN keeps
                   fp32 math on CPUs without AMX); else it is shown and marked
  hf-packed-xdoc   transformers + peft on ftlib's packed rows through ``position_ids`` only:
                   with sdpa/eager attention transformers does NOT isolate the documents, so
                   tokens attend across document boundaries; shown, marked, never a reference
  hf-rows          transformers + peft on ftlib's packed micro-batches, each one's documents as one
                   padded batch: the same documents in the same steps as ftlib, so only arithmetic
                   differs (slow: a row of one long and many short documents pads to the long one).
                   When it runs it is the reference of the ftlib variants' held-out check (below)

Every transformers variant runs sdpa attention, no gradient checkpointing, fused AdamW, foreach
gradient clipping, in fp32 like ftlib. Every worker (both libraries) runs ``--threads`` intra-op
threads, one inter-op thread, and glibc malloc told to keep freed memory (``--malloc keep``: no
page faults and zeroing per step).

Rounds alternate the variants (A B C ... A B C ...); the table shows medians over rounds.
The held-out loss of every correct variant must be within ``--loss-tol`` (``--loss-tol-large``
at the other vocab sizes) of the best transformers variant's -- for the ftlib variants, of
``hf-rows``'s when it ran (same batches: a short run's loss moves fast, and different batches
show; the ``vs best`` column still compares with the best variant); the script prints the check.
Ratios are against the best *correct* transformers variant (the fastest of hf-pad / hf-group / hf-budget / hf-sorted,
and hf-sorted-mp where its GEMMs measured at fp32 precision)
and against hf-pad. Throughput is real (non-pad) tokens per second of wall time after the
warm-up steps; ``tok/CPU-s`` divides by the process's CPU time instead (steadier on a shared
machine). Peak memory: the process's peak RSS on CPU (ru_maxrss: weights, framework,
activations, allocator caching), ``torch.cuda.max_memory_allocated`` on GPU. Held-out loss: mean
token cross-entropy on 200 held-out documents, each scored without seeing another. On GPU,
TFLOP/s counts the model FLOPs of each step (``step_flops``: ``ftlib.metrics.FlopsModel``, PaLM's
convention, the count ``MetricsLogger`` reports in training) and MFU divides by the device's dense bf16
peak (``ftlib.metrics.PEAK_TFLOPS``, the most specific name matching the device, or ``--peak-tflops``).

Rows go to ``<out>/train.csv``; the last line printed is machine-readable:
``speedup_vs_best=X speedup_vs_pad=Y peak_memory_ratio=Z heldout_loss_rel_diff=W`` (ftlib eager
at the first vocab size), then ``peak_memory_ratio_vocabV=...`` for the other sizes. The
baseline needs the ``bench`` extra (``pip install -e '.[bench]'``: transformers, peft); without it
only ftlib runs and the script says so.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import json
import math
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

VARIANTS = ["ftlib", "ftlib-compile", "hf-pad", "hf-group", "hf-budget", "hf-sorted", "hf-sorted-mp", "hf-packed-xdoc",
            "hf-rows"]
CORRECT_HF = ("hf-pad", "hf-group", "hf-budget", "hf-sorted")
FP32_GEMM_TOL = 1e-5  # hf-sorted-mp is a correct variant where its matmuls stay within this of float64 (fp32: ~1e-6)


def gemm_rel_error() -> float:
    """Max error of a (2048, 512) x (512, 1408) fp32 ``F.linear`` under the process's matmul settings,
    relative to the largest entry of the float64 product: ~1e-6 for fp32 arithmetic, ~1e-3 where
    the settings let the GEMM round its inputs to bf16."""
    import torch

    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(2048, 512, generator=g), torch.randn(1408, 512, generator=g)
    ref = a.double() @ w.double().t()
    return float((torch.nn.functional.linear(a, w).double() - ref).abs().max() / ref.abs().max())
# glibc malloc kept from returning freed memory to the OS (every worker, ftlib and transformers alike): no
# mmap per large tensor, no trimming, so a step reuses the previous step's pages instead of faulting in
# and zeroing fresh ones (measured: transformers 88k page faults and 5 % system time per step, ftlib
# 32k and 2 %; both ~0 with these). ``--malloc default`` leaves glibc's defaults.
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_TOP_PAD_": str(256 << 20)}
LR = 3e-3
LORA = dict(r=16, alpha=32, dropout=0.05)
MOE_LORA = dict(r=16, alpha=32, dropout=0.0, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
FAMILIES = ("llama", "qwen3", "qwen3_moe")


def _family(args) -> str:
    return (args.get("family") if isinstance(args, dict) else getattr(args, "family", None)) or "llama"


def lora_kwargs(args) -> dict:
    """The job's adapter settings (beside ``target_modules="all-linear"``)."""
    return MOE_LORA if _family(args) == "qwen3_moe" else LORA


def shape_tag(args) -> str:
    if getattr(args, "gpu_1b", False):
        return "llama-3.2-1b"
    return {"qwen3_moe": "6x512-qwen3moe-8x2", "qwen3": "6x512-qwen3"}.get(_family(args), "6x512")


# ---------------------------------------------------------------------------------------------
# the job: model shape, data


def model_shape(args) -> dict:
    if getattr(args, "gpu_1b", False) or (isinstance(args, dict) and args.get("gpu_1b")):  # Llama-3.2-1B (tied embeddings, rope llama3 scaling left out: random weights)
        return dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0)
    layers = args.get("layers") if isinstance(args, dict) else getattr(args, "layers", None)
    shape = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=layers or 6, num_attention_heads=8,
                 num_key_value_heads=4, tie_word_embeddings=False, rope_theta=10000.0)
    if _family(args) == "qwen3":  # Qwen3-0.6B's traits: q/k norms, head_dim 128 != 512 / 8, MLP 3 x hidden, tied head
        shape.update(model_type="qwen3", head_dim=128, intermediate_size=1536, tie_word_embeddings=True,
                     rope_theta=1000000.0)
    if _family(args) == "qwen3_moe":
        shape.update(model_type="qwen3_moe", head_dim=64, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=352, norm_topk_prob=True)
    return shape


class Corpus:
    """Documents of a synthetic language: ``lengths`` and ``corpus[i] -> (ids int32, loss_mask uint8)``.

    Tokens 1..V-1 (0 is the pad id, so real tokens are ``input_ids != 0`` in every layout): a
    Zipfian unigram distribution; after each token, with probability 0.8 one of its 4 fixed
    successors (probabilities .5/.25/.15/.1), else a fresh unigram draw. The best achievable loss
    is far below the uniform ln(V), so the loss moves within a few steps.
    """

    def __init__(self, vocab: int, n_docs: int, seed: int, max_len: int):
        rng = np.random.default_rng([seed, vocab, n_docs])
        lang = np.random.default_rng([1234, vocab])  # the language: same for train and held-out
        p = 1.0 / (np.arange(1, vocab) + 10.0)
        p /= p.sum()
        cdf = np.cumsum(p)
        top = vocab - 2  # sampled state s in [0, V-2] is token s + 1
        succ = np.minimum(np.searchsorted(cdf, lang.random((vocab - 1, 4))), top)
        lengths = np.clip(np.round(rng.lognormal(math.log(150), 1.0, n_docs)), 16, max_len).astype(np.int64)
        tokens = np.zeros((n_docs, int(lengths.max())), dtype=np.int32)
        cur = np.minimum(np.searchsorted(cdf, rng.random(n_docs)), top)
        for t in range(tokens.shape[1]):
            tokens[:, t] = cur + 1
            follow = rng.random(n_docs) < 0.8
            pick = np.searchsorted([0.5, 0.75, 0.9], rng.random(n_docs))
            fresh = np.minimum(np.searchsorted(cdf, rng.random(n_docs)), top)
            cur = np.where(follow, succ[cur, pick], fresh)
        self.lengths = lengths
        self._tokens = tokens

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        n = int(self.lengths[i])
        mask = np.ones(n, dtype=np.uint8)
        mask[: n // 4] = 0  # prompt quarter: no loss
        return self._tokens[i, :n], mask


def corpora(spec):
    cap = min(spec["max_len"], spec["seq_len"])
    return (Corpus(spec["vocab"], spec["docs"], seed=0, max_len=cap),
            Corpus(spec["vocab"], spec["heldout_docs"], seed=1, max_len=cap))


def padded_batch_size(train: Corpus, tokens: int) -> int:
    """Documents per padded batch: as many real tokens on average as a packed micro-batch."""
    return max(1, round(tokens / float(np.mean(train.lengths))))


def budget_batches(order, lengths, budget: int):
    """Consecutive documents of ``order`` grouped while ``documents x longest <= budget`` padded tokens."""
    batch, longest = [], 0
    for j in order:
        n = int(lengths[j])
        if batch and max(longest, n) * (len(batch) + 1) > budget:
            yield batch
            batch, longest = [], 0
        batch.append(j)
        longest = max(longest, n)
    if batch:
        yield batch


def packed_spans(batch) -> list[tuple[int, int]]:
    """(start, end) of each real document of a packed batch in its flattened B*T tokens (pad tails left out)."""
    cu = batch["cu_seqlens"].tolist()
    ids = batch["input_ids"].reshape(-1)
    return [(s, e) for s, e in zip(cu, cu[1:]) if e > s and int(ids[s]) != 0]


def doc_lengths(batch) -> list[int]:
    """Real documents of a batch in any layout (packed pad tails and padded slots left out)."""
    ids = batch["input_ids"]
    if "attention_mask" in batch:
        return [int(n) for n in batch["attention_mask"].sum(-1).tolist() if n]
    flat = ids.reshape(-1)
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"].tolist()
    else:  # position_ids restart at 0 per document
        starts = (batch["position_ids"].reshape(-1) == 0).nonzero().flatten().tolist()
        cu = starts + [flat.numel()]
    return [e - s for s, e in zip(cu, cu[1:]) if e > s and int(flat[s]) != 0]


@functools.cache
def _flops_model(shape_items: tuple, vocab: int):
    import torch

    from ftlib.lora import LoRAConfig, apply_lora
    from ftlib.metrics import FlopsModel
    from ftlib.models import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):  # shapes only: no memory, no init cost
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, max_position_embeddings=4096, **dict(shape_items)))
        for p in model.parameters():
            p.requires_grad_(False)
        apply_lora(model, LoRAConfig(target_modules="all-linear", **LORA), verbose=False)
    return FlopsModel.from_model(model)


def flops_model(shape: dict, vocab: int):
    """``ftlib.metrics.FlopsModel`` of the job's model with its adapters (the count ``MetricsLogger`` uses)."""
    return _flops_model(tuple(sorted(shape.items())), vocab)


def step_flops(shape: dict, vocab: int, lens: list[int], n_target: int) -> float:
    """Model FLOPs of one LoRA training step on documents of ``lens`` tokens with ``n_target`` targets:
    ``FlopsModel.flops`` (PaLM's convention; padding and cross-document attention not counted)."""
    if shape.get("num_experts"):
        return float("nan")  # FlopsModel counts every parameter: an MoE token uses only its experts
    pairs = sum(n * (n + 1) // 2 for n in lens)
    return flops_model(shape, vocab).flops(sum(lens), n_target, pairs)


def device_peak_tflops(args) -> float | None:
    """Dense bf16 peak of the GPU (``ftlib.metrics.PEAK_TFLOPS``, most specific name), or --peak-tflops."""
    if args.peak_tflops:
        return args.peak_tflops
    if args.device != "cuda":
        return None
    from ftlib.metrics import device_peak_flops

    peak = device_peak_flops("cuda", "bf16")
    return None if peak is None else peak / 1e12


def pad_batch(docs, pad_id=0):
    """Right-padded batch (HF convention: labels -100 on pads and prompt tokens)."""
    import torch

    L = max(len(d[0]) for d in docs)
    ids = torch.full((len(docs), L), pad_id, dtype=torch.long)
    labels = torch.full((len(docs), L), -100, dtype=torch.long)
    attn = torch.zeros((len(docs), L), dtype=torch.long)
    for b, (tok, mask) in enumerate(docs):
        n = len(tok)
        t = torch.from_numpy(tok.astype(np.int64))
        ids[b, :n], attn[b, :n] = t, 1
        labels[b, :n] = torch.where(torch.from_numpy(mask).bool(), t, -100)
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


# ---------------------------------------------------------------------------------------------
# workers (one variant per process)


def _peak_memory_mb(device) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _train(spec, batches, step_fn, n_real):
    """Run ``step_fn(batch) -> (loss_sum, n_target)`` until the token budget is spent; time after warm-up."""
    device = spec["device"]
    warm, budget = spec["warmup_steps"], spec["tokens"]
    shape = model_shape(spec)
    seen = steps = timed_tokens = 0
    flops = 0.0
    losses, t_start, c_start, deadline = [], None, None, time.perf_counter() + spec["max_s"]
    t0 = time.perf_counter()
    for batch in batches:
        if steps == warm:
            _sync(device)
            t_start, c_start = time.perf_counter(), time.process_time()
        loss_sum, n_tgt = step_fn(batch)
        real = n_real(batch)
        seen += real
        if steps >= warm:
            timed_tokens += real
            flops += step_flops(shape, spec["vocab"], doc_lengths(batch), n_tgt)
        losses.append((loss_sum, n_tgt))
        steps += 1
        if seen >= budget and steps > warm or time.perf_counter() > deadline:
            break
    _sync(device)
    elapsed = time.perf_counter() - t_start if t_start is not None else float("nan")
    cpu = time.process_time() - c_start if c_start is not None else float("nan")
    tail = losses[-max(1, len(losses) // 4):]
    return {
        "steps": steps, "tokens": seen, "timed_tokens": timed_tokens, "timed_s": elapsed,
        "warmup_s": (t_start - t0) if t_start is not None else float("nan"),  # warm-up steps (compilation included)
        "tokens_per_s": timed_tokens / elapsed if elapsed > 0 else float("nan"),
        "tokens_per_cpu_s": timed_tokens / cpu if cpu > 0 else float("nan"),  # CPU time of all threads
        "tflops": flops / elapsed / 1e12 if elapsed > 0 else float("nan"),  # model FLOPs (step_flops)
        "train_loss": sum(s for s, _ in tail) / max(1, sum(n for _, n in tail)),
        "peak_mb": _peak_memory_mb(device),
    }


def setup_ftlib(spec):
    """ftlib's model, optimizer, clipper and packed loader for the job, as a user would write them."""
    import torch

    from ftlib.clip import GlobalNormClipper
    from ftlib.data import TokenLoader
    from ftlib.lora import load_adapter
    from ftlib.models import load_pretrained
    from ftlib.optim import TrainOptimizer, make_adamw, param_groups

    train, heldout = corpora(spec)
    model = load_pretrained(spec["base"], dtype=torch.bfloat16 if spec["bf16"] else torch.float32,
                            device=spec["device"])
    load_adapter(model, spec["adapter"], check_base=False)
    if spec["variant"] == "ftlib-compile":
        for layer in model.model.layers:
            layer.compile(fullgraph=True)
    opt = TrainOptimizer(make_adamw(param_groups(model, lr=LR), lr=LR, impl="fused"),
                         precision="bf16" if spec["bf16"] else "fp32")
    loader = TokenLoader(train, batch_size=spec["rows"], seq_len=spec["seq_len"], pad_id=0, packing=True, seed=0)
    model.train()
    return model, opt, GlobalNormClipper(1.0), loader, heldout


def ftlib_phases(model, opt, clip, device):
    """The step as four timed phases: forward, loss, backward, optimizer (a callable per phase)."""
    import torch

    from ftlib.losses import chunked_cross_entropy
    from ftlib.models import RouterStats

    state = {}
    moe = model.config.num_experts > 0

    def forward(batch):
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        state["batch"] = batch
        # MoE: the router losses over the real tokens (pad id 0 never occurs in the corpus)
        state["router"] = RouterStats(token_mask=batch["input_ids"] != 0) if moe else None
        with opt.autocast():
            state["hidden"] = model.model(batch["input_ids"], position_ids=batch["position_ids"],
                                          cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"],
                                          router_stats=state["router"])

    def loss():
        with opt.autocast():
            loss_sum, n = chunked_cross_entropy(state["hidden"], model.lm_head.weight, state["batch"]["labels"])
        if moe:  # mean CE + coef * aux, as transformers' loss: the sum carries n x the aux term
            loss_sum = loss_sum + model.config.router_aux_loss_coef * state["router"].load_balancing_loss() * n
        state["loss"] = (loss_sum, n)

    def backward():
        opt.backward(*state["loss"])

    def optimizer():
        opt.step(clip)
        loss_sum, n = state.pop("loss")
        state.clear()
        return float(loss_sum.detach()), int(n)

    return forward, loss, backward, optimizer


def ftlib_step(model, opt, clip, device):
    """One training step of ftlib as one call: the four phases of :func:`ftlib_phases` in order."""
    forward, loss, backward, optimizer = ftlib_phases(model, opt, clip, device)

    def step(batch):
        forward(batch)
        loss()
        backward()
        return optimizer()

    return step


def endless(loader):
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def worker_ftlib(spec):
    device = spec["device"]
    model, opt, clip, loader, heldout = setup_ftlib(spec)
    out = _train(spec, endless(loader), ftlib_step(model, opt, clip, device), real_tokens)
    out["heldout_loss"] = heldout_ftlib(model, heldout, device, spec["bf16"], spec["seq_len"])
    return out


def real_tokens(batch) -> int:
    return int((batch["input_ids"] != 0).sum())  # pad id 0 never occurs in the corpus


def heldout_ftlib(model, heldout, device, bf16, seq_len):
    import torch

    from ftlib.data import TokenLoader
    from ftlib.losses import chunked_cross_entropy

    model.eval()
    loader = TokenLoader(heldout, batch_size=1, seq_len=seq_len, pad_id=0, packing=True, shuffle=False,
                         drop_last=False)
    tot = n = 0.0
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        for b in loader:
            b = {k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()}
            h = model.model(b["input_ids"], position_ids=b["position_ids"], cu_seqlens=b["cu_seqlens"],
                            max_seqlen=b["max_seqlen"])
            s, c = chunked_cross_entropy(h, model.lm_head.weight, b["labels"])
            tot, n = tot + float(s), n + int(c)
    return tot / n


def worker_hf(spec):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    device = spec["device"]
    variant = spec["variant"]
    gemm_err = None
    if variant.endswith("-mp"):
        torch.set_float32_matmul_precision("medium")
        gemm_err = gemm_rel_error()
        variant = variant.removesuffix("-mp")
    train, heldout = corpora(spec)
    model = AutoModelForCausalLM.from_pretrained(spec["base"], dtype=torch.bfloat16 if spec["bf16"] else torch.float32,
                                                 attn_implementation="sdpa")
    moe = getattr(model.config, "num_experts", 0) > 0  # the loss then adds coef x the load-balancing loss
    model = PeftModel.from_pretrained(model.to(device), spec["adapter"], is_trainable=True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True)
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=spec["bf16"])
    B = padded_batch_size(train, spec["seq_len"] * spec["rows"])
    budget = int(spec["seq_len"] * spec["rows"] * spec["pad_budget"])  # padded tokens per token-budget batch

    def order():
        g = torch.Generator().manual_seed(0)
        epoch = 0
        while True:
            g.manual_seed(epoch)
            if variant == "hf-sorted":  # global length sort (ties in random order), batches shuffled below
                perm = torch.randperm(len(train), generator=g).numpy()
                idx = perm[np.argsort(train.lengths[perm], kind="stable")].tolist()
            elif variant in ("hf-group", "hf-budget"):
                from transformers.trainer_pt_utils import LengthGroupedSampler

                idx = list(LengthGroupedSampler(B, lengths=train.lengths.tolist(), generator=g))
            else:
                idx = torch.randperm(len(train), generator=g).tolist()
            if variant in ("hf-budget", "hf-sorted"):
                bs = list(budget_batches(idx, train.lengths, budget))
                if variant == "hf-sorted":
                    bs = [bs[i] for i in torch.randperm(len(bs), generator=g).tolist()]
                yield from (pad_batch([train[j] for j in b]) for b in bs)
            else:
                for i in range(0, len(idx) - B + 1, B):
                    yield pad_batch([train[j] for j in idx[i : i + B]])
            epoch += 1

    def packed_rows():
        from ftlib.data import TokenLoader

        loader = TokenLoader(train, batch_size=spec["rows"], seq_len=spec["seq_len"], pad_id=0, packing=True, seed=0)
        while True:
            for b in loader:
                yield {"input_ids": b["input_ids"], "position_ids": b["position_ids"], "labels": b["labels"]}

    def row_documents():  # hf-rows: each packed micro-batch's documents, in its order, as one padded batch
        from ftlib.data import TokenLoader

        loader = TokenLoader(train, batch_size=spec["rows"], seq_len=spec["seq_len"], pad_id=0, packing=True, seed=0)
        while True:
            for b in loader:
                ids, labels = b["input_ids"].reshape(-1), b["labels"].reshape(-1)
                yield pad_batch([(ids[s:e].numpy().astype(np.int32), (labels[s:e] != -100).numpy())
                                 for s, e in packed_spans(b)])

    def step(batch):
        batch = {k: v.to(device) for k, v in batch.items()}
        with amp:
            out = model(**batch, use_cache=False, **({"output_router_logits": True} if moe else {}))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)  # one multi-tensor pass (CPU default: a loop)
        opt.step()
        opt.zero_grad(set_to_none=True)
        n = int((batch["labels"][:, 1:] != -100).sum())
        return float(out.loss.detach()) * n, n

    batches = {"hf-packed-xdoc": packed_rows, "hf-rows": row_documents}.get(variant, order)()
    out = _train(spec, batches, step, real_tokens)
    out["heldout_loss"] = heldout_hf(model, heldout, device, spec["bf16"])
    out["gemm_rel_err"] = gemm_err
    return out


def heldout_hf(model, heldout, device, bf16):
    import torch

    from ftlib.losses import cross_entropy_sum

    model.eval()
    order = np.argsort(heldout.lengths)
    tot = n = 0.0
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        for i in range(0, len(order), 8):
            b = pad_batch([heldout[j] for j in order[i : i + 8]])
            b = {k: v.to(device) for k, v in b.items()}
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
            s, c = cross_entropy_sum(logits.float(), b["labels"])
            tot, n = tot + float(s), n + int(c)
    return tot / n


def run_worker(spec_json: str, out_path: str):
    spec = json.loads(spec_json)
    import torch

    if spec["device"] == "cpu":
        torch.set_num_threads(spec["threads"])
        torch.set_num_interop_threads(1)  # neither side runs inter-op parallel work: no idle pool
    torch.manual_seed(0)  # dropout masks: same seed, different kernels -> different draws, same law
    fn = worker_ftlib if spec["variant"].startswith("ftlib") else worker_hf
    t0 = time.perf_counter()
    out = fn(spec)
    out["wall_s"] = time.perf_counter() - t0
    out["load_avg"] = os.getloadavg()[0]
    out["seq_len"] = spec["seq_len"]
    with open(out_path, "w") as f:
        json.dump(out, f)


# ---------------------------------------------------------------------------------------------
# the parent: initial weights, alternating rounds, table, CSV


def make_initial_weights(work: str, vocab: int, args) -> tuple[str, str]:
    """Base checkpoint + PEFT adapter (B = 0, A random) that every variant starts from."""
    import torch

    from ftlib.lora import LoRAConfig, apply_lora, save_adapter
    from ftlib.models import LlamaConfig, LlamaForCausalLM, save_pretrained

    tag = f"{vocab}-L{model_shape(args)['num_hidden_layers']}-{_family(args)}"
    base, adapter = os.path.join(work, f"base-{tag}"), os.path.join(work, f"adapter-{tag}")
    if os.path.exists(os.path.join(adapter, "adapter_config.json")):
        return base, adapter
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=4096, **model_shape(args))
    with torch.device(args.device):  # a 1B model initialises in seconds on the GPU
        model = LlamaForCausalLM(cfg)
    if args.bf16:
        model.to(torch.bfloat16)
    save_pretrained(model, base)
    apply_lora(model, LoRAConfig(target_modules="all-linear", **lora_kwargs(args)), verbose=False)
    save_adapter(model, adapter, task_type="CAUSAL_LM")
    return base, adapter


def spawn(spec: dict, work: str) -> dict:
    out = os.path.join(work, f"result-{spec['variant']}-{spec['vocab']}-{spec['round']}.json")
    env = dict(os.environ, **(MALLOC_ENV if spec.get("malloc") == "keep" else {}), PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec), "--worker-out", out]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(out):
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        print(f"    {spec['variant']} failed (exit {r.returncode}):\n{tail}", flush=True)
        return {"failed": True}
    with open(out) as f:
        res = json.load(f)
    res["process_s"] = time.perf_counter() - t0
    return res


def _median(rs, key):
    vals = [r[key] for r in rs if not r.get("failed") and r.get(key) is not None and not math.isnan(r[key])]
    return statistics.median(vals) if vals else float("nan")


_KEYS = ("tokens_per_s", "tokens_per_cpu_s", "tflops", "peak_mb", "train_loss", "heldout_loss", "steps", "tokens",
         "timed_s", "warmup_s", "gemm_rel_err")


def correct_hf(med: dict) -> list[str]:
    """The transformers variants that may be the reference: the exact ones, and hf-sorted-mp where
    its GEMMs measured at fp32 precision."""
    ok = [v for v in CORRECT_HF if v in med]
    if "hf-sorted-mp" in med and med["hf-sorted-mp"]["gemm_rel_err"] <= FP32_GEMM_TOL:
        ok.append("hf-sorted-mp")
    return ok


def summarize(vocab, results: dict, variants, peak_tflops=None, loss_tol=float("inf")) -> dict:
    """Median per variant, the ratios against the best correct transformers variant, the held-out check."""
    med = {v: {k: _median(results[v], k) for k in _KEYS} for v in variants}
    hf = [v for v in correct_hf(med) if not math.isnan(med[v]["tokens_per_s"])]
    best = max(hf, key=lambda v: med[v]["tokens_per_s"]) if hf else None
    same = "hf-rows" if "hf-rows" in med and not math.isnan(med["hf-rows"]["heldout_loss"]) else None
    nan = float("nan")
    for v in variants:
        m = med[v]
        m["x_best"] = m["tokens_per_s"] / med[best]["tokens_per_s"] if best else nan
        m["x_pad"] = m["tokens_per_s"] / med["hf-pad"]["tokens_per_s"] if "hf-pad" in med else nan
        m["mem_vs_best"] = m["peak_mb"] / med[best]["peak_mb"] if best else nan
        m["loss_ref"] = loss_reference(v, best, same)
        m["loss_rel_best"] = _rel(m["heldout_loss"], med[best]["heldout_loss"]) if best else nan
        m["loss_rel"] = _rel(m["heldout_loss"], med[m["loss_ref"]]["heldout_loss"]) if m["loss_ref"] else nan
        m["mfu"] = m["tflops"] / peak_tflops if peak_tflops else nan
    rounds = max(len(r) for r in results.values())
    print(f"\nvocab {vocab}: medians over {rounds} round(s); ratios vs the best correct transformers variant "
          f"({best or 'none run'}); tok/CPU-s counts this process's CPU time (all threads)")
    cols = [("variant", 16), ("real tok/s", 10), ("x best", 6), ("x pad", 6), ("tok/CPU-s", 9), ("peak MB", 8),
            ("mem/best", 8), ("train loss", 10), ("held-out", 8), ("vs best", 7), ("steps", 5)]
    if peak_tflops:
        cols[5:5] = [("TFLOP/s", 7), ("MFU", 6)]
    print("| " + " | ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(cols)) + " |")
    print("|" + "|".join("-" * (w + 2) for _, w in cols) + "|")
    for v in variants:
        m = med[v]
        cells = [f"{v:<16}", f"{m['tokens_per_s']:>10.0f}", f"{m['x_best']:>6.2f}", f"{m['x_pad']:>6.2f}",
                 f"{m['tokens_per_cpu_s']:>9.0f}", f"{m['peak_mb']:>8.0f}", f"{m['mem_vs_best']:>8.2f}",
                 f"{m['train_loss']:>10.4f}", f"{m['heldout_loss']:>8.4f}", f"{m['loss_rel_best']:>+7.2%}",
                 f"{m['steps']:>5.0f}"]
        if peak_tflops:
            cells[5:5] = [f"{m['tflops']:>7.1f}", f"{m['mfu']:>6.1%}"]
        note = "  <- attends across documents (wrong): shown, not a reference" if v == "hf-packed-xdoc" else ""
        if v == "hf-rows":
            note = "  <- ftlib's packed micro-batches' documents, padded: the held-out reference of the ftlib variants"
        if v == "hf-sorted-mp":
            err = m["gemm_rel_err"]
            note = (f"  <- matmul precision 'medium': GEMM error {err:.1e} of float64, "
                    + ("fp32 arithmetic (a reference)" if err <= FP32_GEMM_TOL else "reduced precision: shown, not a reference"))
        print("| " + " | ".join(cells) + " |" + note)
    for v in variants:
        med[v]["loss_ok"] = abs(med[v]["loss_rel"]) <= loss_tol  # nan (no baseline) fails
    checked = [v for v in variants if v not in ("hf-packed-xdoc", "hf-rows")
               and (v != "hf-sorted-mp" or v in correct_hf(med))]
    bad = [v for v in checked if not med[v]["loss_ok"]]
    refs = sorted({med[v]["loss_ref"] or "none run" for v in checked})
    print(f"held-out loss check, |relative difference to {' / '.join(refs)}| <= {loss_tol:.2%}: "
          + ", ".join(f"{v} {med[v]['loss_rel']:+.3%} vs {med[v]['loss_ref']}" for v in checked if v.startswith("ftlib"))
          + (" -- all correct variants pass" if not bad else " -- FAIL: " + ", ".join(
              f"{v} {med[v]['loss_rel']:+.2%}" for v in bad)
              + ("" if same or not any(v.startswith("ftlib") for v in bad) else
                 " (trained on different batches; add hf-rows to --variants for the same-data reference)")))
    warm = {v: med[v].get("warmup_s") for v in variants if v.startswith("ftlib")}
    if "ftlib" in warm and "ftlib-compile" in warm:
        per_step = {v: med[v]["timed_s"] / max(1.0, med[v]["steps"] - (3 if v == "ftlib-compile" else 2))
                    for v in ("ftlib", "ftlib-compile")}
        extra = warm["ftlib-compile"] - warm["ftlib"] * 3 / 2  # compile's warm-up has 3 steps, eager's 2
        saved = per_step["ftlib"] - per_step["ftlib-compile"]
        print(f"torch.compile: {extra:.0f} s of compilation in the warm-up, {saved:+.2f} s per step afterwards: "
              + (f"pays back after {extra / saved:.0f} steps" if saved > 0 else "never pays back"))
    return {"best": best, "med": med}


def _rel(x: float, ref: float) -> float:
    return (x - ref) / ref


def loss_reference(variant: str, best: str | None, same: str | None) -> str | None:
    """The transformers run a variant's held-out loss is checked against: for ftlib's variants the run
    on the same documents in the same steps (``hf-rows``) when it ran, else (and for the transformers
    variants) the best correct one. Variants that batch differently see different gradients each
    step; after a few steps of a fast-moving loss that shows beyond the tolerance. Measured on the quick
    MoE job (4 steps): ftlib 8.78172 against hf-budget's 8.72080 (+0.70 %), against hf-rows' 8.78170
    (+2e-6), and ftlib fed hf-budget's padded batches gives 8.72080 -- the gap is the batching."""
    return same if same and variant.startswith("ftlib") else best


def write_csv(path, args, vocab, results, summary, peak_tflops=None):
    import torch

    import ftlib

    new = not os.path.exists(path)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or platform.machine())
    med, b = summary["med"], summary["best"]
    with open(path, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["date", "device", "device_name", "threads", "load_avg", "torch", "ftlib", "shape", "vocab",
                        "seq_len", "tokens_budget", "round", "variant", "real_tokens_per_s", "real_tokens_per_cpu_s",
                        "tflops", "mfu", "peak_mb", "train_loss", "heldout_loss", "steps", "timed_s",
                        "speedup_vs_best_hf", "peak_ratio_vs_best_hf", "heldout_rel_diff", "best_hf", "correct",
                        "layers", "warmup_s", "heldout_ok"])
        for v, rs in results.items():
            for i, r in enumerate(rs):
                if r.get("failed"):
                    continue
                xb = r["tokens_per_s"] / med[b]["tokens_per_s"] if b else float("nan")
                mb = r["peak_mb"] / med[b]["peak_mb"] if b else float("nan")
                ref = med[v]["loss_ref"]
                lr = _rel(r["heldout_loss"], med[ref]["heldout_loss"]) if ref else float("nan")
                mfu = r["tflops"] / peak_tflops if peak_tflops else float("nan")
                w.writerow([date, args.device, dev_name, args.threads, f"{r.get('load_avg', float('nan')):.2f}",
                            torch.__version__, ftlib.__version__, shape_tag(args), vocab,
                            r.get("seq_len"), _budget(args, vocab), i, v, f"{r['tokens_per_s']:.1f}",
                            f"{r['tokens_per_cpu_s']:.1f}", f"{r['tflops']:.3f}", f"{mfu:.4f}", f"{r['peak_mb']:.0f}",
                            f"{r['train_loss']:.5f}", f"{r['heldout_loss']:.5f}", r["steps"], f"{r['timed_s']:.2f}",
                            f"{xb:.3f}", f"{mb:.3f}", f"{lr:.4f}", b,
                            v not in ("hf-packed-xdoc", "hf-rows") and (v != "hf-sorted-mp" or v in correct_hf(med)),
                            model_shape(args)["num_hidden_layers"], f"{r.get('warmup_s', float('nan')):.1f}",
                            abs(lr) <= (args.loss_tol if vocab == args.vocab[0] else args.loss_tol_large)])


RUN_FIELDS = ["date", "device", "device_name", "torch", "ftlib", "shape", "layers", "vocab", "seq_len", "round",
              "variant", "status", "real_tokens_per_s", "tflops", "peak_mb", "train_loss", "heldout_loss", "steps",
              "timed_s", "warmup_s"]


def write_run_row(path, args, vocab, rnd, variant, r):
    """One run's own numbers, appended the moment it finishes (train.csv's ratios follow per vocab size)."""
    import torch

    import ftlib

    sys.path.insert(0, HERE)
    from _summary import append_row

    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or platform.machine())
    nan = float("nan")
    g = (lambda k, fmt: format(r.get(k, nan), fmt)) if not r.get("failed") else (lambda k, fmt: "nan")
    append_row(path, RUN_FIELDS, [
        datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), args.device, dev_name,
        torch.__version__, ftlib.__version__, shape_tag(args),
        model_shape(args)["num_hidden_layers"], vocab, r.get("seq_len"), rnd, variant,
        "failed" if r.get("failed") else "ok", g("tokens_per_s", ".1f"), g("tflops", ".3f"), g("peak_mb", ".0f"),
        g("train_loss", ".5f"), g("heldout_loss", ".5f"), r.get("steps", 0), g("timed_s", ".2f"),
        g("warmup_s", ".1f")])


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _budget(args, vocab):
    return args.tokens if vocab == args.vocab[0] else args.tokens_large


def have_baseline() -> str | None:
    """None when transformers and peft import, else the reason."""
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for train.csv (appended)")
    ap.add_argument("--work-dir", default=os.environ.get("FTLIB_BENCH_WORK") or None,
                    help="folder for the initial checkpoints, reused across runs and kept (default: $FTLIB_BENCH_WORK, "
                    "else a temporary one, removed at the end, on SIGTERM too)")
    ap.add_argument("--quick", action="store_true", help="smoke run: one round, vocab 8192, a small budget")
    ap.add_argument("--profile", action="store_true", help="phase breakdown of ftlib's step (no baseline)")
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--variants", default=None, help=f"comma list of {VARIANTS} (default: all; hf-rows, slow, only "
                    "with --family qwen3_moe, whose short runs need the same-data reference)")
    ap.add_argument("--vocab", default="8192,131072", help="comma list of vocabulary sizes")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (medians over them)")
    ap.add_argument("--tokens", type=int, default=40_000, help="real-token budget per run at the first vocab")
    ap.add_argument("--tokens-large", type=int, default=4_000, help="real-token budget at the other vocab sizes")
    ap.add_argument("--rounds-large", type=int, default=1, help="rounds at the other vocab sizes")
    ap.add_argument("--docs", type=int, default=3000, help="training documents")
    ap.add_argument("--max-len", type=int, default=1024, help="documents are cut to this many tokens (max_length)")
    ap.add_argument("--seq-len", type=int, default=2048, help="packed row length = real tokens per micro-batch "
                    "(first vocab)")
    ap.add_argument("--seq-len-large", type=int, default=1024, help="the same at the other vocab sizes (their "
                    "[tokens, V] logits dominate memory: transformers keeps several copies)")
    ap.add_argument("--heldout-docs", type=int, default=200)
    ap.add_argument("--heldout-docs-large", type=int, default=60, help="held-out documents at the other vocab sizes "
                    "(scoring them through a [tokens, V] head dominates a short run there)")
    ap.add_argument("--layers", type=int, default=None, dest="layers_first", help="decoder layers at the first "
                    "vocab size (default: the shape's)")
    ap.add_argument("--layers-large", type=int, default=None, help="decoder layers at the other vocab sizes "
                    "(default: the shape's; the head dominates there)")
    ap.add_argument("--pad-budget", type=float, default=1.125, help="hf-budget / hf-sorted: padded tokens per batch "
                    "as a multiple of --seq-len x --rows (1.125: ~as many real tokens per step as a packed row)")
    ap.add_argument("--malloc", default="keep", choices=["keep", "default"], help="keep: every worker's glibc "
                    "malloc keeps freed memory (no page faults per step); default: glibc's defaults")
    ap.add_argument("--loss-tol", type=float, default=0.005, help="held-out loss: largest relative difference to "
                    "the best correct transformers variant that passes (first vocab size)")
    ap.add_argument("--loss-tol-large", type=float, default=0.015, help="the same at the other vocab sizes (fewer "
                    "steps on different batches: the order of the data shows)")
    ap.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the timing (3 when compiled)")
    ap.add_argument("--rows", type=int, default=1, help="packed rows of 2048 per micro-batch (padded: as many tokens)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--gpu-1b", action="store_true", help="Llama-3.2-1B shape, vocab 128256, bf16")
    ap.add_argument("--family", default="llama", choices=FAMILIES, help="the job's model: the dense Llama shape, "
                    "a Qwen3 of the same width (q/k norms, head_dim 128, tied head) or a Qwen3-MoE (8 experts, top-2)")
    ap.add_argument("--bf16", action="store_true", help="bf16 base weights and autocast (implied by --gpu-1b)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting runs after this many seconds")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device bf16 peak for MFU (default: by name)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.variants is None:
        args.variants = ",".join(v for v in VARIANTS if v != "hf-rows" or args.family == "qwen3_moe")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; choose from {VARIANTS}")
    args.vocab = [int(v) for v in args.vocab.split(",")]
    if args.quick:
        args.rounds, args.vocab, args.tokens, args.docs = 1, [8192], 6000, 600
    if args.gpu_1b and args.family != "llama":
        ap.error(f"--gpu-1b is Llama-3.2-1B's shape; --family {args.family} runs the CPU job's width")
    if args.gpu_1b:
        args.vocab, args.bf16 = [128256], True
        if args.rows == 1:
            args.rows = 4
    return args


def profile(args):
    """ftlib's step in this process: median time per phase over --profile-steps, then the top ops."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.set_num_threads(args.threads)
    work = args.work_dir or tempfile.mkdtemp(prefix="ftlib_bench_train_")
    vocab = args.vocab[0]
    try:
        base, adapter = make_initial_weights(work, vocab, args)
        spec = dict(variant="ftlib", vocab=vocab, base=base, adapter=adapter, device=args.device, docs=args.docs,
                    heldout_docs=args.heldout_docs, rows=args.rows, bf16=args.bf16, seq_len=args.seq_len,
                    max_len=args.max_len)
        torch.manual_seed(0)
        model, opt, clip, loader, _ = setup_ftlib(spec)
        phases = dict(zip(("forward", "loss", "backward", "optimizer"), ftlib_phases(model, opt, clip, args.device)))
        it = iter(loader)
        times = {k: [] for k in ("data", *phases)}
        cpu = {k: [] for k in times}
        tokens = []

        def one_step(record):
            t, c = time.perf_counter(), time.process_time()
            batch = next(it)
            marks = [("data", time.perf_counter() - t, time.process_time() - c)]
            for name, fn in phases.items():
                t, c = time.perf_counter(), time.process_time()
                fn(batch) if name == "forward" else fn()
                _sync(args.device)
                marks.append((name, time.perf_counter() - t, time.process_time() - c))
            if record:
                for k, v, vc in marks:
                    times[k].append(v)
                    cpu[k].append(vc)
                tokens.append(real_tokens(batch))

        for i in range(args.warmup_steps + args.profile_steps):
            one_step(i >= args.warmup_steps)
        total = sum(statistics.median(v) for v in times.values())
        total_cpu = sum(statistics.median(v) for v in cpu.values())
        print(f"ftlib step, vocab {vocab}, {args.threads} threads, median of {args.profile_steps} steps "
              f"({statistics.median(tokens):.0f} real tokens/step, load average {os.getloadavg()[0]:.2f}); "
              "CPU ms = this process's CPU time (steadier than wall time on a shared machine):")
        print(f"| {'phase':<10} | {'wall ms':>8} | {'share':>6} | {'CPU ms':>8} | {'share':>6} |")
        print(f"|{'-' * 12}|{'-' * 10}|{'-' * 8}|{'-' * 10}|{'-' * 8}|")
        for k in times:
            w, c = statistics.median(times[k]), statistics.median(cpu[k])
            print(f"| {k:<10} | {1e3 * w:>8.1f} | {w / total:>6.1%} | {1e3 * c:>8.1f} | {c / total_cpu:>6.1%} |")
        print(f"| {'total':<10} | {1e3 * total:>8.1f} | {1:>6.0%} | {1e3 * total_cpu:>8.1f} | {1:>6.0%} |  -> "
              f"{statistics.median(tokens) / total:.0f} real tokens/s (wall)")
        with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])) as p:
            one_step(False)
        key = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
        print(p.key_averages().table(sort_by=key, row_limit=20))
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return run_worker(args.worker, args.worker_out)
    if args.profile:
        return profile(args)
    t_start = time.perf_counter()
    missing = have_baseline()
    variants = list(args.variants)
    if missing:
        print(f"transformers/peft not importable ({missing}): the baseline variants are skipped and no ratios "
              "are computed; install them with  pip install -e '.[bench]'")
        variants = [v for v in variants if v.startswith("ftlib")]
    os.makedirs(args.out, exist_ok=True)
    work = args.work_dir or tempfile.mkdtemp(prefix="ftlib_bench_train_")
    os.makedirs(work, exist_ok=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # a timeout's SIGTERM still runs the clean-up below
    print(f"bench_train: {args.device}, {args.threads} threads, load average {os.getloadavg()[0]:.2f} "
          f"(timings on a shared machine are noisy: variants alternate, medians are shown)")
    summaries = {}
    peak = device_peak_tflops(args)
    try:
        for vocab in args.vocab:
            first = vocab == args.vocab[0]
            args.layers = args.layers_first if first else args.layers_large
            base, adapter = make_initial_weights(work, vocab, args)
            results = {v: [] for v in variants}
            for rnd in range(args.rounds if first else args.rounds_large):
                for v in variants:
                    if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
                        print(f"    --budget-s {args.budget_s:g} reached: {v} round {rnd} not started")
                        continue
                    spec = dict(variant=v, vocab=vocab, round=rnd, base=base, adapter=adapter, device=args.device,
                                threads=args.threads, tokens=_budget(args, vocab), docs=args.docs,
                                heldout_docs=args.heldout_docs if first else args.heldout_docs_large,
                                rows=args.rows, bf16=args.bf16, pad_budget=args.pad_budget, malloc=args.malloc,
                                layers=args.layers,
                                seq_len=args.seq_len if first else args.seq_len_large, max_len=args.max_len,
                                warmup_steps=args.warmup_steps + (1 if v == "ftlib-compile" else 0),
                                max_s=max(5.0, args.budget_s - (time.perf_counter() - t_start))
                                if args.budget_s else 1e9, gpu_1b=args.gpu_1b, family=args.family)
                    r = spawn(spec, work)
                    results[v].append(r)
                    write_run_row(os.path.join(args.out, "train_runs.csv"), args, vocab, rnd, v, r)
                    if not r.get("failed"):
                        print(f"  vocab {vocab} round {rnd} {v:<15} {r['tokens_per_s']:8.0f} tok/s  peak "
                              f"{r['peak_mb']:6.0f} MB  held-out {r['heldout_loss']:.4f}  ({r['steps']} steps, "
                              f"{r['process_s']:.0f} s in all, warm-up {r['warmup_s']:.0f} s)", flush=True)
            summaries[vocab] = summarize(vocab, results, variants, peak,
                                         args.loss_tol if first else args.loss_tol_large)
            write_csv(os.path.join(args.out, "train.csv"), args, vocab, results, summaries[vocab], peak)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nrows appended to {os.path.join(args.out, 'train.csv')}; {time.perf_counter() - t_start:.0f} s in all")
    ft = summaries[args.vocab[0]]["med"].get("ftlib", {})
    line = (f"speedup_vs_best={ft.get('x_best', float('nan')):.3f} speedup_vs_pad={ft.get('x_pad', float('nan')):.3f} "
            f"peak_memory_ratio={ft.get('mem_vs_best', float('nan')):.3f} "
            f"heldout_loss_rel_diff={abs(ft.get('loss_rel', float('nan'))):.4f}")
    for vocab in args.vocab[1:]:
        m = summaries[vocab]["med"].get("ftlib", {})
        line += f" peak_memory_ratio_vocab{vocab}={m.get('mem_vs_best', float('nan')):.3f}"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
