"""LoRA / QLoRA supervised fine-tuning from a loop you own: one GPU, the CPU, or torchrun (DDP / FSDP2).

    python examples/sft.py --demo --out runs/sft                  # tiny model + data built on the fly, CPU
    python examples/sft.py --model meta-llama/Llama-3.1-8B-Instruct --data chat.jsonl \\
        --eval-data heldout.jsonl --qlora --out runs/llama-qlora
    torchrun --nproc_per_node=8 examples/sft.py --engine fsdp --model ... --data ... --out runs/x

Data: JSONL chat records ``{"messages": [...]}`` rendered with the tokenizer's chat template, loss on
the assistant turns, packed into rows of --seq-len tokens (no token attends across documents); a step's
loss is the mean over the target tokens of its whole window (all micro-batches, all ranks). With
--eval-data: the held-out loss at each of the 10 checkpoints, 64 held-out questions answered before and
after. --resume: on from the newest good checkpoint. The full job on the same library calls (config files,
mixtures, lenient mode, loggers, early stop, HSDP): ``ftlib sft`` (ftlib/cli/sft.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from ftlib.checkpoint import Checkpointer
from ftlib.clip import GlobalNormClipper
from ftlib.data import FormatConfig, SkipReport, TokenLoader, iter_records, prepare_cache
from ftlib.distributed import ShardedCheckpointer, export_adapter, init_distributed, wrap
from ftlib.evaluation import before_after_table, evaluate, heldout_report
from ftlib.lora import LoRAConfig, apply_lora, count_params, save_adapter
from ftlib.losses import CausalLMLoss
from ftlib.models import load_pretrained, load_tokenizer
from ftlib.optim import TrainOptimizer, make_adamw, param_groups
from ftlib.sched import LRScheduler, WarmupDecay
from ftlib.train import copy_tokenizer_files, pick_precision, plan_steps, seed_everything
from ftlib.train.demo import make_demo_assets
from ftlib.train.resume import ResumeError, resume_train_state, run_extra, run_settings

# The demo's base is random, so its adapter has more to learn than a real fine-tune's: a larger rank and scale.
DEMO = dict(seq_len=256, batch_size=4, grad_accum=1, epochs=4, lr=1.5e-3, lora_r=64)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="Hugging Face folder or hub repo id")
    p.add_argument("--data", help="chat JSONL file or folder")
    p.add_argument("--eval-data", help="held-out chat JSONL (loss, and exact match of the last answer)")
    p.add_argument("--out", required=True, help="the run's folder: checkpoints/, adapter/, metrics.jsonl")
    p.add_argument("--demo", action="store_true", help="tiny model and word-reversal data (ftlib.train.demo)")
    p.add_argument("--qlora", action="store_true", help="NF4 base weights (QLoRA)")
    p.add_argument("--lora-r", type=int, default=16, help="adapter rank (alpha = 2r; demo 4r)")
    p.add_argument("--seq-len", type=int, default=2048, help="packed row length in tokens")
    p.add_argument("--batch-size", type=int, default=4, help="rows per micro-batch per rank")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (overrides --epochs)")
    p.add_argument("--engine", choices=["none", "ddp", "fsdp"], default=None, help="default: ddp under torchrun")
    p.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint in --out")
    p.set_defaults(**(DEMO if "--demo" in (sys.argv[1:] if argv is None else argv) else {}))
    args = p.parse_args(argv)
    if not args.demo and not (args.model and args.data):
        p.error("--model and --data are required (or --demo)")
    return args


def main(argv=None):
    t_start, args = time.perf_counter(), parse_args(argv)
    env = init_distributed()  # one process without torchrun; under torchrun this rank's device and group
    rank, world, device, out = env.rank, env.world_size, env.device, Path(args.out)
    engine = args.engine or ("ddp" if world > 1 else "none")
    log = print if rank == 0 else (lambda *a, **k: None)
    out.mkdir(parents=True, exist_ok=True)
    if args.demo:
        torch.set_num_threads(1)  # a 2-layer model: more CPU threads cost time, not save it
        demo = make_demo_assets(out / "demo") if rank == 0 else out / "demo"
        if world > 1:
            torch.distributed.barrier()
        args.model, args.data, args.eval_data = str(demo / "base"), str(demo / "data"), str(demo / "eval")
    seed_everything(0)  # every rank draws the same adapter initialisation

    # 1. model, tokenizer, adapters; the loss module (no full logits), wrapped for several ranks.
    precision = pick_precision(None, device)  # bf16 where the GPU has it, else fp32
    model = load_pretrained(args.model, dtype=torch.bfloat16 if precision == "bf16" else torch.float32, device=device)
    tok, alpha = load_tokenizer(args.model), (4 if args.demo else 2) * args.lora_r  # LoRA scale alpha / r
    apply_lora(model, LoRAConfig(r=args.lora_r, alpha=alpha, dropout=0.05, target_modules="all-linear",
                                 quantize="nf4" if args.qlora else None, double_quant=args.qlora), verbose=False)
    log(count_params(model))  # the adapters were created on the base's device
    train_model = wrap(CausalLMLoss(model), engine=engine,
                       mixed_precision="bf16" if engine == "fsdp" and precision == "bf16" else None)
    seed_everything(rank)  # from here on (LoRA dropout) each rank draws its own numbers

    # 2. data: tokenized once into a memory-mapped cache (rank 0 builds it), packed rows, each rank its share.
    fcfg = FormatConfig(kind="chat", chat_template=tok.chat_template, bos_token=tok.bos_token,
                        eos_token=tok.eos_token, max_length=args.seq_len)
    rows = dict(batch_size=args.batch_size, seq_len=args.seq_len, pad_id=tok.pad_id, packing=True)
    loader = TokenLoader(prepare_cache(args.data, tok.tokenizer, fcfg, str(out / "cache"), num_proc=1), seed=0, **rows)
    eval_loader, prompts, refs, questions = None, [], [], []
    if args.eval_data:
        eval_docs = prepare_cache(args.eval_data, tok.tokenizer, fcfg, str(out / "cache-eval"), num_proc=1)
        eval_loader = TokenLoader(eval_docs, shuffle=False, drop_last=False, **rows)
        chats = [r["messages"] for r, _ in iter_records([args.eval_data], SkipReport())][:64]  # the first 64 chats
        prompts = [tok.apply_chat_template(m[:-1], add_generation_prompt=True) for m in chats]  # up to the answer
        refs, questions = [m[-1]["content"] for m in chats], [m[-2]["content"] for m in chats]

    # 3. optimizer (token-weighted accumulation), clipper, schedule, checkpoints.
    plan = plan_steps(len(loader), grad_accum=args.grad_accum, epochs=args.epochs, max_steps=args.max_steps)
    save_every = max(1, plan.total // 10)
    opt = TrainOptimizer(make_adamw(param_groups(model, lr=args.lr), lr=args.lr), precision=precision)
    clipper = GlobalNormClipper(1.0)
    sched = LRScheduler(opt.optimizer, WarmupDecay(total=plan.total, warmup_ratio=0.03, decay="cosine",
                                                   min_lr_ratio=0.1))
    sharded = engine == "fsdp"  # FSDP: every rank writes its shards; else rank 0 writes the whole state
    writer = ShardedCheckpointer if sharded else Checkpointer if rank == 0 else None
    ckpt = writer(out / "checkpoints", keep=2) if writer else None
    state_model = train_model if sharded else model
    eval_model, eval_loss = (train_model, lambda m, b: m(b)) if sharded else (model, None)  # FSDP: via its hooks

    # 4. the loop, from where the newest checkpoint left it: one iteration = one optimizer step.
    settings = run_settings(vars(args), ("model", "data", "qlora", "lora_r", "seq_len", "batch_size", "grad_accum",
                                         "lr", "epochs", "max_steps"), out=out)  # a resume that changes one: refused
    try:  # weights, optimizer, schedule, clipper, loader position (re-planned on another world size), RNG
        resumed = resume_train_state(out / "checkpoints", resume=args.resume, settings=settings, plan=plan, log=log,
                                     sharded=sharded, model=state_model, optimizer=opt, scheduler=sched,
                                     clipper=clipper, loader=loader)
    except ResumeError as e:
        raise SystemExit(str(e)) from None
    step, before, trained_tokens = resumed.step, resumed.extra.get("before", {}), resumed.extra.get("tokens", 0)
    if step == 0 and eval_loader is not None:  # the base model (a fresh LoRA adapter changes nothing)
        before = heldout_report(eval_model, tok, eval_loader, [] if sharded else prompts, refs, autocast=opt.autocast,
                                loss_fn=eval_loss)  # generation needs the whole model on one rank: not under FSDP
    if rank == 0:  # the records up to the checkpoint (an interrupted run may have logged past it)
        kept = [ln for ln in open(out / "metrics.jsonl") if json.loads(ln)["step"] <= step] if step else []
        (out / "metrics.jsonl").write_text("".join(kept))
    train_model.train()
    t_loop = time.perf_counter()
    while step < plan.total:
        epoch, window = divmod(step, plan.steps_per_epoch)
        loader.set_epoch(epoch)  # a resumed loader continues mid-epoch from its saved position
        batches = iter(loader)
        for _ in range(window, plan.steps_per_epoch):
            t_step = time.perf_counter()
            for micro in range(args.grad_accum):
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in next(batches).items()}
                # several ranks: gradients are exchanged on the window's last micro-batch only
                with opt.grad_sync(train_model, enabled=micro == args.grad_accum - 1) if world > 1 else nullcontext():
                    with opt.autocast():
                        loss_sum, n_tokens = train_model(batch)  # forward: summed token loss, target tokens
                    opt.backward(loss_sum, n_tokens)  # backward; divided by the window's tokens at the step
            res = opt.step(clipper)  # normalise by tokens (all ranks), clip, optimizer step, zero grads
            sched.step()
            step, trained_tokens = step + 1, trained_tokens + res.num_tokens
            rec = {"step": step, "epoch": epoch, "loss": res.loss, "lr": sched.get_last_lr()[0],
                   "grad_norm": res.grad_norm, "target_tokens": res.num_tokens, "skipped": res.skipped,
                   "tokens_per_s": res.num_tokens / (time.perf_counter() - t_step)}
            if step % save_every == 0 or step == plan.total:
                if eval_loader is not None:  # held-out loss over every document once (collective)
                    rec.update(evaluate(eval_model, eval_loader, autocast=opt.autocast, loss_fn=eval_loss).to_dict())
                if ckpt is not None:
                    ckpt.save(step, model=state_model, optimizer=opt, scheduler=sched, clipper=clipper, loader=loader,
                              metrics=rec, extra={**run_extra(settings, loader), "before": before, "tokens": trained_tokens},
                              base_model_name_or_path=args.model)
            if rank == 0:
                with open(out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(rec) + "\n")
                log(f"step {step}/{plan.total}  loss {res.loss:.4f}  lr {rec['lr']:.2e}  grad norm {res.grad_norm:.3f}"
                    + (f"  held-out loss {rec['eval_loss']:.4f}" if "eval_loss" in rec else "")
                    + ("  (skipped: " + res.skip_reason + ")" if res.skipped else ""))
            if step >= plan.total:
                break
    train_s = time.perf_counter() - t_loop
    if ckpt is not None:
        ckpt.close()  # waits for the last background write

    # 5. the adapter in PEFT's format with the tokenizer beside it; the held-out report before/after.
    if sharded:  # collective: every rank takes part in the gathers, rank 0 writes
        adapter = export_adapter(train_model, out / "adapter", base_model_name_or_path=args.model)
    elif rank == 0:
        adapter = save_adapter(model, out / "adapter", base_model_name_or_path=args.model)
    if rank == 0:
        copy_tokenizer_files(args.model, adapter, chat_template=tok.chat_template)
    after = {}
    if eval_loader is not None:
        after = heldout_report(eval_model, tok, eval_loader, [] if sharded else prompts, refs, autocast=opt.autocast,
                               loss_fn=eval_loss)
        log("\n".join(before_after_table(before, after, questions=questions, references=refs, steps=step,
                                          wall_s=time.perf_counter() - t_start, train_s=train_s, tokens=trained_tokens)))
    if rank == 0:
        (out / "summary.json").write_text(json.dumps({"steps": step, "before": before, "after": after,
                                                      "world_size": world, "engine": engine}) + "\n")
    if world > 1:
        torch.distributed.destroy_process_group()
    return after


if __name__ == "__main__":
    main()
