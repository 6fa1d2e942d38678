"""A Bradley-Terry reward model with LoRA from a loop you own: read it top to bottom, copy it, change it.

    python examples/reward_model.py --demo --out runs/rm                 # tiny model, CPU, about a minute
    python examples/reward_model.py --model meta-llama/Llama-3.2-1B-Instruct --data prefs/train.jsonl \\
        --eval-data prefs/eval.jsonl --out runs/rm
    torchrun --nproc_per_node=8 examples/reward_model.py ...             # DDP, pairs sharded by rank

Pairs are JSONL records {"messages": [prompt turns], "chosen": str, "rejected": str}. The recipe: the
base model's decoder + a scalar score head (a causal-LM checkpoint gets a new head), LoRA on the decoder
and the head trained in full, the pairs tokenized once into a pair cache (the one DPO uses), then the
loop: B pairs (each side its own sequence) -> scores at each sequence's last token -> Bradley-Terry
loss -log sigmoid(r_chosen - r_rejected) -> backward -> clip -> step -> schedule -> log -> held-out
pairwise accuracy + checkpoint. ``--resume`` continues from the newest checkpoint. The model is saved
as a PEFT adapter and as a merged checkpoint that ``transformers`` loads as
``<Arch>ForSequenceClassification``. ``--demo``: arithmetic pairs (the right sum chosen, a wrong one
rejected); held-out comparisons pair seen questions with unseen wrong answers. ``ftlib reward`` is
the full command (margins, rank decay, scored pairs files, on-policy pairs, configs, loggers).
"""

