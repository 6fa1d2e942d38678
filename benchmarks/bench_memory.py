"""The memory calculator against the GPU: measured peak of one training step vs ``estimate_memory``, one GPU.

For each method (full, LoRA, QLoRA) a randomly initialised model of the given config (default:
Llama-3.2-1B's shape, built here, nothing downloaded) takes two training steps the way
``ftlib sft`` runs them: activation checkpointing per block, bf16 autocast (full
fine-tuning: fp32 masters), packed rows of ``--seq-len`` tokens, the chunked loss, AdamW. The
second step runs after ``torch.cuda.reset_peak_memory_stats()``, so its
``max_memory_allocated`` holds the weights, the optimizer state and the step's peak. The ratio
measured / estimated is printed and appended to the CSV. One GPU only: the estimate for one GPU
(no FSDP); the sharded columns are checked on CPU against a 2-rank FSDP2 run in the tests.

    python benchmarks/bench_memory.py --csv benchmarks/results/memory.csv --budget-s 90
    python benchmarks/bench_memory.py --model path/to/config.json --methods lora qlora

Needs CUDA (``max_memory_allocated`` is a CUDA statistic); ``--cpu-dry-run`` runs the same code
on a tiny config on the CPU to check that it works, without memory figures.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ftlib  # noqa: E402
from ftlib.distributed.memory import GiB, estimate_memory  # noqa: E402
from ftlib.lora import LoRAConfig, apply_lora  # noqa: E402
from ftlib.losses import chunked_cross_entropy  # noqa: E402
from ftlib.models import LlamaConfig, LlamaForCausalLM, load_config  # noqa: E402
from ftlib.optim import TrainOptimizer, make_adamw, param_groups  # noqa: E402

LLAMA32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                  rope_theta=500000.0, max_position_embeddings=8192)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def measure(config, method: str, args, device: torch.device) -> int | None:
    """Peak bytes allocated during the second training step (None on the CPU)."""
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(config)
    if method != "full":
        model.to(torch.bfloat16)
        apply_lora(model, LoRAConfig(r=args.lora_r, alpha=2 * args.lora_r, dropout=args.lora_dropout,
                                     target_modules="all-linear", quantize="nf4" if method == "qlora" else None,
                                     double_quant=True), verbose=False)
    model.set_gradient_checkpointing(every=1)
    opt = TrainOptimizer(make_adamw(param_groups(model, lr=1e-5)), precision="bf16")
    g = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), device=device, generator=g)
    peak = None
    for step in range(2):
        if step == 1 and device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with opt.autocast():
            hidden = model.model(ids)
            loss_sum, n = chunked_cross_entropy(hidden, model.lm_head.weight, ids)
        opt.backward(loss_sum, n)
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    del model, opt, hidden, loss_sum
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return peak


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a config.json (default: Llama-3.2-1B's shape)")
    p.add_argument("--methods", nargs="+", default=["lora", "qlora", "full"], choices=["full", "lora", "qlora"])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--csv", help="append result rows here")
    p.add_argument("--budget-s", type=float, default=None, help="start no new method after this many seconds")
    p.add_argument("--cpu-dry-run", action="store_true", help="tiny config on the CPU: the code path, no figures")
    args = p.parse_args(argv)
    if args.cpu_dry_run:
        device, config = torch.device("cpu"), LlamaConfig(**TINY)
        args.seq_len = min(args.seq_len, 64)
    else:
        if not torch.cuda.is_available():
            print("bench_memory: needs a CUDA device (max_memory_allocated); --cpu-dry-run checks the code path",
                  file=sys.stderr)
            return 2
        device = torch.device("cuda")
        config = load_config(args.model) if args.model else LlamaConfig(**LLAMA32_1B)
    t0 = time.perf_counter()
    rows = []
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{'method':<7}{'measured GiB':>14}{'estimated GiB':>15}{'ratio':>8}")
    for method in args.methods:
        if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
            print(f"budget of {args.budget_s} s spent: {method} not run")
            break
        est = estimate_memory(config, method=method, gpus=1, lora_r=args.lora_r, lora_dropout=args.lora_dropout,
                              batch_size=args.batch_size, seq_len=args.seq_len, grad_ckpt=True)
        try:
            peak = measure(config, method, args, device)
        except Exception as e:  # noqa: BLE001 - one method failing (OOM, a missing package) is reported; the rest run
            print(f"{method:<7} failed: {type(e).__name__}: {str(e)[:160]}")
            continue
        ratio = None if peak is None else peak / est.total
        print(f"{method:<7}{'-' if peak is None else f'{peak / GiB:.2f}':>14}{est.total / GiB:>15.2f}"
              f"{'-' if ratio is None else f'{ratio:.3f}':>8}")
        rows.append({"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": name,
                     "torch": torch.__version__, "ftlib": ftlib.__version__, "params": est.n_params,
                     "method": method, "seq_len": args.seq_len, "batch_size": args.batch_size, "lora_r": args.lora_r,
                     "measured_bytes": peak, "estimated_bytes": est.total,
                     "ratio": None if ratio is None else round(ratio, 4)})
        if args.csv and not args.cpu_dry_run:  # each row as soon as it is measured
            new = not os.path.exists(args.csv)
            with open(args.csv, "a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[-1]))
                if new:
                    w.writeheader()
                w.writerow(rows[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
