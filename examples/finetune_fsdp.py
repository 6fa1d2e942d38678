"""LoRA / QLoRA / full fine-tuning on several GPUs (or CPU processes): FSDP2, HSDP or DDP.

    torchrun --standalone --nproc_per_node=8 examples/finetune_fsdp.py \\
        --model meta-llama/Meta-Llama-3-8B-Instruct --data data/chat/ --qlora --grad-ckpt \\
        --seq-len 4096 --batch-size 2 --grad-accum 4 --save-every 200 --out runs/llama3-qlora-fsdp

The loop is ``finetune_lora.py``'s, built from its pieces (arguments, model, data, optimizer,
accumulation, held-out report); what changes is the wrapping and the state on disk:

- ``--engine fsdp`` (default): ``ftlib.distributed.shard_model``, one FSDP2 unit per decoder block
  plus the root; bf16 compute with fp32 gradient reduction under ``--precision bf16``;
  ``--shard-size N`` makes it HSDP (shard within groups of N ranks, replicate across them);
  ``--cpu-offload`` keeps parameters, gradients and optimizer state in host memory.
  ``--engine ddp``: ``wrap_ddp``, with ``--compression fp16|bf16|powersgd``.
- checkpoints are sharded (``ShardedCheckpointer``: every rank writes its part through
  ``torch.distributed.checkpoint``, rotation and best-by-eval-loss as in the one-process layout);
  ``--resume`` restores weights, optimizer, schedule, clipper, loader position and every rank's RNG,
  also on another number of ranks (the data position then needs the same ``batch_size x ranks``).
- the adapter (PEFT format) and, with ``--save-merged``, the merged model (HF format, bf16) are
  written from rank 0, gathered one tensor / one layer at a time.

Every rank loads the base onto its own device before sharding (an 8B model: 16 GB in bf16, or the
NF4 storage after ``--qlora``), then keeps 1/N of it. ``--eval-generate`` (exact match through
greedy generation) is a one-process feature: run ``finetune_lora.py`` on the exported adapter.
``--demo`` trains the tiny demo model as ``finetune_lora.py --demo`` does (CPU: gloo).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import finetune_lora as one  # noqa: E402  examples/finetune_lora.py: the one-process recipe

from ftlib.checkpoint import latest_checkpoint  # noqa: E402
from ftlib.distributed import (  # noqa: E402
    ShardedCheckpointer,
    device_mesh,
    export_adapter,
    export_merged,
    init_distributed,
    load_sharded_checkpoint,
    shard_model,
    wrap_ddp,
)
from ftlib.evaluation import evaluate  # noqa: E402
from ftlib.metrics import FlopsModel, MetricsLogger, device_peak_flops, plot_metrics  # noqa: E402


def build_parser():
    p = one.build_parser()
    p.description = __doc__.split("\n\n")[0]
    g = p.add_argument_group("multi-GPU")
    g.add_argument("--engine", choices=["fsdp", "ddp"], default="fsdp", help="shard (FSDP2/HSDP) or replicate (DDP)")
    g.add_argument("--shard-size", type=int, default=None,
                   help="HSDP: shard within groups of this many ranks (a node), replicate across groups")
    g.add_argument("--cpu-offload", action="store_true", help="FSDP2: parameters, gradients, optimizer state on the host")
    g.add_argument("--no-reshard-after-forward", action="store_true",
                   help="FSDP2: keep gathered weights from forward to backward (more memory, less communication)")
    g.add_argument("--compression", choices=["fp16", "bf16", "powersgd"], default=None, help="DDP gradient compression")
    return p


def wrap(args, loss_module, precision: str):
    """The module the loop calls: FSDP2 / HSDP root or DDP wrapper around the loss module."""
    if args.engine == "ddp":
        if args.shard_size or args.cpu_offload:
            raise SystemExit("--shard-size and --cpu-offload are FSDP2 options (--engine fsdp)")
        return wrap_ddp(loss_module, compression=args.compression)
    if args.compression:
        raise SystemExit("--compression is a DDP option (--engine ddp)")
    mesh = device_mesh(shard=args.shard_size) if args.shard_size else None
    return shard_model(loss_module, mesh=mesh, mixed_precision="bf16" if precision == "bf16" else None,
                       reshard_after_forward=not args.no_reshard_after_forward, cpu_offload=args.cpu_offload)


def resume(args, root: Path, *, train_model, opt, sched, clipper, loader, log):
    """(step, extra, path) of the newest good sharded checkpoint under ``root`` (--resume), else (0, {}, None)."""
    existing = latest_checkpoint(root, full=False)
    if not args.resume:
        if existing is not None:
            raise SystemExit(f"{root} holds checkpoints of an earlier run (newest: {existing.name}): pass "
                             "--resume to continue it, or choose another --out")
        return 0, {}, None
    if existing is None:
        log(f"--resume: no checkpoint in {root}, starting from step 0")
        return 0, {}, None
    state = load_sharded_checkpoint(root, model=train_model, optimizer=opt, scheduler=sched, clipper=clipper,
                                    loader=loader)
    log(f"resumed from {state.path} (step {state.step})")
    return state.step, state.extra, str(state.path)


def main(argv=None):
    t_start = time.perf_counter()
    args = one.parse_args(argv, build_parser())
    if args.eval_generate and not args.demo:
        raise SystemExit("--eval-generate is not available under torchrun: generate with finetune_lora.py from "
                         "the exported adapter")
    args.eval_generate = 0
    env = init_distributed()
    rank, world, device = env.rank, env.world_size, env.device
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    log = functools.partial(print, flush=True) if rank == 0 else (lambda *a, **k: None)
    if args.threads or (args.demo and device.type == "cpu"):
        torch.set_num_threads(args.threads or 1)
    if args.demo:
        one.prepare_demo(args, out, rank, world)  # rank 0 writes the assets, every rank points its args at them
    # The same seed on every rank: every rank draws the same adapter initialisation (shard_model also
    # broadcasts rank 0's weights); dropout differs per rank after the reseed below.
    one.seed_everything(args.seed)

    # 1. model + adapters on this rank's device, then the loss module wrapped for several ranks.
    model, tok = one.load_model(args, device, precision)
    log(f"trainable parameters: {one.count_params(model)}")
    augment_step = one.setup_augmentation(args, tok, model, device, rank, log)
    flops = FlopsModel.from_model(model)  # before sharding: parameter shapes are the full ones
    train_model = wrap(args, one.CausalLMLoss(model), precision)
    one.seed_everything(args.seed + rank)
    log(f"{args.engine} on {world} rank(s)" + (f", HSDP shard groups of {args.shard_size}" if args.shard_size else ""))

    # 2. data: the rank-aware loader of the one-process example (each rank its slice of every step).
    loader, eval_loader, fcfg, data_fp = one.build_data(args, tok, out, rank, world, device)
    pad_id = loader.opts["pad_id"]
    log(f"data: {len(loader.docs)} documents, {len(loader)} micro-batches/epoch/rank"
        + (f"; held out: {len(eval_loader.docs)} documents" if eval_loader is not None else ""))

    # 3. optimizer over the sharded parameters, schedule, checkpoints, resume.
    steps_per_epoch, total = one.plan_steps(args, len(loader))
    save_every = args.save_every if args.save_every is not None else max(1, total // 10)
    eval_every = args.eval_every if args.eval_every is not None else save_every
    opt, clipper, sched = one.build_optimizer(args, model, total, precision)
    ckpt = ShardedCheckpointer(out / "checkpoints", keep=args.keep, metric="eval_loss" if eval_loader else None)
    step, extra, resumed_from = resume(args, out / "checkpoints", train_model=train_model, opt=opt, sched=sched,
                                       clipper=clipper, loader=loader, log=log)
    loss_fn = lambda m, batch: m(batch)  # through the wrapper: FSDP2 gathers the weights in its hooks
    evaluate_ = functools.partial(evaluate, train_model, loss_fn=loss_fn, autocast=opt.autocast)
    before = evaluate_(eval_loader).to_dict() if eval_loader is not None and step == 0 else None
    if rank == 0:
        one.write_manifest(out, args, device=device, world=world, data_fingerprint=data_fp, resumed_from=resumed_from)
    tokens_seen, train_s = extra.get("tokens_seen", 0), extra.get("train_time_s", 0.0)
    logger = MetricsLogger(out / "metrics.jsonl", total_steps=total, start_step=step, rank=rank, world_size=world,
                           device=device, flops=flops, print_every=args.log_every,
                           peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else device_peak_flops(device, precision),
                           tensorboard=out / "tb" if args.tensorboard else None)

    # 4. the loop of finetune_lora.py: one iteration = one optimizer step over grad_accum micro-batches.
    records, metrics = [], {}
    train_model.train()
    t_loop = time.perf_counter()
    while step < total:
        epoch, window = divmod(step, steps_per_epoch)
        loader.set_epoch(epoch)
        it = iter(loader)
        for _ in range(window, steps_per_epoch):
            tokens = one.accumulate(train_model, opt, it, args.grad_accum, device, world, pad_id, augment_step, step)
            res = opt.step(clipper)  # token counts and clip norms over all ranks; every rank skips together
            sched.step(1, loss=res.loss)
            step += 1
            rec = logger.step(step, res, lr=sched.get_last_lr()[0], tokens=tokens, skipped_steps=opt.skipped_steps,
                              epoch=epoch)
            records.append(rec)
            tokens_seen += rec["tokens"]
            metrics = {}
            if eval_loader is not None and ((eval_every and step % eval_every == 0) or step == total):
                metrics = evaluate_(eval_loader).to_dict()
                logger.eval(step, metrics)
            if (save_every and step % save_every == 0) or step == total:
                ckpt.save(step, model=train_model, optimizer=opt, scheduler=sched, clipper=clipper, loader=loader,
                          metrics=metrics, base_model_name_or_path=args.model,
                          extra={"tokens_seen": tokens_seen, "train_time_s": train_s + time.perf_counter() - t_loop})
            if step >= total:
                break
    train_s += time.perf_counter() - t_loop
    logger.close()
    ckpt.close()  # every rank: waits for its last background write

    # 5. exports from rank 0 (collective calls: every rank takes part in the gathers).
    adapter_dir = export_adapter(train_model, out / "adapter", base_model_name_or_path=args.model)
    if args.save_merged:
        export_merged(train_model, out / "merged", dtype=torch.bfloat16)
    if rank == 0:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json") if args.save_merged else ():
            src = Path(args.model) / name
            if src.exists():
                (out / "merged" / name).write_bytes(src.read_bytes())
        log(f"adapter saved to {adapter_dir}; checkpoints in {ckpt.root}"
            + (f" (best by eval loss: {ckpt.best().name})" if ckpt.best() else ""))
        try:
            log(f"metrics: {out / 'metrics.jsonl'}, plot: {plot_metrics(out / 'metrics.jsonl', out / 'metrics.png')}")
        except ImportError as e:
            log(f"metrics: {out / 'metrics.jsonl'} (no plot: {e})")
        summary = {"before": before, "after": metrics or None, "steps": step, "tokens_seen": tokens_seen,
                   "world_size": world, "engine": args.engine, "wall_time_s": time.perf_counter() - t_start,
                   "train_time_s": train_s, "best_checkpoint": str(ckpt.best()) if ckpt.best() else None}
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        if before and metrics:
            log(f"held-out loss: {before['eval_loss']:.4f} -> {metrics['eval_loss']:.4f} "
                f"({step} steps on {world} ranks, {train_s:.0f} s of training)")
    if world > 1:
        torch.distributed.destroy_process_group()
    return model, records


if __name__ == "__main__":
    main()
