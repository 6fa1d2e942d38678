"""DPO with LoRA from a loop you own: read it top to bottom, copy it, change it.

    python examples/dpo.py --demo --out runs/dpo                  # tiny model, CPU, a few minutes
    python examples/dpo.py --model runs/sft/merged --data pairs.jsonl --eval-data eval.jsonl --out runs/dpo
    torchrun --nproc_per_node=8 examples/dpo.py --model ... --data ... --out ...   # DDP, pairs sharded by rank

Pairs: JSONL records {"messages": [prompt turns], "chosen": str, "rejected": str}. LoRA adapters on the
model (adapters off = the reference, at no memory cost); pairs tokenized once into a pair cache, the
reference log-probs computed once into it; then the loop (both sides of a pair packed in one row,
chunked log-probs). ``--demo``: SFT the tiny demo model, then DPO on its own mistakes; held-out exact
match and reward accuracy before and after. ``ftlib dpo``: the full command (IPO/SimPO/ORPO, QLoRA, ...).
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
from ftlib.data import PairConfig, PairLoader, build_pair_cache, pair_tokens
from ftlib.distributed import init_distributed, wrap_ddp
from ftlib.evaluation import pair_exact_match, pair_metrics, pair_metrics_table
from ftlib.lora import LoRAConfig, apply_lora, load_adapter, merge_and_unload, save_adapter, trainable_params
from ftlib.models import load_pretrained, load_tokenizer
from ftlib.preference import PairLogps, PairPolicy, PreferenceLoss, precompute_reference, reference_pair_logps
from ftlib.sched import LRScheduler, WarmupDecay
from ftlib.train import plan_steps
from ftlib.train.demo import dpo_demo_pairs, dpo_demo_setup


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF folder or hub id: the starting (and reference) model")
    p.add_argument("--data", nargs="+", help="training pairs (JSONL files or folders)")
    p.add_argument("--eval-data", nargs="+", help="held-out pairs")
    p.add_argument("--out", required=True)
    p.add_argument("--demo", action="store_true", help="tiny demo model, SFT first, pairs from its own answers")
    p.add_argument("--beta", type=float, default=None, help="DPO's beta (0.1; demo 0.5)")
    p.add_argument("--rpo-alpha", type=float, default=None, help="weight of the chosen side's NLL (off; demo 1)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (5e-6; demo 1e-3)")
    p.add_argument("--batch-size", type=int, default=4, help="packed rows per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    p.add_argument("--save-every", type=int, default=50, help="steps between held-out evals and checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.demo and not (args.model and args.data):
        p.error("--model and --data are required (or --demo)")
    for k, (real, demo) in {"beta": (0.1, 0.5), "rpo_alpha": (None, 1.0), "lr": (5e-6, 1e-3)}.items():
        if getattr(args, k) is None:
            setattr(args, k, demo if args.demo else real)
    return args


def main(argv=None):
    args = parse_args(argv)
    env = init_distributed()  # torchrun: one process per GPU; plain python: rank 0 of 1
    rank, world, device = env.rank, env.world_size, env.device
    torch.manual_seed(args.seed + rank)
    out, sft = Path(args.out), None
    log = print if rank == 0 else (lambda *a: None)
    barrier = torch.distributed.barrier if world > 1 else (lambda: None)
    if args.demo:  # ftlib/train/demo.py: demo model, held-out pairs, a short SFT run (rank 0 makes the files)
        if device.type == "cpu":
            torch.set_num_threads(1)  # a 2-layer model: more threads cost CPU time, not wall time
        demo = dpo_demo_setup(out, seed=args.seed) if rank == 0 else None
        barrier()
        demo = demo or dpo_demo_setup(out, seed=args.seed)  # the files exist now: only the paths
        args.model, args.data, args.eval_data, sft = demo["model"], [demo["train"]], [demo["eval"]], demo["sft_adapter"]

    # 1. the starting model (+ the SFT adapter merged in): the reference; 2. LoRA adapters on it
    model = load_pretrained(args.model, dtype=torch.float32, device=device)
    if sft:
        model = merge_and_unload(load_adapter(model, sft, check_base=False), dtype=torch.float32)
    tok = load_tokenizer(args.model)
    stop = [t for t in (tok.eos_token_id, tok.tokenizer.token_to_id("<|im_end|>")) if t is not None]
    if args.demo and rank == 0:  # the demo's training pairs: the SFT model's own answers, scored
        dpo_demo_pairs(model, tok, tok.chat_template, out, args.data[0], seed=args.seed, stop_tokens=stop)
    barrier()
    apply_lora(model, LoRAConfig(r=16, alpha=32, target_modules="all-linear"), verbose=False)

    # 3. pairs -> pair caches (tokenized once); the reference log-probs computed once into them
    max_length = 64 if args.demo else 1024  # prompt + one response; both sides of a pair share a row
    pcfg = PairConfig(kind="chat", chat_template=tok.chat_template, eos_token=tok.eos_token,
                      bos_token=tok.bos_token, max_length=max_length)
    pad_id = tok.pad_id
    caches = {}
    for split, src in (("train", args.data), ("eval", args.eval_data)):
        if src:
            if rank == 0:  # one process tokenizes, the others open the cache it wrote
                build_pair_cache(src, tok.tokenizer, pcfg, str(out / f"cache_{split}"), progress=False)
            barrier()
            caches[split] = build_pair_cache(src, tok.tokenizer, pcfg, str(out / f"cache_{split}"), progress=False)
    loss_fn = PreferenceLoss("sigmoid", beta=args.beta, rpo_alpha=args.rpo_alpha)
    for c in caches.values():  # adapters disabled: the starting model exactly; every rank its share
        precompute_reference(model, c, "start", pad_id=pad_id, seq_len=2 * max_length, device=device, progress=False)
    loader = PairLoader(caches["train"], batch_size=args.batch_size, seq_len=2 * max_length, pad_id=pad_id,
                        seed=args.seed, trim_padding=device.type == "cpu")  # sharded by rank
    plan = plan_steps(len(loader), grad_accum=args.grad_accum, epochs=args.epochs, max_steps=args.max_steps)

    # 4. optimizer, clipper, schedule; the DDP-wrapped policy; the held-out numbers
    params = list(trainable_params(model).values())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = LRScheduler(opt, WarmupDecay(plan.total, warmup_ratio=0.1, min_lr_ratio=0.1))
    clipper = GlobalNormClipper(1.0)
    policy = wrap_ddp(PairPolicy(model)) if world > 1 else PairPolicy(model)
    autocast = lambda: torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")

    def held_out() -> dict | None:  # reward accuracy and margin of the held-out pairs, exact match of greedy answers
        if "eval" not in caches or rank != 0:
            return None
        m = pair_metrics(model, caches["eval"], loss_fn=loss_fn, pad_id=pad_id, seq_len=2 * max_length,
                         device=device, autocast=autocast)
        return m | pair_exact_match(model, tok, args.eval_data, pcfg, limit=64, stop_tokens=stop, device=device)

    # 5. the loop: resume from the newest checkpoint, then one iteration = one optimizer step
    ckpt = Checkpointer(out / "checkpoints", keep=2) if rank == 0 else None
    step, logs, before = 0, [], None
    if args.resume and (last := latest_checkpoint(out / "checkpoints")) is not None:
        state = load_checkpoint(last, model=model, optimizer=opt, scheduler=sched, clipper=clipper, loader=loader)
        step, logs, before = state.step, state.extra["logs"], state.extra["before"]
        log(f"resumed from {last} at step {step}")
    if step == 0:
        before = held_out()  # the starting model (a fresh adapter changes nothing)
    model.train()
    while step < plan.total:
        epoch, consumed = plan.position(step)
        loader.set_epoch(epoch)  # after a resume the loader's state says where in the epoch it stopped
        batches = iter(loader)
        for _ in range(consumed // args.grad_accum, plan.steps_per_epoch):
            t0, tokens, stats = time.perf_counter(), 0, []
            for micro in range(args.grad_accum):
                batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in next(batches).items()}
                tokens += pair_tokens(batch)  # both sequences of every pair, no padding
                # DDP: the gradients are all-reduced once per step, on the last micro-batch
                sync = policy.no_sync() if world > 1 and micro < args.grad_accum - 1 else nullcontext()
                with sync:
                    with autocast():
                        logps = PairLogps(*policy(batch))  # chosen / rejected response log-probs, [P] each
                    ref = reference_pair_logps(model, batch)  # precomputed: it rides in the batch
                    res = loss_fn(logps, ref)  # -log sigmoid(beta (margin of log-ratios)) + RPO's NLL
                    (res.losses.sum() / max(1, res.losses.numel()) / args.grad_accum).backward()
                stats += [res.stats()] if res.losses.numel() else []
            grad_norm = float(clipper(params).norm_before)  # clipped to norm 1 in place; the norm before
            if math.isfinite(grad_norm):
                opt.step()
            else:  # a bad batch: the update is skipped rather than poisoning the weights
                log(f"step {step + 1}: gradient norm {grad_norm}, update skipped")
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            keys = ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected")
            rec = {"step": step, "grad_norm": grad_norm, "lr": sched.get_last_lr()[0],
                   **{k: sum(s[k] for s in stats) / max(1, len(stats)) for k in keys},
                   "tokens_per_s": round(tokens * world / (time.perf_counter() - t0), 1)}
            logs.append(rec)
            if step % 10 == 0 or step == plan.total:
                log(json.dumps(rec))
            if step % args.save_every == 0 or step == plan.total:
                if (m := held_out()) is not None and step < plan.total:
                    log(f"held-out at step {step}: {json.dumps({k: v for k, v in m.items() if k != 'examples'})}")
                if ckpt is not None:  # weights, optimizer, schedule, clipper, loader position, RNG, the log
                    ckpt.save(step, model=model, optimizer=opt, scheduler=sched, clipper=clipper, loader=loader,
                              extra={"logs": logs, "before": before}, base_model_name_or_path=args.model)
            if step >= plan.total:
                break

    # 6. held-out numbers before and after, and the adapter (PEFT format)
    after = None
    if rank == 0:
        ckpt.close()
        if (after := held_out()) is not None:
            log(pair_metrics_table(before, after))
        save_adapter(model, out / "adapter", base_model_name_or_path=args.model)
        (out / "train_log.json").write_text(json.dumps({"log": logs, "before": before, "after": after}, indent=1))
    if world > 1:
        torch.distributed.destroy_process_group()
    return {"log": logs, "before": before, "after": after}


if __name__ == "__main__":
    main()
