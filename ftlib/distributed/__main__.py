"""``python -m ftlib.distributed memory``: per-GPU memory of full / LoRA / QLoRA fine-tuning (see ``memory``).

    python -m ftlib.distributed memory --model config.json --gpus 8 --lora-r 16 --qlora
    python -m ftlib.distributed memory --model meta-llama-3-8b/ --gpus 1 2 4 8       # all three methods
    python -m ftlib.distributed memory --model llama-3-70b --gpus 2 --qlora --cpu-offload both --gpu-gib 24
"""

from __future__ import annotations

import argparse
import json
import sys

from .memory import METHODS, PRESETS, estimate_memory, format_table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ftlib.distributed", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("memory", help="estimate per-GPU memory (parameters, gradients, optimizer, activations)")
    m.add_argument("--model", required=True, help="a Hugging Face config.json, the folder holding it, a hub repo id, or a preset: "
                   + ", ".join(sorted(PRESETS)))
    m.add_argument("--gpus", type=int, nargs="+", default=[1], help="number(s) of GPUs (ranks), e.g. 1 2 4 8")
    m.add_argument("--shard-size", type=int, default=None,
                   help="ranks per FSDP2 shard group (HSDP: shard within a node, replicate across); default all")
    m.add_argument("--method", choices=METHODS, action="append", help="full, lora or qlora (repeatable; default all)")
    m.add_argument("--qlora", action="store_true", help="same as --method qlora")
    m.add_argument("--full", action="store_true", help="same as --method full")
    m.add_argument("--lora-r", type=int, default=16)
    m.add_argument("--targets", default="all-linear", help="'all-linear' or comma-separated module names")
    m.add_argument("--lora-dropout", type=float, default=0.05)
    m.add_argument("--batch-size", type=int, default=1, help="packed rows per micro-batch per rank")
    m.add_argument("--seq-len", type=int, default=2048)
    m.add_argument("--no-grad-ckpt", action="store_true", help="without activation checkpointing")
    m.add_argument("--optimizer", choices=["adamw", "adamw8bit"], default="adamw")
    m.add_argument("--cpu-offload", nargs="?", const="yes", default="no", choices=["no", "yes", "both"],
                   help="FSDP2 CPU offload of parameters, gradients and optimizer state (both: rows with and without)")
    m.add_argument("--gpu-gib", type=float, default=None, help="add a column: does the total fit a GPU of this size")
    m.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    args = p.parse_args(argv)

    methods = list(args.method or [])
    methods += ["qlora"] * args.qlora + ["full"] * args.full
    methods = list(dict.fromkeys(methods)) or list(METHODS)
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    offload = {"no": [False], "yes": [True], "both": [False, True]}[args.cpu_offload]
    try:
        config = args.model  # estimate_memory reads it (a file, a folder, a repo id or a preset name)
        rows = [estimate_memory(config, method=meth, gpus=g, shard_size=args.shard_size, lora_r=args.lora_r,
                                lora_targets=targets, lora_dropout=args.lora_dropout, batch_size=args.batch_size,
                                seq_len=args.seq_len, grad_ckpt=not args.no_grad_ckpt, optimizer=args.optimizer,
                                cpu_offload=off)
                for meth in methods for g in args.gpus for off in offload]
    except (OSError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        for r in rows:
            print(json.dumps(r.to_dict()))
        return 0
    e0 = rows[0]
    print(f"{args.model}: {e0.n_params / 1e9:.2f}B parameters; {args.batch_size} x {args.seq_len} tokens per rank, "
          f"activation checkpointing {'off' if args.no_grad_ckpt else 'on'}, {args.optimizer}"
          + (f", LoRA r={args.lora_r} on {args.targets}" if any(m != "full" for m in methods) else ""))
    print("GiB on the busiest rank (see ftlib/distributed/memory.py for what each column counts); host and load host:"
          " host memory per rank while training and while loading (a node needs it times its ranks)\n")
    print(format_table(rows, gpu_gib=args.gpu_gib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
