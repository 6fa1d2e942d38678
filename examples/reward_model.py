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

    python examples/reward_model.py --model meta-llama/Llama-3.2-1B-Instruct --pairs data/prefs/train.jsonl \\
        --eval-pairs data/prefs/eval.jsonl --score-pairs data/prefs/train.jsonl --out runs/rm

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

import argparse
import json
import random
import time
import zlib
from pathlib import Path

import torch

from ftlib._atomic import atomic_write
from ftlib.clip import GlobalNormClipper
from ftlib.data import PairConfig, SkipReport, iter_records, render_chat
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
from ftlib.train import copy_tokenizer_files

DEMO = {"steps": 200, "lr": 1e-3, "batch_pairs": 8}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF model folder or hub repo id (causal LM or sequence classification)")
    p.add_argument("--pairs", nargs="+", help="training pairs (JSONL)")
    p.add_argument("--eval-pairs", nargs="*", default=[], help="held-out pairs for the accuracy (JSONL)")
    p.add_argument("--score-pairs", nargs="*", default=None,
                   help="pairs files to write again with rewards (default: --pairs and --eval-pairs)")
    p.add_argument("--out", required=True, help="output folder (adapter, merged model, scored pairs, log)")
    p.add_argument("--chat-template", help="Jinja text or a built-in name (chatml, llama3); default: the tokenizer's")
    p.add_argument("--max-length", type=int, default=2048, help="longer documents are skipped and counted")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (1000; demo 200)")
    p.add_argument("--batch-pairs", type=int, default=None, help="pairs per step (16; demo 8)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (1e-4; demo 1e-3)")
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--schedule", choices=["cosine", "restarts"], default="cosine",
                   help="restarts: cosine with warm restarts, --restart-cycles equal cycles")
    p.add_argument("--restart-cycles", type=int, default=2)
    p.add_argument("--decay-rank", type=int, default=None, help="shrink every LoRA rank to this at --decay-at")
    p.add_argument("--decay-at", type=float, default=0.5, help="fraction of the steps at which ranks shrink")
    p.add_argument("--offload-blocks", type=int, default=0, help="offload the activations of the last K blocks")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--margin-field", default=None, help="record field holding a per-pair margin (Llama 2)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--targets", default="all-linear", help="'all-linear' or comma-separated module names")
    p.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default=None,
                   help="default: auto on CUDA (bf16 where supported), fp32 on CPU")
    p.add_argument("--fallback", choices=["bf16", "fp32"], default=None,
                   help="with --precision fp16: switch to this after 10 overflow skips within 100 steps")
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing on every block")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--onpolicy-policy", default=None,
                   help="causal LM (the SFT policy) whose answers to the training prompts, scored by the trained "
                        "reward model, are written as pairs to <out>/onpolicy/pairs.jsonl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--demo", action="store_true", help="tiny model + arithmetic pairs built on the fly")
    p.add_argument("--demo-prompts", type=int, default=24, help="demo prompts (each with several pairs)")
    args = p.parse_args(argv)
    defaults = DEMO if args.demo else {"steps": 1000, "lr": 1e-4, "batch_pairs": 16}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not args.demo and (args.model is None or not args.pairs):
        p.error("--model and --pairs are required (or use --demo)")
    return args


