"""``ftlib reward``: a reward model (Bradley-Terry, LoRA) on preference pairs, then pairs scored for the DPO margin filter.

The full command; ``examples/reward_model.py`` is the same loop in 200 lines to read and copy. The recipe:

    1. load the base as a reward model: its decoder + a scalar score head (a causal-LM checkpoint gets
       a new head; a sequence-classification checkpoint keeps its own)
    2. LoRA on the decoder; the score head is trained in full (``modules_to_save=["score"]``)
    3. the pairs tokenized once into a pair cache (``ftlib.data.build_pair_cache``, the cache DPO trains
       on: the prompt turns rendered with the chat template, each answer as the assistant turn) and
       read by ``PairLoader`` in its padded layout: chosen and rejected each its own sequence
    4. loop: B pairs -> scores at each sequence's last token (``ftlib.models.pair_rewards``) ->
       Bradley-Terry loss -log sigmoid(r_c - r_r - margin) -> step -> schedule
    5. held-out pairwise accuracy before and after training; every pair of ``--score-pairs`` is written
       again with ``reward_chosen`` / ``reward_rejected``; with ``--onpolicy-policy`` the policy's own
       answers to the training prompts, scored by the reward model, become new pairs (``ftlib.onpolicy``)
    6. save the adapter (PEFT, task SEQ_CLS) and a merged checkpoint that ``transformers`` loads as
       ``<Arch>ForSequenceClassification``

Pairs are records ``{"messages": [prompt turns], "chosen": str, "rejected": str}`` (an optional
numeric ``"margin"`` is used with ``--margin-field``), read and checked by the preference-data
pipeline (``ftlib.data.pairs``: the same fields and conventions as ``ftlib dpo``; a bad record is an
error naming its file, line and field). ``--max-length`` bounds prompt + one answer; a longer pair is
cut by the pair cache's rule (the prompt from the left first, then both answers to one budget) and
counted. The scored files keep every field
and add ``"reward_chosen"`` and ``"reward_rejected"`` (floats): the input of the DPO margin filter.

    ftlib reward --model meta-llama/Llama-3.2-1B-Instruct --data data/prefs/train.jsonl \\
        --eval-data data/prefs/eval.jsonl --score-pairs data/prefs/train.jsonl --out runs/rm

The flags are the ones every ftlib training script shares (``ftlib.train.cli``: ``--data``,
``--eval-data``, ``--max-steps``, ``--batch-size`` (pairs per micro-batch), ``--grad-accum``,
``--lenient``, ``--chat-template``, ``--config``, ...). The chat template comes from
``--chat-template`` or the tokenizer; without either the run is refused (no silent ChatML). The
template used is written into ``adapter/``, ``reward_model/`` and every checkpoint
(``tokenizer_config.json``) and recorded in ``run.json``. ``--save-every`` writes a checkpoint
(``ftlib.checkpoint``: weights, optimizer, schedule, clipper, the pair order, RNG) and
``--resume`` continues from the newest good one: bitwise the same run on CPU. ``--eval-every``
evaluates the held-out pairs (accuracy and Bradley-Terry loss, into ``metrics.json`` and the
``--report-to`` loggers). ``--lenient`` skips bad records, counts them and saves the report in
``skipped.json``.

``--demo`` builds a tiny model and tokenizer plus arithmetic preference pairs (the right sum chosen,
a wrong one rejected; ``arithmetic_pairs``) and trains on them in a minute on a CPU. Its held-out pairs
are comparisons never seen in training (other wrong answers) for the training prompts: a random
2-layer model does not learn arithmetic for unseen prompts from a reward signal in minutes, but it
does learn which answer of a prompt is right, as a reward model of a real model learns which
responses are better.

``--onpolicy-policy MODEL`` is the second path to DPO pairs: MODEL (the SFT policy, a causal-LM folder or
hub id) answers every training prompt greedily and by sampling, the trained reward model scores the
answers, and each prompt's best answer is preferred to its worse ones in ``<out>/onpolicy/pairs.jsonl``
(no prompt that only the held-out pairs hold; the two sides never equal), ready for ``ftlib dpo --data``.

Also shown: ``--decay-rank R`` shrinks the LoRA ranks to R during training (``ftlib.lora.RankDecay``;
the adapter is saved with PEFT ``rank_pattern``/``alpha_pattern``), ``--schedule restarts``
(cosine with warm restarts), ``--offload-blocks K`` (activation offloading of the last K blocks,
a no-op on CPU) and ``--precision auto`` (bf16, or fp16 falling back to fp32 after overflows).

``main(argv) -> int`` is the command; ``train(argv) -> (merged model, metrics)`` runs it and hands back
the merged reward model and the numbers written to ``metrics.json``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ftlib.checkpoint import Checkpointer
from ftlib.clip import GlobalNormClipper
from ftlib.data import (
    DataError,
    PairConfig,
    PairLoader,
    SkipReport,
    build_pair_cache,
    iter_records,
    resolve_chat_template,
)
from ftlib.data.cli import FlagError, FlagParser, data_error_message, number, whole
from ftlib.distributed import init_distributed
from ftlib.evaluation import reward_pair_metrics, score_pairs
from ftlib.lora import (
    LoRAConfig,
    RankDecay,
    StepRanks,
    apply_lora,
    count_params,
    merge_and_unload,
    save_adapter,
)
from ftlib.losses import bradley_terry_loss
from ftlib.metrics import MetricsLogger
from ftlib.models import (
    load_pretrained,
    load_reward_model,
    load_tokenizer,
    pair_rewards,
    pairwise_accuracy,
    save_reward_model,
)
from ftlib.offload import offload_modules
from ftlib.onpolicy import OnPolicyConfig, build_onpolicy_pairs, prompt_key, reward_model_scorer, write_pairs
from ftlib.optim import TrainOptimizer, make_adamw, param_groups, resolve_precision
from ftlib.sched import CosineRestarts, LRScheduler, WarmupDecay
from ftlib.train import (
    ResumeError,
    add_data_flags,
    add_eval_flags,
    add_loop_flags,
    add_model_flags,
    add_output_flags,
    check_output_flags,
    copy_tokenizer_files,
    cpu_threads,
    eval_intervals,
    parse_with_config,
    pick_precision,
    plan_steps,
    resume_train_state,
    run_extra,
    run_settings,
    write_run_manifest,
)

__all__ = ["build_parser", "main", "train"]

DEMO = {"max_steps": 200, "lr": 1e-3, "batch_size": 8}
DEFAULTS = {"max_steps": 1000, "lr": 1e-4, "batch_size": 16}
# What a resume compares with the checkpoint's run (ftlib.train.resume): a change is refused unless
# --override names it; FIXED ones cannot be overridden (the saved state or the data depends on them).
SETTINGS = ("model", "chat_template", "max_length", "batch_size", "grad_accum", "epochs", "max_steps", "lr",
            "weight_decay", "warmup_ratio", "schedule", "restart_cycles", "clip", "margin_field", "lora_r",
            "lora_alpha", "targets", "seed", "lenient", "messages_field", "prompt_field", "system_field", "turn_end")
FIXED = ("model", "chat_template", "max_length", "lora_r", "lora_alpha", "targets", "seed", "precision",
         "data_fingerprint", "messages_field", "prompt_field", "system_field", "turn_end", "margin_field")
# shared flags this script does not implement: refused when set (value: their unset default)
NOT_HERE = {"eval_split": 0.0, "early_stop": 0, "sample_every": 0, "compile": False}


def build_parser() -> FlagParser:
    p = FlagParser(prog="ftlib reward", description=__doc__.split("\n")[0])
    # the flags every ftlib script shares (ftlib.train.cli); pairs are chat records
    add_model_flags(p, precisions=("auto", "bf16", "fp16", "fp32"),
                    precision_help="default: auto on CUDA (bf16 where supported), fp32 on CPU")
    add_data_flags(p, kinds=("chat",))
    add_loop_flags(p, schedules=("cosine", "restarts"))
    add_eval_flags(p)
    add_output_flags(p)
    p.set_defaults(warmup_ratio=0.05, log_every=25, num_workers=0)  # short pairs: workers cost more than they save
    g = p.add_argument_group("this script")
    g.add_argument("--score-pairs", nargs="*", default=None,
                   help="pairs files to write again with rewards (default: --data and --eval-data)")
    g.add_argument("--max-length", type=whole(1), default=2048,
                   help="prompt + one answer, in tokens; longer pairs are cut (the pair cache's rule) and counted")
    g.add_argument("--restart-cycles", type=whole(1), default=2, help="--schedule restarts: equal cosine cycles")
    g.add_argument("--decay-rank", type=whole(1), default=None, help="shrink every LoRA rank to this at --decay-at")
    g.add_argument("--decay-at", type=number(0, 1), default=0.5, help="fraction of the steps at which ranks shrink")
    g.add_argument("--offload-blocks", type=whole(0), default=0, help="offload the activations of the last K blocks")
    g.add_argument("--margin-field", default=None, help="record field holding a per-pair margin (Llama 2)")
    g.add_argument("--lora-r", type=whole(1), default=16)
    g.add_argument("--lora-alpha", type=number(0, above=True), default=32.0)
    g.add_argument("--targets", default="all-linear", help="'all-linear' or comma-separated module names")
    g.add_argument("--fallback", choices=["bf16", "fp32"], default=None,
                   help="with --precision fp16: switch to this after 10 overflow skips within 100 steps")
    g.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing on every block")
    g.add_argument("--onpolicy-policy", default=None,
                   help="causal LM (the SFT policy) whose answers to the training prompts, scored by the trained "
                        "reward model, are written as pairs to <out>/onpolicy/pairs.jsonl")
    g.add_argument("--demo", action="store_true", help="tiny model + arithmetic pairs built on the fly")
    g.add_argument("--demo-prompts", type=int, default=24, help="demo prompts (each with several pairs)")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = parse_with_config(p, argv)  # --config FILE under the flags
    if not args.out:
        p.error("--out is required (the run's folder)")
    for k, v in (DEMO if args.demo else DEFAULTS).items():
        if getattr(args, k) is None and not (k == "max_steps" and args.epochs):
            setattr(args, k, v)
    args.grad_accum = args.grad_accum or 1
    if not args.demo and (args.model is None or not args.data):
        p.error("--model and --data are required (or use --demo)")
    for k, unset in NOT_HERE.items():
        if getattr(args, k) != unset:
            p.error(f"--{k.replace('_', '-')} is not available in ftlib reward (see ftlib sft)")
    if args.resume and args.decay_rank is not None:
        p.error("--resume with --decay-rank is not supported: the adapter's ranks change during the run, so a "
                "checkpoint does not fit a fresh model; run without --decay-rank, or start again")
    check_output_flags(p, args)
    return args


def usage_error(msg: str):
    """A user error found after parsing: one line on stderr, exit 2 (as argparse does)."""
    build_parser().error(msg)


def onpolicy_pairs(policy_path: str, reward_model, tok, template: str, train: list, held_out: list, *, dtype, device,
                   autocast, seed: int, dst: Path) -> dict:
    """The policy answers the distinct training prompts (greedy + 4 samples), the reward model scores the
    answers, each prompt's best answer is preferred to the worse ones; pairs written to ``dst``.
    ``train`` / ``held_out``: the pair records (those the pair caches hold)."""
    fmt, report = PairConfig(kind="chat", chat_template=template).formatter(tok.tokenizer), SkipReport(strict=False)
    convs = lambda recs: [c[0] for c in (fmt.conversation(r, "", report) for r in recs) if c is not None]
    prompts = list({json.dumps(p): p for p in convs(train)}.values())
    train_keys = {prompt_key(p) for p in prompts}
    exclude = [p for p in convs(held_out) if prompt_key(p) not in train_keys]
    policy = load_pretrained(policy_path, dtype=dtype, device=device)
    ptok = load_tokenizer(policy_path)
    stop = [t for t in (ptok.eos_token_id, ptok.tokenizer.token_to_id("<|im_end|>")) if t is not None]
    with autocast():
        built = build_onpolicy_pairs(policy, ptok, prompts, reward_model_scorer(reward_model, tok, template),
                                     chat_template=template, exclude=exclude, stop_tokens=stop,
                                     config=OnPolicyConfig(samples=4, max_new_tokens=32, seed=seed))
    write_pairs(built.records, dst)
    print(f"on-policy pairs: {built.stats.pairs} from {built.stats.prompts} training prompts answered by {policy_path}, "
          f"scored by the reward model -> {dst} ({built.stats.to_dict()})")
    return {"path": str(dst), **built.stats.to_dict()}


def main(argv: list[str] | None = None) -> int:
    """``ftlib reward ...``: 0 when the run ends (a user error exits 2 with one line on stderr)."""
    train(argv)
    return 0


def train(argv: list[str] | None = None):
    """Run ``ftlib reward`` with ``argv``; returns (the merged reward model, the metrics of ``metrics.json``)."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = init_distributed()  # the device every ftlib command picks (CUDA when present, else CPU)
    if env.world_size > 1:
        usage_error("ftlib reward runs in one process (torchrun is not supported here): run it without torchrun")
    device = env.device
    try:
        precision, fallback = pick_precision(args.precision, device, cuda_default="auto"), args.fallback
    except FlagError as e:
        usage_error(str(e))
    if precision == "auto":  # bf16 where the GPU has it, else fp16 falling back to fp32 on overflows
        precision, fallback = resolve_precision(device.type, args.fallback)
    if device.type == "cpu":  # the usable cores less the loader workers, at most 8 (ftlib.train.cpu_threads)
        try:
            args.threads = cpu_threads(args.threads, num_workers=args.num_workers)
        except FlagError as e:
            usage_error(str(e))
        torch.set_num_threads(args.threads)

    if args.demo:
        from ftlib.train.demo import make_demo_assets, reward_demo_pairs  # ftlib/train/demo.py

        make_demo_assets(out / "demo")
        train_file, eval_file = reward_demo_pairs(out / "demo" / "pairs", args.demo_prompts, args.seed)
        args.model = str(out / "demo" / "base")
        args.data, args.eval_data = [str(train_file)], [str(eval_file)]
    args.eval_data = list(args.eval_data or [])

    # 1-2. reward model = decoder + scalar head; LoRA on the decoder, the head trained in full.
    model = load_reward_model(args.model, dtype=torch.bfloat16 if precision == "bf16" else torch.float32, device=device)
    tok = load_tokenizer(args.model)
    if args.grad_ckpt:
        model.set_gradient_checkpointing(every=1, part="block")
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    apply_lora(model, LoRAConfig(r=args.lora_r, alpha=args.lora_alpha, target_modules=targets,
                                 modules_to_save=["score"]), verbose=False)
    print(f"trainable parameters: {count_params(model)}")

    # 3. data: the chat template from --chat-template or the tokenizer (none: refused); the pairs tokenized
    # once into pair caches (as ftlib dpo does), read strictly or, with --lenient, every bad record
    # skipped and counted (the report printed and saved in --out)
    try:
        resolved = resolve_chat_template(args.chat_template, tokenizer=tok)
    except (OSError, ValueError) as e:
        usage_error(f"--chat-template: {e}" if args.chat_template else str(e))
    template = resolved.text
    print(f"chat template: {resolved.source}")
    pcfg = PairConfig(kind="chat", chat_template=template, messages_field=args.messages_field,
                      prompt_field=args.prompt_field, system_field=args.system_field, turn_end=args.turn_end,
                      eos_token=tok.eos_token, bos_token=tok.bos_token, max_length=args.max_length,
                      margin_field=args.margin_field or "margin")
    pad_id = tok.pad_id
    caches = {}
    for split, src, flag in (("train", args.data, "--data"), ("eval", args.eval_data, "--eval-data")):
        if not src:
            continue
        try:
            caches[split] = build_pair_cache(src, tok.tokenizer, pcfg, str(out / f"cache_{split}"),
                                             num_proc=args.num_proc, progress=False, strict=not args.lenient)
        except DataError as e:
            usage_error(data_error_message(flag, e, args.lenient))
        except (OSError, ValueError) as e:
            usage_error(f"{flag}: {e}")
        c = caches[split]
        if args.margin_field is not None and not np.isfinite(c.margin).all():
            i = int(np.flatnonzero(~np.isfinite(c.margin))[0])
            usage_error(f"{flag}: pair {i} has no number in field {args.margin_field!r} (--margin-field)")
    reports = {k: c.report for k, c in caches.items()}
    if "train" not in caches or not len(caches["train"]):
        usage_error("--data: no training pair (see the skip report)")
    n_train, n_eval = len(caches["train"]), len(caches["eval"]) if "eval" in caches else 0
    print(f"data: {n_train} training pairs ({caches['train'].n_truncated} cut to --max-length {args.max_length}), "
          f"{n_eval} held-out pairs")
    for name, r in reports.items():
        if r.total:
            print(f"{'--data' if name == 'train' else '--eval-data'}: {r}")
    if any(r.total for r in reports.values()):  # every skip, where the run's other files are
        (out / "skipped.json").write_text(json.dumps({k: r.to_dict() for k, r in reports.items()}, indent=1) + "\n")
    data_fp = hashlib.sha256(json.dumps({k: c.fingerprint() for k, c in caches.items()}, sort_keys=True).encode()).hexdigest()
    # each side its own padded sequence (PairLoader's padded layout), batch_size pairs per micro-batch
    loader = PairLoader(caches["train"], batch_size=args.batch_size, pad_id=pad_id, packing=False, seed=args.seed,
                        num_workers=args.num_workers, pin_memory=device.type == "cuda", rank=0, world_size=1)

    # 4. optimizer (mean over the pairs of a step), clipper, schedule; checkpoints; resume; loop
    try:  # the step plan every ftlib command uses (ftlib.train.plan_steps): --max-steps, else --epochs
        plan = plan_steps(len(loader), grad_accum=args.grad_accum, epochs=args.epochs or 1, max_steps=args.max_steps)
    except ValueError as e:
        usage_error(f"{e}: more pairs, or a smaller --batch-size / --grad-accum")
    total, pairs_per_step = plan.total, args.batch_size * args.grad_accum
    save_every, eval_every = eval_intervals(total, save_every=args.save_every, eval_every=args.eval_every)
    opt = TrainOptimizer(make_adamw(param_groups(model, lr=args.lr, weight_decay=args.weight_decay), lr=args.lr,
                                    weight_decay=args.weight_decay), precision=precision, fallback=fallback)

    def held_out():
        """Pairwise accuracy and the Bradley-Terry loss of the held-out pairs (None without any)."""
        if "eval" not in caches:
            return None
        return reward_pair_metrics(model, caches["eval"], pad_id=pad_id, device=device, autocast=opt.autocast)

    clipper = GlobalNormClipper(args.clip)
    if args.schedule == "restarts":
        schedule = CosineRestarts(max(1, total // args.restart_cycles), min_lr_ratio=0.1,
                                  warmup_ratio=args.warmup_ratio)
    else:
        schedule = WarmupDecay(total, warmup_ratio=args.warmup_ratio, min_lr_ratio=0.1)
    sched = LRScheduler(opt.optimizer, schedule)
    decay = None
    if args.decay_rank is not None:  # every LoRA layer shrinks to --decay-rank at one step; Adam's state is projected
        decay = RankDecay(model, StepRanks([(max(1, int(total * args.decay_at)), args.decay_rank)]), optimizer=opt)
    if args.offload_blocks:
        offload_modules(model.model.layers[-args.offload_blocks:])
    settings = run_settings(vars(args), SETTINGS, out=out) | {"chat_template": template, "precision": precision,
                                                              "data_fingerprint": data_fp}
    try:  # weights, optimizer, schedule, clipper, loader position, RNG; settings compared with the saved run's
        resumed = resume_train_state(out / "checkpoints", resume=args.resume, settings=settings,
                                     overrides=args.override, fixed=FIXED, plan=plan, seed=args.seed, model=model,
                                     optimizer=opt, scheduler=sched, clipper=clipper, loader=loader)
    except ResumeError as e:
        raise SystemExit(str(e)) from None
    step = resumed.step
    logs, evals_log = list(resumed.extra.get("log", [])), list(resumed.extra.get("evals", []))
    train_s = resumed.extra.get("train_time_s", 0.0)
    if step == 0:
        before = held_out()
        acc_before = before and before["eval_accuracy"]
        print(f"held-out pairwise accuracy before training: {acc_before}")
    else:
        before, acc_before = None, resumed.extra.get("accuracy_before")
    ckpt = Checkpointer(out / "checkpoints", keep=args.keep, metric="eval_loss" if "eval" in caches else None)
    write_run_manifest(out, vars(args), device=device, world_size=1, data_fingerprint=data_fp, resume=resumed,
                       extra={"chat_template": {"text": template, "source": resolved.source},
                              "skipped": {k: r.to_dict() for k, r in reports.items()}})
    loggers = MetricsLogger(None, start_step=step, progress=False, print_every=None, report_to=args.report_to,
                            log_dir=out, run_config=vars(args), run_name=out.name)  # the trackers of --report-to
    if step == 0 and before is not None:  # the step-0 point of the held-out curve
        evals_log.append({"step": 0, "kind": "eval", **before})
        loggers.log(evals_log[-1])
    tokenized = set()  # checkpoint folders that hold the tokenizer files and the template
    model.train()
    t0 = time.perf_counter()
    while step < total:
        epoch, window = plan.position(step)
        loader.set_epoch(epoch)  # mid-epoch after a resume: the loader state says where
        it = iter(loader)
        for _ in range(window // args.grad_accum, plan.steps_per_epoch):
            step += 1
            correct, pairs_done = 0.0, 0
            for _ in range(args.grad_accum):
                batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in next(it).items()}
                margin = batch["margin"].float() if args.margin_field is not None else None
                with opt.autocast():
                    r_c, r_r = pair_rewards(model, batch)  # (B,) each: chosen and rejected scored apart
                loss_sum, n_pairs = bradley_terry_loss(r_c, r_r, margin)
                opt.backward(loss_sum, n_pairs)
                correct += pairwise_accuracy(r_c.detach(), r_r.detach()) * len(r_c)
                pairs_done += len(r_c)
            res = opt.step(clipper)
            sched.step()
            if decay is not None:
                for rep in decay.step():
                    print(f"rank decay at step {step}: {rep.name} {rep.old_rank} -> {rep.new_rank}, "
                          f"output change <= {rep.max_discarded:.3g} |x|")
            if step % args.log_every == 0 or step == total:
                elapsed = train_s + time.perf_counter() - t0
                rec = {"step": step, "loss": round(res.loss, 4), "batch_accuracy": correct / pairs_done,
                       "lr": sched.get_last_lr()[0], "grad_norm": round(res.grad_norm, 4),
                       "skipped": opt.skipped_steps, "pairs_per_s": round(step * pairs_per_step / max(elapsed, 1e-9), 1)}
                logs.append(rec)
                loggers.log(rec)
                print(json.dumps(rec))
            metrics = {}
            if "eval" in caches and ((eval_every and step % eval_every == 0) or step == total):
                metrics = held_out()
                evals_log.append({"step": step, "kind": "eval", **metrics})
                loggers.log(evals_log[-1])
                print(json.dumps(evals_log[-1]))
            if (save_every and step % save_every == 0) or step == total:
                done = ckpt.last_saved  # the last finished save: the tokenizer and template beside its adapter
                if done is not None and done.exists() and done not in tokenized:
                    copy_tokenizer_files(args.model, done, chat_template=template)
                    tokenized.add(done)
                ckpt.save(step, model=model, optimizer=opt, scheduler=sched, clipper=clipper, loader=loader,
                          metrics=metrics, base_model_name_or_path=args.model,
                          extra={**run_extra(settings, loader), "log": logs, "evals": evals_log,
                                 "accuracy_before": acc_before, "train_time_s": train_s + time.perf_counter() - t0})
            if step >= total:
                break
    train_s += time.perf_counter() - t0
    loggers.close()
    ckpt.close()  # waits for the last background write
    for folder in sorted((out / "checkpoints").glob("step-*")):
        if folder not in tokenized and folder.is_dir():
            copy_tokenizer_files(args.model, folder, chat_template=template)

    # 5. held-out accuracy and scored pairs files (the token sequences the caches hold, scored)
    after = held_out()
    acc_after = after and after["eval_accuracy"]
    print(f"held-out pairwise accuracy after training: {acc_after} (before: {acc_before})")
    to_score = args.score_pairs if args.score_pairs is not None else list(args.data) + list(args.eval_data)
    scored, recs_of = {}, {}
    for f in to_score:
        report = SkipReport(strict=not args.lenient)
        try:
            with opt.autocast():
                recs_of[f] = score_pairs(model, tok, f, pcfg, report=report)
        except DataError as e:
            usage_error(data_error_message("--score-pairs", e, args.lenient))
        except (OSError, ValueError) as e:
            usage_error(f"--score-pairs: {e}")
        dst = write_pairs(recs_of[f], out / "scored" / Path(f).name)
        scored[f] = str(dst)
        print(f"scored {len(recs_of[f])} pairs of {f} -> {dst}" + (f" ({report.total} left out: {report})"
                                                                  if report.total else ""))

    onpolicy = None
    if args.onpolicy_policy:
        read = lambda files: [rec for f in files for rec, _ in iter_records(f, SkipReport(strict=False))]
        onpolicy = onpolicy_pairs(args.onpolicy_policy, model, tok, template, read(args.data), read(args.eval_data),
                                  dtype=torch.bfloat16 if precision == "bf16" else torch.float32, device=device,
                                  autocast=opt.autocast, seed=args.seed, dst=out / "onpolicy" / "pairs.jsonl")

    # 6. save: the PEFT adapter (with the tokenizer and the template it trained with), then a merged
    # checkpoint in transformers' sequence-classification layout
    ranks = None if decay is None else sorted(set(decay.ranks().values()))
    save_adapter(model, out / "adapter", base_model_name_or_path=args.model, task_type="SEQ_CLS")
    copy_tokenizer_files(args.model, out / "adapter", chat_template=template)
    merged = merge_and_unload(model, dtype=None)
    save_reward_model(merged, out / "reward_model", pad_token_id=tok.pad_token_id)
    copy_tokenizer_files(args.model, out / "reward_model", chat_template=template)
    metrics = {"accuracy_before": acc_before, "accuracy_after": acc_after, "train_pairs": n_train,
               "ranks": ranks, "steps": step, "truncated": caches["train"].n_truncated, "eval_pairs": n_eval,
               "scored": scored, "onpolicy": onpolicy, "log": logs, "evals": evals_log,
               "skipped_records": {k: r.total for k, r in reports.items()}}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(f"adapter: {out / 'adapter'}; reward model (transformers SequenceClassification): {out / 'reward_model'}")
    return merged, metrics


if __name__ == "__main__":
    sys.exit(main())
