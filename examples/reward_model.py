"""Train a reward model (Bradley-Terry, LoRA) on preference pairs, then score pairs for the DPO margin filter.

Read it top to bottom, copy it, change it. The recipe:

    1. load the base as a reward model: its decoder + a scalar score head (a causal-LM checkpoint gets
       a new head; a sequence-classification checkpoint keeps its own)
    2. LoRA on the decoder; the score head is trained in full (``modules_to_save=["score"]``)
    3. tokenize each pair: the prompt turns rendered with the chat template, the chosen (rejected)
       answer as the assistant turn
    4. loop: B chosen + B rejected documents packed into one varlen row -> scores at each document's
       last token -> Bradley-Terry loss -log sigmoid(r_c - r_r - margin) -> step -> schedule
    5. held-out pairwise accuracy before and after training; every pair of ``--score-pairs`` is written
       again with ``reward_chosen`` / ``reward_rejected``; with ``--onpolicy-policy`` the policy's own
       answers to the training prompts, scored by the reward model, become new pairs (``ftlib.onpolicy``)
    6. save the adapter (PEFT, task SEQ_CLS) and a merged checkpoint that ``transformers`` loads as
       ``<Arch>ForSequenceClassification``

Pairs are records ``{"messages": [prompt turns], "chosen": str, "rejected": str}`` (an optional
numeric ``"margin"`` is used with ``--margin-field``), read and checked by the preference-data
pipeline (``ftlib.data.pairs``: the same fields and conventions as ``dpo.py``; a bad record is an
error naming its file, line and field). The scored files keep every field
and add ``"reward_chosen"`` and ``"reward_rejected"`` (floats): the input of the DPO margin filter.

    python examples/reward_model.py --model meta-llama/Llama-3.2-1B-Instruct --data data/prefs/train.jsonl \\
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
(no prompt that only the held-out pairs hold; the two sides never equal), ready for ``dpo.py --data``.

Also shown: ``--decay-rank R`` shrinks the LoRA ranks to R during training (``ftlib.lora.RankDecay``;
the adapter is saved with PEFT ``rank_pattern``/``alpha_pattern``), ``--schedule restarts``
(cosine with warm restarts), ``--offload-blocks K`` (activation offloading of the last K blocks,
a no-op on CPU) and ``--precision auto`` (bf16, or fp16 falling back to fp32 after overflows).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
import zlib
from pathlib import Path

import torch

from ftlib._atomic import atomic_write
from ftlib.checkpoint import Checkpointer
from ftlib.clip import GlobalNormClipper
from ftlib.data import DataError, PairConfig, SkipReport, iter_records, render_chat
from ftlib.data.cli import FlagError, FlagParser, data_error_message, number, whole
from ftlib.data.templates import resolve_chat_template
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
from ftlib.models import (
    load_pretrained,
    load_reward_model,
    load_tokenizer,
    pack_documents,
    pairwise_accuracy,
    save_reward_model,
    score,
)
from ftlib.offload import offload_modules
from ftlib.onpolicy import OnPolicyConfig, build_onpolicy_pairs, prompt_key, reward_model_scorer, write_pairs
from ftlib.optim import TrainOptimizer, make_adamw, param_groups, resolve_precision
from ftlib.sched import CosineRestarts, LRScheduler, WarmupDecay, resolve_warmup
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
    open_loggers,
    parse_with_config,
    pick_precision,
    resume_train_state,
    run_extra,
    run_settings,
    write_run_manifest,
)

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
    p = FlagParser(description=__doc__.split("\n")[0])
    # the flags every ftlib script shares (ftlib.train.cli); pairs are chat records
    add_model_flags(p, precisions=("auto", "bf16", "fp16", "fp32"),
                    precision_help="default: auto on CUDA (bf16 where supported), fp32 on CPU")
    add_data_flags(p, kinds=("chat",))
    add_loop_flags(p, schedules=("cosine", "restarts"))
    add_eval_flags(p)
    add_output_flags(p)
    p.set_defaults(warmup_ratio=0.05, log_every=25)
    g = p.add_argument_group("this script")
    g.add_argument("--score-pairs", nargs="*", default=None,
                   help="pairs files to write again with rewards (default: --data and --eval-data)")
    g.add_argument("--max-length", type=whole(1), default=2048, help="longer documents are skipped and counted")
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
            p.error(f"--{k.replace('_', '-')} is not available in reward_model.py (see finetune_lora.py)")
    if args.resume and args.decay_rank is not None:
        p.error("--resume with --decay-rank is not supported: the adapter's ranks change during the run, so a "
                "checkpoint does not fit a fresh model; run without --decay-rank, or start again")
    check_output_flags(p, args)
    return args


def usage_error(msg: str):
    """A user error found after parsing: one line on stderr, exit 2 (as argparse does)."""
    build_parser().error(msg)


class PairSampler:
    """Batches of pair indices: a shuffled pass over the pairs, reshuffled (by one ``random.Random``
    stream) each time it is used up; a batch may span two passes. Its state (the order, the
    position and the stream's state) goes into the checkpoints, so a resumed run draws the same
    batches as one that was never interrupted."""

    world_size, rank = 1, 0

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size = n, batch_size
        self.rng = random.Random(seed)
        self.order, self.pos, self.epoch, self.step = list(range(n)), n, -1, 0

    def next(self) -> list[int]:
        idx = []
        while len(idx) < min(self.batch_size, self.n):
            if self.pos == len(self.order):
                self.rng.shuffle(self.order)
                self.pos, self.epoch = 0, self.epoch + 1
            idx.append(self.order[self.pos])
            self.pos += 1
        self.step += 1
        return idx

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "batch_size": self.batch_size, "world_size": 1, "rank": 0,
                "n": self.n, "order": list(self.order), "pos": self.pos, "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n:
            raise ValueError(f"saved for {state['n']} training pairs, this run has {self.n}")
        self.order, self.pos, self.epoch, self.step = list(state["order"]), state["pos"], state["epoch"], state["step"]
        self.rng.setstate(state["rng"])


def read_pairs(path: str, tok, template: str, margin_field: str | None = None, *, fields: dict | None = None,
               report: SkipReport | None = None) -> list[tuple[dict, list, list]]:
    """[(record, prompt + chosen turns, prompt + rejected turns)] of a pairs file, read by the preference
    pipeline (``ftlib.data``: any source format, the pair conventions of ``ftlib.data.pairs``); a bad
    record is an error naming the file, line and field, or, with a lenient ``report``
    (``SkipReport(strict=False)``, ``--lenient``), skipped and counted there. ``fields``: further
    ``PairConfig`` fields (``messages_field``, ``prompt_field``, ``system_field``, ``turn_end``)."""
    fmt = PairConfig(kind="chat", chat_template=template, **(fields or {})).formatter(tok.tokenizer)
    report = report if report is not None else SkipReport(strict=True)
    out = []
    for rec, where in iter_records(path, report):
        conv = fmt.conversation(rec, where, report)  # strict: a bad record raises; lenient: None, counted
        if conv is None:
            continue
        prompt, chosen, rejected = conv
        if margin_field is not None and (isinstance(rec.get(margin_field), bool)
                                         or not isinstance(rec.get(margin_field), (int, float))):
            if report.strict:
                raise ValueError(f"{where}: field {margin_field!r} must be a number (--margin-field)")
            report.add("bad_field", where, f"field {margin_field!r} must be a number (--margin-field)")
            continue
        out.append((rec, prompt + chosen, prompt + rejected))
    if not out:
        raise ValueError(f"{path}: no pairs")
    return out


def demo_split(pool: list[dict], n_prompts: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Distinct pairs of ``n_prompts`` prompts, split by the rejected answer: training and held-out
    comparisons share prompts and the right answer, never a (prompt, wrong answer) pair."""
    distinct = {json.dumps(r, sort_keys=True): r for r in pool}
    prompts = sorted({json.dumps(r["messages"]) for r in distinct.values()})
    random.Random(seed).shuffle(prompts)
    keep = set(prompts[:n_prompts])
    chosen = [r for _, r in sorted(distinct.items()) if json.dumps(r["messages"]) in keep]
    held = [zlib.crc32((json.dumps(r["messages"]) + r["rejected"]).encode()) % 2 == 1 for r in chosen]
    return [r for r, h in zip(chosen, held) if not h], [r for r, h in zip(chosen, held) if h]


def tokenize_pairs(pairs, tok, template, max_length):
    """[(chosen ids, rejected ids, index)] and the indices of pairs skipped for length (never silently dropped)."""
    out, skipped = [], []
    for i, (_, chosen, rejected) in enumerate(pairs):
        ids = [tok.encode(render_chat(turns, template), add_special_tokens=False) for turns in (chosen, rejected)]
        if max(map(len, ids)) > max_length:
            skipped.append(i)
            continue
        out.append((ids[0], ids[1], i))
    return out, skipped


def pair_scores(model, pairs):
    chosen = score(model, [c for c, _, _ in pairs])
    rejected = score(model, [r for _, r, _ in pairs])
    return chosen, rejected


def write_scored(src: str, dst: Path, recs, pairs, chosen, rejected) -> int:
    """``recs`` with reward_chosen / reward_rejected; returns how many got scores (skipped ones keep none)."""
    for (_, _, i), c, r in zip(pairs, chosen.tolist(), rejected.tolist()):
        recs[i] = {**recs[i], "reward_chosen": c, "reward_rejected": r}
    text = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in recs if "reward_chosen" in rec)
    dst.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(dst, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return len(pairs)


def onpolicy_pairs(policy_path: str, reward_model, tok, template: str, train: list, held_out: list, *, dtype, device,
                   autocast, seed: int, dst: Path) -> dict:
    """The policy answers the distinct training prompts (greedy + 4 samples), the reward model scores the
    answers, each prompt's best answer is preferred to the worse ones; pairs written to ``dst``."""
    fmt, report = PairConfig(kind="chat", chat_template=template).formatter(tok.tokenizer), SkipReport(strict=True)
    prompt = lambda rec: fmt.conversation(rec, "", report)[0]  # records already checked by read_pairs
    prompts = list({json.dumps(p): p for p in (prompt(rec) for rec, _, _ in train)}.values())
    train_keys = {prompt_key(p) for p in prompts}
    exclude = [p for p in (prompt(rec) for rec, _, _ in held_out) if prompt_key(p) not in train_keys]
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


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        precision, fallback = pick_precision(args.precision, device, cuda_default="auto"), args.fallback
    except FlagError as e:
        usage_error(str(e))
    if precision == "auto":  # bf16 where the GPU has it, else fp16 falling back to fp32 on overflows
        precision, fallback = resolve_precision(device.type, args.fallback)
    if device.type == "cpu":  # the usable cores, at most 8 (ftlib.train.cpu_threads); no loader workers here
        try:
            args.threads = cpu_threads(args.threads)
        except FlagError as e:
            usage_error(str(e))
        torch.set_num_threads(args.threads)

    if args.demo:
        from ftlib.train.demo import arithmetic_pairs, make_demo_assets  # ftlib/train/demo.py

        make_demo_assets(out / "demo")
        pair_dir = out / "demo" / "pairs"
        pair_dir.mkdir(parents=True, exist_ok=True)
        for name, recs in zip(("train", "eval"), demo_split(arithmetic_pairs(4000, seed=1), args.demo_prompts, args.seed)):
            (pair_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        args.model = str(out / "demo" / "base")
        args.data, args.eval_data = [str(pair_dir / "train.jsonl")], [str(pair_dir / "eval.jsonl")]
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

    # 3. data: the chat template from --chat-template or the tokenizer (none: refused), pairs read strictly
    # or, with --lenient, every bad record skipped and counted (the report printed and saved in --out)
    try:
        resolved = resolve_chat_template(args.chat_template, tokenizer=tok)
    except (OSError, ValueError) as e:
        usage_error(f"--chat-template: {e}" if args.chat_template else str(e))
    template = resolved.text
    print(f"chat template: {resolved.source}")
    fields = {"messages_field": args.messages_field, "prompt_field": args.prompt_field,
              "system_field": args.system_field, "turn_end": args.turn_end}
    reports = {"train": SkipReport(strict=not args.lenient), "eval": SkipReport(strict=not args.lenient)}

    def read(flag: str, f: str, report: SkipReport):
        try:
            return read_pairs(f, tok, template, args.margin_field, fields=fields, report=report)
        except DataError as e:
            usage_error(data_error_message(flag, e, args.lenient))
        except (OSError, ValueError) as e:
            usage_error(f"{flag}: {e}")

    train_recs = [r for f in args.data for r in read("--data", f, reports["train"])]
    train, skipped = tokenize_pairs(train_recs, tok, template, args.max_length)
    evals = {f: read("--eval-data", f, reports["eval"]) for f in args.eval_data}
    eval_pairs = [p for f, recs in evals.items() for p in tokenize_pairs(recs, tok, template, args.max_length)[0]]
    print(f"data: {len(train)} training pairs ({len(skipped)} longer than {args.max_length} tokens skipped), "
          f"{len(eval_pairs)} held-out pairs")
    for name, r in reports.items():
        if r.total:
            print(f"{'--data' if name == 'train' else '--eval-data'}: {r}")
    if any(r.total for r in reports.values()):  # every skip, where the run's other files are
        (out / "skipped.json").write_text(json.dumps({k: r.to_dict() for k, r in reports.items()}, indent=1) + "\n")
    if not train:
        usage_error("no training pair fits --max-length")
    data_fp = hashlib.sha256(json.dumps([[c, r] for c, r, _ in train]).encode()).hexdigest()

    # 4. optimizer (mean over the pairs of a step), clipper, schedule; checkpoints; resume; loop
    pairs_per_step = args.batch_size * args.grad_accum
    total = args.max_steps or max(1, args.epochs * len(train) // pairs_per_step)
    save_every, eval_every = eval_intervals(total, save_every=args.save_every, eval_every=args.eval_every)
    opt = TrainOptimizer(make_adamw(param_groups(model, lr=args.lr, weight_decay=args.weight_decay), lr=args.lr,
                                    weight_decay=args.weight_decay), precision=precision, fallback=fallback)

    def held_out():
        """Pairwise accuracy and the Bradley-Terry loss of the held-out pairs (None without any)."""
        if not eval_pairs:
            return None
        model.eval()
        with torch.no_grad(), opt.autocast():
            c, r = pair_scores(model, eval_pairs)
        model.train()
        loss_sum, n = bradley_terry_loss(c.float(), r.float(), None)
        return {"eval_loss": float(loss_sum) / float(n), "eval_accuracy": float(pairwise_accuracy(c, r))}

    clipper = GlobalNormClipper(args.clip)
    if args.schedule == "restarts":
        schedule = CosineRestarts(max(1, total // args.restart_cycles), min_lr_ratio=0.1,
                                  warmup_ratio=args.warmup_ratio)
    else:
        schedule = WarmupDecay(total, warmup=resolve_warmup(total, warmup_ratio=args.warmup_ratio), min_lr_ratio=0.1)
    sched = LRScheduler(opt.optimizer, schedule)
    decay = None
    if args.decay_rank is not None:  # every LoRA layer shrinks to --decay-rank at one step; Adam's state is projected
        decay = RankDecay(model, StepRanks([(max(1, int(total * args.decay_at)), args.decay_rank)]), optimizer=opt)
    if args.offload_blocks:
        offload_modules(model.model.layers[-args.offload_blocks:])
    sampler = PairSampler(len(train), args.batch_size, args.seed)
    settings = run_settings(vars(args), SETTINGS, out=out) | {"chat_template": template, "precision": precision,
                                                              "data_fingerprint": data_fp}
    try:  # weights, optimizer, schedule, clipper, pair order, RNG; settings compared with the saved run's
        resumed = resume_train_state(out / "checkpoints", resume=args.resume, settings=settings,
                                     overrides=args.override, fixed=FIXED, seed=args.seed, model=model, optimizer=opt,
                                     scheduler=sched, clipper=clipper, loader=sampler)
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
    ckpt = Checkpointer(out / "checkpoints", keep=args.keep, metric="eval_loss" if eval_pairs else None)
    write_run_manifest(out, vars(args), device=device, world_size=1, data_fingerprint=data_fp, resume=resumed,
                       extra={"chat_template": {"text": template, "source": resolved.source},
                              "skipped": {k: r.to_dict() for k, r in reports.items()}})
    loggers = open_loggers(args.report_to, out=out, config=vars(args), start_step=step, run_name=out.name)
    if step == 0 and before is not None:  # the step-0 point of the held-out curve
        evals_log.append({"step": 0, "kind": "eval", **before})
        loggers.log(evals_log[-1])
    tokenized = set()  # checkpoint folders that hold the tokenizer files and the template
    model.train()
    t0 = time.perf_counter()
    while step < total:
        step += 1
        correct, pairs_done = 0.0, 0
        for _ in range(args.grad_accum):
            idx = sampler.next()
            b = len(idx)
            batch = pack_documents([train[i][0] for i in idx] + [train[i][1] for i in idx], device)
            margin = None
            if args.margin_field is not None:
                margin = torch.tensor([float(train_recs[train[i][2]][0][args.margin_field]) for i in idx],
                                      device=device)
            with opt.autocast():
                r = model(batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"],
                          max_seqlen=batch["max_seqlen"])  # (2B,): chosen first, then rejected
            loss_sum, n_pairs = bradley_terry_loss(r[:b], r[b:], margin)
            opt.backward(loss_sum, n_pairs)
            correct += float(pairwise_accuracy(r[:b].detach(), r[b:].detach())) * b
            pairs_done += b
        res = opt.step(clipper)
        sched.step()
        if decay is not None:
            for rep in decay.step():
                print(f"rank decay at step {step}: {rep.name} {rep.old_rank} -> {rep.new_rank}, "
                      f"output change <= {rep.max_discarded:.3g} |x|")
        if step % args.log_every == 0 or step == total:
            elapsed = train_s + time.perf_counter() - t0
            rec = {"step": step, "loss": round(res.loss, 4), "batch_accuracy": correct / pairs_done,
                   "lr": sched.get_last_lr()[0], "grad_norm": round(res.grad_norm, 4), "skipped": opt.skipped_steps,
                   "pairs_per_s": round(step * pairs_per_step / max(elapsed, 1e-9), 1)}
            logs.append(rec)
            loggers.log(rec)
            print(json.dumps(rec))
        metrics = {}
        if eval_pairs and ((eval_every and step % eval_every == 0) or step == total):
            metrics = held_out()
            evals_log.append({"step": step, "kind": "eval", **metrics})
            loggers.log(evals_log[-1])
            print(json.dumps(evals_log[-1]))
        if (save_every and step % save_every == 0) or step == total:
            done = ckpt.last_saved  # the last finished save: the tokenizer and template beside its adapter
            if done is not None and done.exists() and done not in tokenized:
                copy_tokenizer_files(args.model, done, chat_template=template)
                tokenized.add(done)
            ckpt.save(step, model=model, optimizer=opt, scheduler=sched, clipper=clipper, loader=sampler,
                      metrics=metrics, base_model_name_or_path=args.model,
                      extra={**run_extra(settings, sampler), "log": logs, "evals": evals_log,
                             "accuracy_before": acc_before, "train_time_s": train_s + time.perf_counter() - t0})
    train_s += time.perf_counter() - t0
    loggers.close()
    ckpt.close()  # waits for the last background write
    for folder in sorted((out / "checkpoints").glob("step-*")):
        if folder not in tokenized and folder.is_dir():
            copy_tokenizer_files(args.model, folder, chat_template=template)

    # 5. held-out accuracy and scored pairs files
    after = held_out()
    acc_after = after and after["eval_accuracy"]
    print(f"held-out pairwise accuracy after training: {acc_after} (before: {acc_before})")
    to_score = args.score_pairs if args.score_pairs is not None else list(args.data) + list(args.eval_data)
    scored = {}
    for f in to_score:
        recs = read("--score-pairs", f, SkipReport(strict=not args.lenient))
        pairs, skip = tokenize_pairs(recs, tok, template, args.max_length)
        recs = [rec for rec, _, _ in recs]
        dst = out / "scored" / Path(f).name
        with torch.no_grad(), opt.autocast():
            rewards = pair_scores(model, pairs)
        n = write_scored(f, dst, recs, pairs, *rewards)
        scored[f] = str(dst)
        print(f"scored {n} pairs of {f} -> {dst}" + (f" ({len(skip)} too long, left out)" if skip else ""))

    onpolicy = None
    if args.onpolicy_policy:
        held_out_recs = [r for f in args.eval_data for r in evals[f]]
        onpolicy = onpolicy_pairs(args.onpolicy_policy, model, tok, template, train_recs, held_out_recs,
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
    metrics = {"accuracy_before": acc_before, "accuracy_after": acc_after, "train_pairs": len(train),
               "ranks": ranks, "steps": step,
               "skipped_too_long": len(skipped), "eval_pairs": len(eval_pairs), "scored": scored,
               "onpolicy": onpolicy, "log": logs, "evals": evals_log,
               "skipped_records": {k: r.total for k, r in reports.items()}}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(f"adapter: {out / 'adapter'}; reward model (transformers SequenceClassification): {out / 'reward_model'}")
    return merged, metrics


if __name__ == "__main__":
    main()