def read_pairs(path: str, tok, template: str, margin_field: str | None = None) -> list[tuple[dict, list, list]]:
    """[(record, prompt + chosen turns, prompt + rejected turns)] of a pairs file, read by the preference
    pipeline (``ftlib.data``: any source format, the pair conventions of ``ftlib.data.pairs``); a bad
    record is an error naming the file, line and field."""
    fmt = PairConfig(kind="chat", chat_template=template).formatter(tok.tokenizer)
    report, out = SkipReport(strict=True), []
    for rec, where in iter_records(path, report):
        prompt, chosen, rejected = fmt.conversation(rec, where, report)  # strict: a bad record raises
        if margin_field is not None and (isinstance(rec.get(margin_field), bool)
                                         or not isinstance(rec.get(margin_field), (int, float))):
            raise ValueError(f"{where}: field {margin_field!r} must be a number (--margin-field)")
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
    precision, fallback = args.precision or ("auto" if device.type == "cuda" else "fp32"), args.fallback
    if precision == "auto":  # bf16 where the GPU has it, else fp16 falling back to fp32 on overflows
        precision, fallback = resolve_precision(device.type, args.fallback)

    if args.demo:
        from _demo_assets import arithmetic_pairs, make_demo_assets  # examples/_demo_assets.py

        make_demo_assets(out / "demo")
        pair_dir = out / "demo" / "pairs"
        pair_dir.mkdir(parents=True, exist_ok=True)
        for name, recs in zip(("train", "eval"), demo_split(arithmetic_pairs(4000, seed=1), args.demo_prompts, args.seed)):
            (pair_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        args.model = str(out / "demo" / "base")
        args.pairs, args.eval_pairs = [str(pair_dir / "train.jsonl")], [str(pair_dir / "eval.jsonl")]

    # 1-2. reward model = decoder + scalar head; LoRA on the decoder, the head trained in full.
    model = load_reward_model(args.model, dtype=torch.bfloat16 if precision == "bf16" else torch.float32, device=device)
    tok = load_tokenizer(args.model)
    if args.grad_ckpt:
        model.set_gradient_checkpointing(every=1, part="block")
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    apply_lora(model, LoRAConfig(r=args.lora_r, alpha=args.lora_alpha, target_modules=targets,
                                 modules_to_save=["score"]), verbose=False)
    print(f"trainable parameters: {count_params(model)}")

    # 3. data
    template = args.chat_template or tok.chat_template or "chatml"
    train_recs = [r for f in args.pairs for r in read_pairs(f, tok, template, args.margin_field)]
    train, skipped = tokenize_pairs(train_recs, tok, template, args.max_length)
    evals = {f: read_pairs(f, tok, template, args.margin_field) for f in args.eval_pairs}
    eval_pairs = [p for f, recs in evals.items() for p in tokenize_pairs(recs, tok, template, args.max_length)[0]]
    print(f"data: {len(train)} training pairs ({len(skipped)} longer than {args.max_length} tokens skipped), "
          f"{len(eval_pairs)} held-out pairs")
    if not train:
        raise SystemExit("no training pair fits --max-length")

    # 4. optimizer (mean over the pairs of a step), clipper, schedule, loop
    opt = TrainOptimizer(make_adamw(param_groups(model, lr=args.lr), lr=args.lr), precision=precision,
                         fallback=fallback)

    def accuracy():
        if not eval_pairs:
            return None
        with opt.autocast():
            return pairwise_accuracy(*pair_scores(model, eval_pairs))

    acc_before = accuracy()
    print(f"held-out pairwise accuracy before training: {acc_before}")
    clipper = GlobalNormClipper(args.clip)
    if args.schedule == "restarts":
        schedule = CosineRestarts(max(1, args.steps // args.restart_cycles), min_lr_ratio=0.1,
                                  warmup_ratio=args.warmup_ratio)
    else:
        schedule = WarmupDecay(args.steps, warmup=resolve_warmup(args.steps, warmup_ratio=args.warmup_ratio),
                               min_lr_ratio=0.1)
    sched = LRScheduler(opt.optimizer, schedule)
    decay = None
    if args.decay_rank is not None:  # every LoRA layer shrinks to --decay-rank at one step; Adam's state is projected
        decay = RankDecay(model, StepRanks([(max(1, int(args.steps * args.decay_at)), args.decay_rank)]), optimizer=opt)
    if args.offload_blocks:
        offload_modules(model.model.layers[-args.offload_blocks:])
    rng = random.Random(args.seed)
    order, pos, logs, t0 = list(range(len(train))), len(train), [], time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        idx = []
        while len(idx) < min(args.batch_pairs, len(train)):
            if pos == len(order):
                rng.shuffle(order)
                pos = 0
            idx.append(order[pos])
            pos += 1
        b = len(idx)
        batch = pack_documents([train[i][0] for i in idx] + [train[i][1] for i in idx], device)
        margin = None
        if args.margin_field is not None:
            margin = torch.tensor([float(train_recs[train[i][2]][0][args.margin_field]) for i in idx], device=device)
        with opt.autocast():
            r = model(batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"],
                      max_seqlen=batch["max_seqlen"])  # (2B,): chosen first, then rejected
        loss_sum, n_pairs = bradley_terry_loss(r[:b], r[b:], margin)
        opt.backward(loss_sum, n_pairs)
        res = opt.step(clipper)
        sched.step()
        if decay is not None:
            for rep in decay.step():
                print(f"rank decay at step {step}: {rep.name} {rep.old_rank} -> {rep.new_rank}, "
                      f"output change <= {rep.max_discarded:.3g} |x|")
        if step % args.log_every == 0 or step == args.steps:
            rec = {"step": step, "loss": round(res.loss, 4), "batch_accuracy": pairwise_accuracy(r[:b].detach(), r[b:].detach()),
                   "lr": sched.get_last_lr()[0], "grad_norm": round(res.grad_norm, 4), "skipped": opt.skipped_steps,
                   "pairs_per_s": round(step * b / (time.perf_counter() - t0), 1)}
            logs.append(rec)
            print(json.dumps(rec))

    # 5. held-out accuracy and scored pairs files
    acc_after = accuracy()
    print(f"held-out pairwise accuracy after training: {acc_after} (before: {acc_before})")
    to_score = args.score_pairs if args.score_pairs is not None else list(args.pairs) + list(args.eval_pairs)
    scored = {}
    for f in to_score:
        recs = read_pairs(f, tok, template, args.margin_field)
        pairs, skip = tokenize_pairs(recs, tok, template, args.max_length)
        recs = [rec for rec, _, _ in recs]
        dst = out / "scored" / Path(f).name
        with opt.autocast():
            rewards = pair_scores(model, pairs)
        n = write_scored(f, dst, recs, pairs, *rewards)
        scored[f] = str(dst)
        print(f"scored {n} pairs of {f} -> {dst}" + (f" ({len(skip)} too long, left out)" if skip else ""))

    onpolicy = None
    if args.onpolicy_policy:
        held_out = [r for f in args.eval_pairs for r in evals[f]]
        onpolicy = onpolicy_pairs(args.onpolicy_policy, model, tok, template, train_recs, held_out,
                                  dtype=torch.bfloat16 if precision == "bf16" else torch.float32, device=device,
                                  autocast=opt.autocast, seed=args.seed, dst=out / "onpolicy" / "pairs.jsonl")

    # 6. save: the PEFT adapter, then a merged checkpoint in transformers' sequence-classification layout
    ranks = None if decay is None else sorted(set(decay.ranks().values()))
    save_adapter(model, out / "adapter", base_model_name_or_path=args.model, task_type="SEQ_CLS")
    merged = merge_and_unload(model, dtype=None)
    save_reward_model(merged, out / "reward_model", pad_token_id=tok.pad_token_id)
    copy_tokenizer_files(args.model, out / "reward_model")
    metrics = {"accuracy_before": acc_before, "accuracy_after": acc_after, "train_pairs": len(train),
               "ranks": ranks,
               "skipped_too_long": len(skipped), "eval_pairs": len(eval_pairs), "scored": scored,
               "onpolicy": onpolicy, "log": logs}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(f"adapter: {out / 'adapter'}; reward model (transformers SequenceClassification): {out / 'reward_model'}")
    return merged, metrics


if __name__ == "__main__":
    main()
