"""``python -m ftlib.distributed memory``: per-GPU memory of full / LoRA / QLoRA fine-tuning (see ``memory``).

    python -m ftlib.distributed memory --model config.json --gpus 8 --lora-r 16 --qlora
    python -m ftlib.distributed memory --model meta-llama-3-8b/ --gpus 1 2 4 8       # all three methods
    python -m ftlib.distributed memory --model llama-3-70b --gpus 2 --qlora --cpu-offload both --gpu-gib 24
    python -m ftlib.distributed memory --model llama-3.1-8b --max-context 24 80 141 --lora-r 32 --lora-dropout 0 \
        --method lora --method qlora --mlp-chunks 8 --offload-activations both     # the longest context that fits
"""

from __future__ import annotations

import argparse
import json
import sys

from .memory import (
    METHODS,
    PRESETS,
    activation_terms,
    block_lora_targets,
    estimate_memory,
    format_table,
    format_terms,
    max_context,
)


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
    m.add_argument("--max-context", type=float, nargs="*", default=None, metavar="GIB",
                   help="print the largest sequence (batch-size rows of it) that fits GPUs of these sizes "
                        "(GiB; default 24 80 141) and the bytes per token of each saved tensor")
    m.add_argument("--mlp-chunks", type=int, default=1, help="the MLP in K sequence chunks (ftlib.long_context)")
    m.add_argument("--offload-activations", nargs="?", const="yes", default="no", choices=["no", "yes", "both"],
                   help="checkpointed block inputs in host memory (both: rows with and without)")
    m.add_argument("--context-parallel", type=int, default=1,
                   help="ranks one sequence is sharded over (ftlib.distributed.context_parallel); --seq-len is the whole")
    args = p.parse_args(argv)

    methods = list(args.method or [])
    methods += ["qlora"] * args.qlora + ["full"] * args.full
    methods = list(dict.fromkeys(methods)) or list(METHODS)
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    offload = {"no": [False], "yes": [True], "both": [False, True]}[args.cpu_offload]
    act_offload = {"no": [False], "yes": [True], "both": [False, True]}[args.offload_activations]
    long = dict(mlp_chunks=args.mlp_chunks, context_parallel=args.context_parallel)
    try:
        config = args.model  # estimate_memory reads it (a file, a folder, a repo id or a preset name)
        if args.max_context is not None:
            if any(gib <= 0 for gib in args.max_context):
                raise ValueError(f"--max-context: GPU sizes must be > 0 GiB, got {args.max_context}")
            return _max_context(args, config, [m for m in methods if m != "full"] or methods, targets, offload,
                                act_offload, long)
        rows = [estimate_memory(config, method=meth, gpus=g, shard_size=args.shard_size, lora_r=args.lora_r,
                                lora_targets=targets, lora_dropout=args.lora_dropout, batch_size=args.batch_size,
                                seq_len=args.seq_len, grad_ckpt=not args.no_grad_ckpt, optimizer=args.optimizer,
                                cpu_offload=off, activation_offload=aoff, **long)
                for meth in methods for g in args.gpus for off in offload for aoff in act_offload]
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


def _max_context(args, config, methods, targets, offload, act_offload, long) -> int:
    """``--max-context``: the per-token table of each offload setting, then the longest context per method and GPU."""
    sizes = args.max_context or [24.0, 80.0, 141.0]
    gpus = args.gpus[0]
    kw = dict(gpus=gpus, shard_size=args.shard_size, lora_r=args.lora_r, lora_targets=targets,
              lora_dropout=args.lora_dropout, batch_size=args.batch_size, grad_ckpt=not args.no_grad_ckpt,
              optimizer=args.optimizer, **long)
    with_lora = [m for m in methods if m != "full"]
    print(f"{args.model}: longest context on {gpus} GPU(s) of each size, batch {args.batch_size}, "
          f"{args.optimizer}, activation checkpointing {'off' if args.no_grad_ckpt else 'on every block'}, MLP in "
          f"{args.mlp_chunks} chunk(s), context parallel {args.context_parallel}"
          + (f", LoRA r={args.lora_r} on {args.targets} (dropout {args.lora_dropout:g})" if with_lora else ""))
    layer0 = block_lora_targets(config, args.lora_r, targets) if with_lora else {}
    for aoff in act_offload:
        print(f"\nbytes per token{' per rank' if args.context_parallel > 1 else ''}, "
              f"{'with' if aoff else 'without'} activation offload (bf16, flash / Triton attention):")
        print(format_terms(activation_terms(config, lora_targets=layer0, lora_r=args.lora_r,
                                            lora_dropout=args.lora_dropout, mlp_chunks=args.mlp_chunks,
                                            grad_ckpt=not args.no_grad_ckpt, activation_offload=aoff)))
    head = f"{'method':<7}{'cpu off':>8}{'act off':>8}" + "".join(f"{f'{g:g} GiB':>12}" for g in sizes)
    print("\nlongest sequence that fits (tokens; see ftlib/distributed/memory.py, 'Long context'):")
    print(head + "\n" + "-" * len(head))
    out, hosts = [], []
    for meth in methods:
        for off in offload:
            for aoff in act_offload:
                found = [max_context(config, g, method=meth, cpu_offload=off, activation_offload=aoff, **kw)
                         for g in sizes]
                print(f"{meth:<7}{'yes' if off else '-':>8}{'yes' if aoff else '-':>8}"
                      + "".join(f"{n:>12,}" for n, _ in found))
                hosts.append((meth, off, aoff, [e.host if e else 0 for _, e in found]))
                out += [dict(method=meth, cpu_offload=off, activation_offload=aoff, gpu_gib=g, max_context=n,
                             total=e.total if e else None, host=e.host if e else None)
                        for g, (n, e) in zip(sizes, found)]
    if any(any(h) for *_, h in hosts):
        print("\nhost memory at that length (GiB, pinned: offloaded block inputs and CPU-offloaded shards):")
        for meth, off, aoff, h in hosts:
            if any(h):
                print(f"{meth:<7}{'yes' if off else '-':>8}{'yes' if aoff else '-':>8}"
                      + "".join(f"{x / 2**30:>12.1f}" for x in h))
    if args.json:
        for r in out:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