import argparse
import json
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from ftlib.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint
from ftlib.clip import GlobalNormClipper
from ftlib.data import PairConfig, PairLoader, build_pair_cache
from ftlib.distributed import init_distributed, wrap_ddp
from ftlib.evaluation import reward_pair_metrics
from ftlib.lora import LoRAConfig, apply_lora, merge_and_unload, save_adapter, trainable_params
from ftlib.losses import bradley_terry_loss
from ftlib.models import load_reward_model, load_tokenizer, pair_rewards, pairwise_accuracy, save_reward_model
from ftlib.sched import LRScheduler, WarmupDecay
from ftlib.train import copy_tokenizer_files, plan_steps
from ftlib.train.demo import make_demo_assets, reward_demo_pairs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF folder or hub id (causal LM or sequence classification)")
    p.add_argument("--data", nargs="+", help="training pairs (JSONL files or folders)")
    p.add_argument("--eval-data", nargs="+", help="held-out pairs")
    p.add_argument("--out", required=True)
    p.add_argument("--demo", action="store_true", help="tiny demo model and arithmetic pairs")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (1e-4; demo 1e-3)")
    p.add_argument("--batch-size", type=int, default=None, help="pairs per micro-batch (16; demo 8)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs; demo 200)")
    p.add_argument("--max-length", type=int, default=1024, help="prompt + one answer, in tokens")
    p.add_argument("--save-every", type=int, default=50, help="steps between held-out evals and checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.demo and not (args.model and args.data):
        p.error("--model and --data are required (or --demo)")
    for k, (real, demo) in {"lr": (1e-4, 1e-3), "batch_size": (16, 8), "max_steps": (None, 200)}.items():
        if getattr(args, k) is None:
            setattr(args, k, demo if args.demo else real)
    return args


def main(argv=None):
    args = parse_args(argv)
    env = init_distributed()  # torchrun: one process per GPU; plain python: rank 0 of 1
    rank, world, device = env.rank, env.world_size, env.device
    torch.manual_seed(args.seed)  # the same score-head init on every rank
    out = Path(args.out)
    log = print if rank == 0 else (lambda *a: None)
    barrier = torch.distributed.barrier if world > 1 else (lambda: None)
    if args.demo:  # ftlib/train/demo.py: the demo model and the arithmetic pairs (rank 0 writes them)
        if device.type == "cpu":
            torch.set_num_threads(1)  # a 2-layer model: more threads cost CPU time, not wall time
        if rank == 0:
            make_demo_assets(out / "demo")
            reward_demo_pairs(out / "demo" / "pairs", seed=args.seed)
        barrier()
        args.model = str(out / "demo" / "base")
        args.data, args.eval_data = [str(out / "demo" / "pairs" / "train.jsonl")], [str(out / "demo" / "pairs" / "eval.jsonl")]

    # 1. decoder + scalar score head; 2. LoRA on the decoder, the head trained in full
    model = load_reward_model(args.model, dtype=torch.float32, device=device)
    tok = load_tokenizer(args.model)
    apply_lora(model, LoRAConfig(r=16, alpha=32, target_modules="all-linear", modules_to_save=["score"]), verbose=False)

    # 3. pairs -> pair caches (tokenized once), read as padded rows: chosen and rejected each its own sequence
    pcfg = PairConfig(kind="chat", chat_template=tok.chat_template, eos_token=tok.eos_token,
                      bos_token=tok.bos_token, max_length=args.max_length)
    pad_id = tok.pad_id
    caches = {}
    for split, src in (("train", args.data), ("eval", args.eval_data)):
        if src:
            if rank == 0:  # one process tokenizes, the others open the cache it wrote
                build_pair_cache(src, tok.tokenizer, pcfg, str(out / f"cache_{split}"), progress=False)
            barrier()
            caches[split] = build_pair_cache(src, tok.tokenizer, pcfg, str(out / f"cache_{split}"), progress=False)
    loader = PairLoader(caches["train"], batch_size=args.batch_size, pad_id=pad_id, packing=False, seed=args.seed)
    plan = plan_steps(len(loader), grad_accum=args.grad_accum, epochs=args.epochs, max_steps=args.max_steps)

    # 4. optimizer, clipper, schedule; the DDP-wrapped model; the held-out numbers
    params = list(trainable_params(model).values())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = LRScheduler(opt, WarmupDecay(plan.total, warmup_ratio=0.05, min_lr_ratio=0.1))
    clipper = GlobalNormClipper(1.0)
    scorer = wrap_ddp(model) if world > 1 else model
    autocast = lambda: torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")

    def held_out() -> dict | None:  # Bradley-Terry loss and pairwise accuracy of the held-out pairs
        if "eval" not in caches or rank != 0:
            return None
        return reward_pair_metrics(model, caches["eval"], pad_id=pad_id, device=device, autocast=autocast)

    # 5. the loop: resume from the newest checkpoint, then one iteration = one optimizer step
    ckpt = Checkpointer(out / "checkpoints", keep=2) if rank == 0 else None
    step, logs, evals = 0, [], []
    if args.resume and (last := latest_checkpoint(out / "checkpoints")) is not None:
        state = load_checkpoint(last, model=model, optimizer=opt, scheduler=sched, clipper=clipper, loader=loader)
        step, logs, evals = state.step, state.extra["logs"], state.extra["evals"]
        log(f"resumed from {last} at step {step}")
    if step == 0 and (m := held_out()) is not None:
        evals.append({"step": 0, **m})  # the untrained score head
        log(f"held-out before training: {json.dumps(m)}")
    model.train()
    while step < plan.total:
        epoch, consumed = plan.position(step)
        loader.set_epoch(epoch)  # after a resume the loader's state says where in the epoch it stopped
        batches = iter(loader)
        for _ in range(consumed // args.grad_accum, plan.steps_per_epoch):
            t0, loss_total, correct, pairs = time.perf_counter(), 0.0, 0.0, 0
            for micro in range(args.grad_accum):
                batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in next(batches).items()}
                # DDP: the gradients are all-reduced once per step, on the last micro-batch
                sync = scorer.no_sync() if world > 1 and micro < args.grad_accum - 1 else nullcontext()
                with sync:
                    with autocast():
                        chosen, rejected = pair_rewards(scorer, batch)  # [B] scores each, at each sequence's end
                    loss_sum, n = bradley_terry_loss(chosen, rejected)  # sum of -log sigmoid(r_c - r_r), pairs
                    (loss_sum / n / args.grad_accum).backward()
                loss_total += float(loss_sum.detach()) / float(n) / args.grad_accum
                correct += pairwise_accuracy(chosen.detach(), rejected.detach()) * len(chosen)
                pairs += len(chosen)
            grad_norm = float(clipper(params).norm_before)  # clipped to norm 1 in place; the norm before
            if math.isfinite(grad_norm):
                opt.step()
            else:  # a bad batch: the update is skipped rather than poisoning the weights
                log(f"step {step + 1}: gradient norm {grad_norm}, update skipped")
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            rec = {"step": step, "loss": round(loss_total, 4), "batch_accuracy": correct / pairs,
                   "grad_norm": round(grad_norm, 4), "lr": sched.get_last_lr()[0],
                   "pairs_per_s": round(pairs * world / (time.perf_counter() - t0), 1)}
            logs.append(rec)
            if step % 25 == 0 or step == plan.total:
                log(json.dumps(rec))
            if step % args.save_every == 0 or step == plan.total:
                if (m := held_out()) is not None:
                    evals.append({"step": step, **m})
                    log(f"held-out at step {step}: {json.dumps(m)}")
                if ckpt is not None:  # weights, optimizer, schedule, clipper, loader position, RNG, the log
                    ckpt.save(step, model=model, optimizer=opt, scheduler=sched, clipper=clipper, loader=loader,
                              extra={"logs": logs, "evals": evals}, base_model_name_or_path=args.model)
            if step >= plan.total:
                break

    # 6. the adapter (PEFT, SEQ_CLS) and a merged checkpoint transformers loads, each with the tokenizer
    if rank == 0:
        ckpt.close()
        save_adapter(model, out / "adapter", base_model_name_or_path=args.model, task_type="SEQ_CLS")
        save_reward_model(merge_and_unload(model, dtype=None), out / "reward_model", pad_token_id=tok.pad_token_id)
        for folder in ("adapter", "reward_model"):
            copy_tokenizer_files(args.model, out / folder)
        (out / "train_log.json").write_text(json.dumps({"log": logs, "evals": evals}, indent=1))
        if evals:
            log(f"held-out pairwise accuracy: {evals[0]['eval_accuracy']:.3f} before, "
                f"{evals[-1]['eval_accuracy']:.3f} after ({len(caches['eval'])} pairs)")
    if world > 1:
        torch.distributed.destroy_process_group()
    return {"log": logs, "evals": evals}


if __name__ == "__main__":
    main()
