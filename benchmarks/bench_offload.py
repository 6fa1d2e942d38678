"""Activation offloading vs checkpointing vs torch's save_on_cpu: step time and peak memory on a GPU.

Configurations (the same LoRA model, batch and kernels; every one computes the same gradients):
  plain           activations stay on the GPU (the time reference; the memory ceiling)
  ckpt_all        activation checkpointing on every block (the usual way to save memory)
  offload_all     ftlib ActivationOffload on every block (side streams, prefetch, 1 MiB threshold)
  save_on_cpu     torch.autograd.graph.save_on_cpu(pin_memory=True) on every block (synchronous)
  ckpt_3of4       checkpoint three blocks in four, offload the fourth (ftlib offload_modules)

Peak memory is torch.cuda.max_memory_allocated during one step beyond what existed before it
(weights, optimizer-free). Steps are timed round-robin after a warm-up; medians and ratios to
``plain`` (time) and ``plain`` (memory) are printed and appended to --out as CSV rows. The run
stops starting new rounds after --budget-s seconds.

``--count-8b`` (CPU, no GPU needed) prints the bytes a Llama-3-8B block saves for backward per token
(the numbers in ftlib/offload.py's docstring).

    python benchmarks/bench_offload.py --out benchmarks/results/offload.csv --budget-s 90
    python benchmarks/bench_offload.py --count-8b
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _summary import append_row, summary  # noqa: E402

import ftlib  # noqa: E402
from ftlib.lora import LoRAConfig, apply_lora  # noqa: E402
from ftlib.losses import chunked_cross_entropy  # noqa: E402
from ftlib.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from ftlib.offload import ActivationOffload, offload_modules, saved_bytes_per_token  # noqa: E402

CONFIGS = ["plain", "ckpt_all", "offload_all", "save_on_cpu", "ckpt_3of4"]


def count_8b() -> None:
    from ftlib.models.llama import BatchPlan, LlamaDecoderLayer
    from ftlib.models.rope import rope_cos_sin, rope_inv_freq

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192)
    holder = nn.Module()
    holder.layer = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16)
    apply_lora(holder, LoRAConfig(r=16, alpha=32, target_modules="all-linear"), verbose=False)
    holder.to(torch.bfloat16)  # the adapters compute in bf16, as under autocast

    def inputs(t):
        x = torch.randn(1, t, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        plan = BatchPlan.build(torch.zeros(1, t, dtype=torch.long))
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None, torch.device("cpu"))
        plan.cos, plan.sin = rope_cos_sin(inv, plan.position_ids, torch.bfloat16)
        return x, plan

    old = os.environ.get("FTLIB_ATTN_BACKEND")
    os.environ["FTLIB_ATTN_BACKEND"] = "torch"  # the reference attention, whose saved tensors the docstring counts
    try:
        r = saved_bytes_per_token(holder.layer, inputs, tokens=(32, 64), min_bytes_at=8192)
    finally:
        if old is None:
            os.environ.pop("FTLIB_ATTN_BACKEND")
        else:
            os.environ["FTLIB_ATTN_BACKEND"] = old
    per_block = r["per_token"]
    print(f"Llama-3-8B block, LoRA r=16 all-linear, bf16, reference attention: {per_block:,.0f} bytes/token "
          f"(+ {r['quadratic']:,.0f} bytes/token^2 of attention scores); in tensors >= 1 MiB at 8k tokens: "
          f"{r['per_token_offloadable']:,.0f}; 32 blocks: {32 * per_block / 1e6:.2f} MB/token")


def build(args) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=int(args.hidden * 3.5),
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                      num_key_value_heads=max(1, args.hidden // 512), max_position_embeddings=args.seq_len)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    apply_lora(model, LoRAConfig(r=16, alpha=32, target_modules="all-linear"), verbose=False)
    return model.cuda()


def setup(model, name):
    """Configure the model for one configuration; returns (context or None, undo)."""
    layers = model.model.layers
    for layer in layers:
        layer.checkpoint_part = None
    if name == "plain":
        return None, lambda: None
    if name == "ckpt_all":
        for layer in layers:
            layer.checkpoint_part = "block"
        return None, lambda: None
    if name == "offload_all":
        return ActivationOffload(), lambda: None
    if name == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=True), lambda: None
    if name == "ckpt_3of4":
        rest = []
        for i, layer in enumerate(layers):
            if i % 4 == 3:
                rest.append(layer)
            else:
                layer.checkpoint_part = "block"
        _, remove = offload_modules(rest)
        return None, remove
    raise ValueError(name)


def step(model, ids, ctx):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if ctx is None:
            hidden = model.model(ids)
        else:
            with ctx:
                hidden = model.model(ids)
        loss, n = chunked_cross_entropy(hidden, model.lm_head.weight, ids)
    (loss / n).backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="append result rows to this CSV file")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=90.0)
    ap.add_argument("--count-8b", action="store_true", help="CPU: bytes saved per token by a Llama-3-8B block")
    args = ap.parse_args()
    if args.count_8b:
        count_8b()
        return
    if not torch.cuda.is_available():
        print("bench_offload: no CUDA device (--count-8b runs on the CPU); nothing measured")
        return
    t_start = time.perf_counter()
    model = build(args)
    ids = torch.randint(0, 32000, (args.batch, args.seq_len), device="cuda")
    times = {c: [] for c in CONFIGS}
    peaks = {}
    name = torch.cuda.get_device_name()
    print(f"{name}: {args.layers} layers, hidden {args.hidden}, {args.batch}x{args.seq_len} tokens, LoRA r=16, bf16")
    for c in CONFIGS:  # warm-up and peak memory, one configuration at a time
        try:
            ctx, undo = setup(model, c)
            step(model, ids, ctx)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(model, ids, ctx)
            torch.cuda.synchronize()
            peaks[c] = torch.cuda.max_memory_allocated() - base
            undo()
        except Exception as e:  # noqa: BLE001 - one configuration's failure (OOM) is reported; the rest run
            print(f"  {c}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            torch.cuda.empty_cache()
    configs = [c for c in CONFIGS if c in peaks]
    for rnd in range(args.iters):  # round-robin timing; the first round always runs (--budget-s 1 included)
        if rnd and time.perf_counter() - t_start > args.budget_s:
            break
        for c in configs:
            try:
                ctx, undo = setup(model, c)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(model, ids, ctx)
                torch.cuda.synchronize()
                times[c].append(time.perf_counter() - t0)
                undo()
            except Exception as e:  # noqa: BLE001 - reported; the other configurations go on
                print(f"  {c} round {rnd}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                torch.cuda.empty_cache()
                continue
            # one row per configuration and round, written as soon as it is timed
            ms = 1e3 * times[c][-1]
            ref = 1e3 * times["plain"][-1] if len(times.get("plain", [])) == rnd + 1 else float("nan")
            row = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": name,
                   "torch": torch.__version__, "ftlib": ftlib.__version__, "host": platform.machine(),
                   "layers": args.layers, "hidden": args.hidden, "tokens": args.batch * args.seq_len, "config": c,
                   "ms": round(ms, 2), "time_vs_plain": round(ms / ref, 3),
                   "peak_mib": round(peaks[c] / 2**20, 1),
                   "mem_vs_plain": round(peaks[c] / peaks["plain"], 3) if "plain" in peaks else float("nan"),
                   "round": rnd}
            if args.out:
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                append_row(args.out, list(row), list(row.values()))
    ref_t = statistics.median(times["plain"]) if times["plain"] else float("nan")
    print(f"{'config':<12} {'ms':>9} {'time/plain':>11} {'peak MiB':>9} {'mem/plain':>10}   (medians over rounds)")
    for c in configs:
        ms = 1e3 * statistics.median(times[c]) if times[c] else float("nan")
        mem = peaks[c] / peaks["plain"] if "plain" in peaks else float("nan")
        print(f"{c:<12} {ms:9.1f} {ms / 1e3 / ref_t:11.3f} {peaks[c] / 2**20:9.0f} {mem:10.3f}")
        if c != "plain":
            summary(f"offload {c}: {ms / 1e3 / ref_t:.2f}x plain's step time, {mem:.2f}x its peak memory "
                    f"({len(times[c])} rounds)")


if __name__ == "__main__":
    main()
