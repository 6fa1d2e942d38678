"""``ftlib dpo``: preference-tune a Llama-family model (DPO, IPO, hinge, robust DPO, SimPO, ORPO) with LoRA.

The full command; ``examples/dpo.py`` is the same loop in 200 lines to read and copy. The recipe:

    1. load the base model (optionally merging an SFT adapter into it: that model is the reference)
    2. adapt it with LoRA (QLoRA with --qlora): the frozen base stays the reference, at no memory cost
    3. tokenize the pairs once into a pair cache (chat template, loss on the responses only) and
       pack both sides of each pair into the same row, without padding
    4. reference log-probs: computed once into the cache (--reference precompute, the default) or
       a no-grad pass with the adapters disabled at every step (--reference adapters-off)
    5. loop: margin filter -> policy forward (chunked log-probs, no full logits) -> loss -> backward
       -> clip -> step -> schedule
    6. evaluate held-out pairs (reward accuracy, margin) and the exact match of greedy generations
       with the chosen answers, before and after; save the adapter in PEFT's format

KTO (``--loss kto``, Ethayarajh et al. 2024; ``ftlib.rl.kto_loss``, equal to TRL's ``KTOTrainer``):
unpaired records in TRL's format (``prompt``, ``completion``, ``label`` true/false, plain or
conversational) go through the same pair cache (``PairConfig(unpaired=True)``) and ``PairLoader``
(one packed row per micro-batch: the examples, then the mismatched prompt/completion documents of
the reference-KL baseline z0). ``--kto-baseline kl`` (default) estimates z0 per micro-batch from
those documents, ``zero`` fixes z0 = 0 (TRL's ``apo_zero_unpaired``, no mismatched documents);
``--desirable-weight`` / ``--undesirable-weight`` are λ_D / λ_U. The reference is the model with its
adapters disabled, a no-grad pass per step (``--reference adapters-off``; the mismatched documents
change with every batch, so nothing is precomputed). Held-out pair metrics, the margin filter, RPO
and DPOP are pair features and are refused with ``--loss kto``.

Guards against likelihood displacement (the margin grows while the chosen responses' likelihood
falls): ``--rpo-alpha`` adds the chosen response's NLL per token (RPO, TRL's ``rpo_alpha``),
``--dpop-lambda`` DPOP's penalty; every step logs the chosen/rejected log-probs, rewards and margins
under TRL's names (``logps/chosen``, ``rewards/margins``, ... in ``train_log.json``) and a warning is
printed when the chosen log-probs fall steadily while the margin grows.

A real run on one GPU (pairs in JSONL with "prompt"/"messages", "chosen", "rejected"):

    ftlib dpo --model meta-llama/Meta-Llama-3-8B-Instruct --data data/pairs/ \\
        --eval-data data/pairs_eval.jsonl --qlora --precision bf16 --grad-ckpt --max-length 2048 \\
        --batch-size 2 --grad-accum 8 --lr 5e-6 --beta 0.1 --out runs/llama3-dpo

``--seq-len`` (packed row) defaults to 2 x ``--max-length``, so every pair fits one row. Under
``torchrun --nproc_per_node=N`` the pairs are sharded by rank and gradients averaged by DDP.

Killed? The same command with ``--resume`` continues from the newest good checkpoint, bit for bit; a
changed setting is refused (named old -> new) unless ``--override name,...`` takes the new value.

The flags are the ones every ftlib training script shares (``ftlib.train.cli``): ``--kind chat|text``
(``--format`` is the old name), ``--chat-template`` (default: the tokenizer's; none is refused, no
silent ChatML; the template used is written into ``adapter/``, the checkpoints and ``merged/`` and
recorded in ``run.json``), ``--lenient`` (bad pairs skipped, counted, saved in ``skipped.json``),
``--config``, ``--threads``, ``--eval-every`` (held-out DPO metrics every N steps), ``--report-to``.
User errors are one line naming the flag (exit 2); shared flags this script does not implement
(``--eval-split``, ``--early-stop``, ``--sample-every``, ``--compile``) are refused.

``main(argv) -> int`` is the command; ``train(argv) -> (model, results)`` runs it and hands back the
trained model and the numbers (``{"log", "before", "after"}``).

``--demo`` builds the tiny demo model, tokenizer and data (no download), fine-tunes it briefly on the
word-reversal chat data (``ftlib sft``, run as a separate process; it stops while held-out exact
match is well below 100 %), merges that adapter, then builds **on-policy pairs** (``ftlib.onpolicy``):
the SFT model's greedy and sampled answers to the SFT training prompts, scored by the task's checker,
the right answer preferred to the model's own mistakes (no held-out prompt among them). DPO with RPO
on those pairs, then the held-out numbers before and after: a few minutes on a 2-core CPU. Pairs the
model already ranks right (the reversed list against a shuffled one) only widen margins and lower
exact match; pairs from its own mistakes raise it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from ftlib.checkpoint import Checkpointer
from ftlib.clip import GlobalNormClipper
from ftlib.data import (
    DataError,
    MarginFilter,
    PairConfig,
    PairLoader,
    build_pair_cache,
    pair_tokens,
    resolve_chat_template,
)
from ftlib.data.cli import FlagError, FlagParser, data_error_message, number, whole
from ftlib.distributed import init_distributed, wrap_ddp
from ftlib.evaluation import pair_exact_match, pair_metrics, pair_metrics_table
from ftlib.lora import LoRAConfig, apply_lora, count_params, load_adapter, merge_and_unload, save_adapter
from ftlib.metrics import MetricsLogger
from ftlib.models import load_pretrained, load_tokenizer
from ftlib.optim import TrainOptimizer, make_adamw, param_groups
from ftlib.preference import (
    LOSS_KINDS,
    LikelihoodDisplacementMonitor,
    PairLogps,
    PairPolicy,
    PreferenceLoss,
    precompute_reference,
    reference_pair_logps,
)
from ftlib.rl import KTOConfig, kto_logps, kto_loss, reference_kto_logps
from ftlib.sched import LRScheduler, PlateauCosine, WarmupDecay
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
    parse_with_config,
    pick_precision,
    plan_steps,
    resume_train_state,
    run_extra,
    run_settings,
    save_merged,
    write_run_manifest,
)

__all__ = ["build_parser", "main", "train"]

# What a resume compares with the checkpoint's run (ftlib.train.resume): a change is refused unless
# --override names it; FIXED ones cannot be overridden. batch_size x grad_accum x ranks: the global batch.
SETTINGS = ("model", "sft_adapter", "kind", "chat_template", "max_length", "max_prompt_length", "seq_len",
            "batch_size", "grad_accum", "epochs", "max_steps", "lr", "lora_plus", "weight_decay", "warmup_ratio",
            "schedule", "clip", "loss", "beta", "label_smoothing", "gamma", "length_normalize", "rpo_alpha",
            "dpop_lambda", "reference", "lenient", "messages_field", "prompt_field", "system_field", "turn_end",
            "margin_filter", "filter_start", "filter_decay", "filter_every", "filter_floor", "lora_r", "lora_alpha",
            "lora_dropout", "targets", "rslora", "dora", "qlora", "seed")
FIXED = ("model", "sft_adapter", "kind", "chat_template", "max_length", "max_prompt_length", "seq_len", "lora_r",
         "lora_alpha", "targets", "rslora", "dora", "seed", "precision", "reference", "data_fingerprint",
         "messages_field", "prompt_field", "system_field", "turn_end")
KTO_SETTINGS = ("desirable_weight", "undesirable_weight", "kto_baseline")  # compared on resume with --loss kto
DEFAULTS = {"max_length": 1024, "batch_size": 2, "grad_accum": 8, "epochs": 1, "lr": 5e-6, "beta": 0.1,
            "rpo_alpha": None}
DEMO_DEFAULTS = {"max_length": 64, "batch_size": 4, "grad_accum": 1, "epochs": 2, "lr": 1e-3, "beta": 0.5,
                 "rpo_alpha": 1.0}
DEMO_SFT_STEPS = 125  # the demo SFT adapter (r 64, alpha 256): the answer format and part of the task (held-out
# exact match about 0.5; at 150+ steps it nears 1 and DPO has little left to fix)


# shared flags (ftlib.train.cli) this script does not implement: refused when set (value: their unset default)
NOT_HERE = {"eval_split": 0.0, "early_stop": 0, "sample_every": 0, "compile": False, "text_field": "text",
            "response_field": "response", "loss_on": "assistant"}


def build_parser() -> FlagParser:
    p = FlagParser(prog="ftlib dpo", description=__doc__.split("\n")[0])
    # the flags every ftlib script shares (ftlib.train.cli); pairs are chat or text records
    add_model_flags(p)
    add_data_flags(p, kinds=("chat", "text"))
    add_loop_flags(p)
    add_eval_flags(p)
    add_output_flags(p)
    p.set_defaults(warmup_ratio=0.1, log_every=10)
    for a in p._actions:  # here held-out evals during training are off unless asked for (before/after: always)
        if a.dest == "eval_every":
            a.help = "steps between held-out evals during training (default: off; before and after always run)"
    g = p.add_argument_group("preference optimization")
    g.add_argument("--sft-adapter", help="PEFT adapter merged into the base first (the SFT model = the reference)")
    g.add_argument("--max-length", type=whole(1), default=None, help="prompt + one response, in tokens (1024; demo 64)")
    g.add_argument("--max-prompt-length", type=whole(1), default=None, help="cap on the prompt (default: none)")
    g.add_argument("--seq-len", type=whole(1), default=None, help="packed row length (default 2 x --max-length)")
    g.add_argument("--lora-plus", type=number(0, above=True), default=None, help="LoRA+ ratio: lr of B = ratio * lr")
    g.add_argument("--loss", choices=(*LOSS_KINDS, "kto"), default="sigmoid",
                   help="the preference loss; kto: unpaired prompt/completion/label records (ftlib.rl.kto_loss)")
    g.add_argument("--kto-baseline", choices=["kl", "zero"], default="kl",
                   help="--loss kto: the reference-KL baseline z0 from mismatched pairs per batch, or z0 = 0")
    g.add_argument("--desirable-weight", type=number(0), default=1.0, help="--loss kto: lambda_D (label true)")
    g.add_argument("--undesirable-weight", type=number(0), default=1.0, help="--loss kto: lambda_U (label false)")
    g.add_argument("--beta", type=float, default=None,
                   help="beta (0.1; demo 0.5); for orpo the weight lambda of the odds term")
    g.add_argument("--label-smoothing", type=float, default=0.0, help="sigmoid/simpo: conservative DPO; robust: noise rate")
    g.add_argument("--gamma", type=float, default=0.5, help="SimPO target margin")
    g.add_argument("--length-normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="mean instead of summed response log-probs (default: per loss; always for simpo/orpo)")
    g.add_argument("--rpo-alpha", type=float, default=None,
                   help="RPO: add alpha x the chosen response's NLL per token (TRL's rpo_alpha; default off; demo 1)")
    g.add_argument("--dpop-lambda", type=float, default=0.0,
                   help="DPOP: lambda x max(0, ref - policy chosen log-prob) subtracted from the margin (0: off)")
    g.add_argument("--displacement-window", type=int, default=50,
                   help="steps over which falling chosen log-probs with a growing margin raise a warning")
    g.add_argument("--reference", choices=["precompute", "adapters-off"], default=None,
                   help="precompute (default; adapters-off for kto): reference log-probs once into the pair cache; "
                        "adapters-off: a no-grad pass per step")
    g.add_argument("--margin-filter", action="store_true",
                   help="keep pairs whose z-scored reward margin exceeds a decaying threshold (needs rewards)")
    g.add_argument("--filter-start", type=float, default=0.3)
    g.add_argument("--filter-decay", type=float, default=0.95)
    g.add_argument("--filter-every", type=int, default=100, help="optimizer steps between threshold decays")
    g.add_argument("--filter-floor", type=float, default=0.05)
    g.add_argument("--eval-generate", type=whole(0), default=64, help="held-out prompts to generate for exact match (0: off)")
    g = p.add_argument_group("adapter")
    g.add_argument("--lora-r", type=whole(1), default=16)
    g.add_argument("--lora-alpha", type=number(0, above=True), default=32.0)
    g.add_argument("--lora-dropout", type=number(0, 1, below=True), default=0.0,
                   help="default 0: dropout would make the policy log-probs noisy against the dropout-free reference")
    g.add_argument("--targets", default="all-linear", help="'all-linear' or comma-separated module names")
    g.add_argument("--rslora", action="store_true")
    g.add_argument("--dora", action="store_true")
    g.add_argument("--qlora", action="store_true", help="NF4 base weights (double-quantized absmax)")
    g.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing on every block")
    g = p.add_argument_group("this script")
    g.add_argument("--save-merged", action="store_true", help="also write a merged bf16 HF checkpoint")
    g.add_argument("--demo", action="store_true", help="tiny model + pairs built on the fly, SFT first")
    g.add_argument("--demo-prompts", type=int, default=600,
                   help="--demo: SFT training prompts answered by the SFT model for on-policy pairs")
    g.add_argument("--demo-samples", type=int, default=4, help="--demo: sampled answers per prompt (besides greedy)")
    g.add_argument("--demo-sft-steps", type=int, default=DEMO_SFT_STEPS, help="--demo: SFT steps before DPO")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = parse_with_config(p, argv)  # --config FILE under the flags
    if not args.out:
        p.error("--out is required (the run's folder)")
    for k, v in (DEMO_DEFAULTS if args.demo else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.seq_len = args.seq_len or 2 * args.max_length
    if not args.demo and (args.model is None or args.data is None):
        p.error("--model and --data are required (or use --demo)")
    for k, unset in NOT_HERE.items():
        if getattr(args, k) != unset:
            p.error(f"--{k.replace('_', '-')} is not available in ftlib dpo")
    if args.loss == "kto":
        for flag, bad in (("--demo", args.demo), ("--eval-data", args.eval_data), ("--margin-filter", args.margin_filter),
                          ("--rpo-alpha", args.rpo_alpha is not None), ("--dpop-lambda", args.dpop_lambda != 0),
                          ("--label-smoothing", args.label_smoothing != 0), ("--length-normalize",
                                                                             args.length_normalize is not None),
                          ("--reference precompute", args.reference == "precompute")):
            if bad:
                p.error(f"{flag} is not available with --loss kto (unpaired examples; see ftlib dpo --help)")
        args.reference = "adapters-off"
    else:
        for flag, v, unset in (("--kto-baseline", args.kto_baseline, "kl"), ("--desirable-weight", args.desirable_weight, 1.0),
                               ("--undesirable-weight", args.undesirable_weight, 1.0)):
            if v != unset:
                p.error(f"{flag} applies to --loss kto only")
        args.reference = args.reference or "precompute"
    if args.eval_every and not args.eval_data:
        p.error("--eval-every evaluates the held-out pairs: pass --eval-data FILE")
    check_output_flags(p, args)
    return args


def usage_error(msg: str):
    """A user error found after parsing: one line on stderr, exit 2 (as argparse does)."""
    build_parser().error(msg)


def demo_setup(args, out: Path) -> None:
    """The demo's files (``ftlib.train.demo.dpo_demo_setup``): assets, held-out pairs, a short SFT run
    (unless --sft-adapter is given); the training pairs come later, on-policy, from the SFT model."""
    from ftlib.train.demo import dpo_demo_setup

    d = dpo_demo_setup(out, seed=args.seed, sft_steps=args.demo_sft_steps, threads=torch.get_num_threads(),
                       sft=args.sft_adapter is None)
    args.model, args.data, args.eval_data = d["model"], [d["train"]], [d["eval"]]
    args.sft_adapter = args.sft_adapter or d["sft_adapter"]


def main(argv: list[str] | None = None) -> int:
    """``ftlib dpo ...``: 0 when the run ends (a user error exits 2 with one line on stderr)."""
    train(argv)
    return 0


def train(argv: list[str] | None = None):
    """Run ``ftlib dpo`` with ``argv``; returns (the trained model, ``{"log", "before", "after"}``)."""
    args = parse_args(argv)
    env = init_distributed()  # one process without torchrun
    rank, world, device = env.rank, env.world_size, env.device
    torch.manual_seed(args.seed + rank)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        precision = pick_precision(args.precision, device)
    except FlagError as e:
        usage_error(str(e))
    log = print if rank == 0 else (lambda *a, **k: None)
    if device.type == "cpu":  # the usable cores less the loader workers, at most 8 (ftlib.train.cpu_threads)
        try:
            args.threads = 1 if args.demo and args.threads is None else cpu_threads(args.threads,
                                                                                    num_workers=args.num_workers)
        except FlagError as e:
            usage_error(str(e))
        torch.set_num_threads(args.threads)
    if args.demo:
        if rank == 0:
            demo_setup(args, out)
        if world > 1:
            torch.distributed.barrier()
        if rank != 0:
            demo_setup(args, out)  # files exist now: only sets the paths

    # 1. the starting model: base (+ SFT adapter merged). It is also the reference model.
    load_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = load_pretrained(args.model, dtype=load_dtype, device=device)
    tok = load_tokenizer(args.model)
    if args.sft_adapter:
        model = merge_and_unload(load_adapter(model, args.sft_adapter, check_base=False), dtype=load_dtype)
        log(f"merged SFT adapter {args.sft_adapter}")
    # the chat template: --chat-template, else the tokenizer's; none is refused (no silent ChatML)
    resolved = None
    if args.kind == "chat":
        try:
            resolved = resolve_chat_template(args.chat_template, tokenizer=tok)
        except (OSError, ValueError) as e:
            usage_error(f"--chat-template: {e}" if args.chat_template else f"--kind chat: {e}")
        log(f"chat template: {resolved.source}")
    template = resolved.text if resolved is not None else None
    if args.demo:  # the training pairs come from this model's own answers
        from ftlib.train.demo import dpo_demo_pairs

        if rank == 0:
            dpo_demo_pairs(model, tok, template, out, args.data[0], prompts=args.demo_prompts,
                           samples=args.demo_samples, seed=args.seed, log=log,
                           stop_tokens=[t for t in (tok.eos_token_id, tok.tokenizer.token_to_id("<|im_end|>"))
                                        if t is not None])
        if world > 1:
            torch.distributed.barrier()
    if args.grad_ckpt:
        model.set_gradient_checkpointing(every=1, part="block")

    # 2. adapters: the policy is base + adapter; with the adapter disabled it is the reference.
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    lcfg = LoRAConfig(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout, target_modules=targets,
                      use_rslora=args.rslora, use_dora=args.dora, quantize="nf4" if args.qlora else None,
                      double_quant=args.qlora)
    apply_lora(model, lcfg, verbose=False)
    model.to(device)
    log(f"trainable parameters: {count_params(model)}")
    opt = TrainOptimizer(make_adamw(param_groups(model, lr=args.lr, weight_decay=args.weight_decay,
                                                 lora_plus_ratio=args.lora_plus), lr=args.lr,
                                    weight_decay=args.weight_decay), precision=precision)

    # 3. pairs: tokenized once into a pair cache; both sides of a pair packed into the same row.
    # chat: the template writes BOS if the model wants one; text: BOS first when the tokenizer has one
    pcfg = PairConfig(kind=args.kind, chat_template=template, messages_field=args.messages_field,
                      prompt_field=args.prompt_field, system_field=args.system_field, turn_end=args.turn_end,
                      eos_token=tok.eos_token, bos_token=tok.bos_token, max_length=args.max_length,
                      add_bos=args.kind == "text" and tok.bos_token is not None,
                      max_prompt_length=args.max_prompt_length, unpaired=args.loss == "kto")
    pad_id = tok.pad_id
    caches = {}
    for split, src in (("train", args.data), ("eval", args.eval_data)):
        if not src:
            continue
        flag = "--data" if split == "train" else "--eval-data"
        try:  # strict: the first bad record stops the run, naming it; --lenient: skipped and counted
            if rank == 0:
                build_pair_cache(src, tok.tokenizer, pcfg, str(out / f"cache_{split}"), num_proc=args.num_proc,
                                 progress=False, strict=not args.lenient)
            if world > 1:
                torch.distributed.barrier()
            caches[split] = build_pair_cache(src, tok.tokenizer, pcfg, str(out / f"cache_{split}"), num_proc=1,
                                             progress=False, strict=not args.lenient)
        except DataError as e:
            usage_error(data_error_message(flag, e, args.lenient))
        except (OSError, ValueError) as e:
            usage_error(f"{flag}: {e}")
        c = caches[split]
        log(f"{split} pairs: {len(c)} ({c.n_truncated} truncated; {c.report})")
    reports = {k: c.report for k, c in caches.items()}
    if rank == 0 and any(r.total for r in reports.values()):  # every skip, where the run's other files are
        (out / "skipped.json").write_text(json.dumps({k: r.to_dict() for k, r in reports.items()}, indent=1) + "\n")

    data_fp = hashlib.sha256(json.dumps({k: c.fingerprint() for k, c in caches.items()}, sort_keys=True).encode()).hexdigest()
    kto = None
    try:
        if args.loss == "kto":
            kto = KTOConfig(beta=args.beta, desirable_weight=args.desirable_weight,
                            undesirable_weight=args.undesirable_weight,
                            loss_type="kto" if args.kto_baseline == "kl" else "apo_zero_unpaired")
        loss_fn = PreferenceLoss(args.loss if kto is None else "sigmoid", beta=args.beta,
                                 label_smoothing=args.label_smoothing, gamma=args.gamma,
                                 length_normalize=args.length_normalize, rpo_alpha=args.rpo_alpha,
                                 dpop_lambda=args.dpop_lambda)
    except ValueError as e:
        usage_error(str(e))
    # 4. reference log-probs, once, into the caches (adapters disabled: the starting model exactly).
    ref_name = "start"
    if loss_fn.needs_reference and args.reference == "precompute":
        for c in caches.values():  # every rank takes its share of the pairs
            precompute_reference(model, c, ref_name, pad_id=pad_id, seq_len=args.seq_len, batch_size=args.batch_size,
                                 autocast=opt.autocast, device=device, description=f"{args.model} "
                                 f"+ {args.sft_adapter or 'no SFT adapter'}", progress=False)
        log("reference log-probs precomputed into the pair caches")

    if kto is not None:  # one packed row per micro-batch: the examples, then (kl) their mismatched documents
        loader = PairLoader(caches["train"], batch_size=args.batch_size, pad_id=pad_id, seed=args.seed,
                            num_workers=args.num_workers, pin_memory=device.type == "cuda", kl=kto.loss_type == "kto")
        n_good = int(caches["train"].label.sum())
        log(f"train: {len(loader)} micro-batches/epoch/rank of {args.batch_size} examples "
            f"({n_good} desirable, {len(caches['train']) - n_good} undesirable)")
    else:
        loader = PairLoader(caches["train"], batch_size=args.batch_size, seq_len=args.seq_len, pad_id=pad_id,
                            seed=args.seed, num_workers=args.num_workers, pin_memory=device.type == "cuda",
                            trim_padding=device.type == "cpu")  # eager CPU steps: no compute on the rows' padding
        log(f"train: {len(loader)} micro-batches/epoch/rank, packing {loader.pack_stats}")
    mfilter = None
    if args.margin_filter:
        if not torch.isfinite(torch.from_numpy(caches["train"].effective_margin)).any():
            usage_error("--margin-filter needs reward_chosen/reward_rejected or margin in the pairs; none has them")
        mfilter = MarginFilter(args.filter_start, args.filter_decay, args.filter_every, args.filter_floor, pad_id=pad_id)

    train_model = PairPolicy(model) if kto is None else _KTOPolicy(model)
    if world > 1:
        train_model = wrap_ddp(train_model)
    try:
        plan = plan_steps(len(loader), grad_accum=args.grad_accum, epochs=args.epochs, max_steps=args.max_steps)
    except ValueError as e:
        usage_error(f"{e}: more pairs, or a smaller --batch-size / --grad-accum")
    steps_per_epoch, total = plan.steps_per_epoch, plan.total
    if args.schedule == "plateau":
        schedule = PlateauCosine(total=total, warmup_ratio=args.warmup_ratio, min_lr_ratio=0.1)
    else:
        schedule = WarmupDecay(total=total, warmup_ratio=args.warmup_ratio, decay=args.schedule, min_lr_ratio=0.1)
    sched = LRScheduler(opt.optimizer, schedule)
    clipper = GlobalNormClipper(args.clip)

    # checkpoints and resume (ftlib.train): weights, optimizer, schedule, clipper, loader position, RNG;
    # the settings are compared with the saved run's. The margin filter's counts and the log so far
    # ride in the checkpoint's extra state.
    save_every = args.save_every if args.save_every is not None else max(1, total // 10)
    settings = run_settings(vars(args), SETTINGS + (KTO_SETTINGS if kto is not None else ()), out=out) | {"chat_template": template, "precision": precision,
                                                              "data_fingerprint": data_fp}
    try:
        resumed = resume_train_state(out / "checkpoints", resume=args.resume, settings=settings,
                                     overrides=args.override, fixed=FIXED, plan=plan, seed=args.seed, log=log,
                                     model=model, optimizer=opt, scheduler=sched, clipper=clipper, loader=loader)
    except ResumeError as e:
        raise SystemExit(str(e)) from None
    step, extra = resumed.step, resumed.extra
    if rank == 0:
        write_run_manifest(out, vars(args), device=device, world_size=world, data_fingerprint=data_fp, resume=resumed,
                           extra={"chat_template": {"text": resolved.text, "source": resolved.source}
                                  if resolved is not None else None,
                                  "skipped": {k: r.to_dict() for k, r in reports.items()}})
    loggers = MetricsLogger(None, start_step=step, progress=False, print_every=None,  # the trackers of --report-to
                            report_to=args.report_to if rank == 0 else [], log_dir=out, run_config=vars(args),
                            run_name=out.name)
    tokens_seen, logs = extra.get("tokens_seen", 0), extra.get("logs", [])
    if mfilter is not None and "filter" in extra:
        mfilter.load_state_dict(extra["filter"])
    monitor = LikelihoodDisplacementMonitor(window=args.displacement_window, warn=False)  # printed below
    if "displacement" in extra:
        monitor.load_state_dict(extra["displacement"])
    ckpt = Checkpointer(out / "checkpoints", keep=args.keep) if rank == 0 else None

    eval_kw = dict(loss_fn=loss_fn, pad_id=pad_id, seq_len=args.seq_len, device=device, autocast=opt.autocast)
    stop = [t for t in (tok.eos_token_id, tok.tokenizer.token_to_id("<|im_end|>")) if t is not None]
    em_kw = dict(limit=args.eval_generate, stop_tokens=stop, device=device)
    before, before_file = None, out / "eval_before.json"
    if "eval" in caches and rank == 0:
        if step == 0:  # the starting model (a fresh adapter changes nothing)
            before = pair_metrics(model, caches["eval"], **eval_kw)
            before.update(pair_exact_match(model, tok, args.eval_data, pcfg, **em_kw))
            before_file.write_text(json.dumps(before) + "\n")
            log("held-out before DPO: " + _fmt(before))
        elif before_file.exists():
            before = json.loads(before_file.read_text())

    # 5. the loop: one iteration = one optimizer step over grad_accum micro-batches.
    # Rates: real tokens (both sides of every pair, the prompt once per side, no padding: bench_dpo's unit)
    # and response tokens (the labels, about half of them), per second after this process's first step,
    # whose one-off costs (the DataLoader start, first-touch allocations) are logged as first_step_s.
    t0 = time.perf_counter()
    real_tokens, t_first, first_step_s = 0, None, None
    train_model.train()
    while step < total:
        epoch, window = divmod(step, steps_per_epoch)
        loader.set_epoch(epoch)  # mid-epoch after a resume: the loader state says where
        it = iter(loader)
        for _ in range(window, steps_per_epoch):
            stats = []
            for micro in range(args.grad_accum):
                batch = next(it)
                if mfilter is not None:
                    batch = mfilter(batch, step)
                tokens_seen += int((batch["labels"] != -100).sum())
                real_tokens += pair_tokens(batch) if kto is None else int(batch["cu_seqlens"][2 * batch["n_examples"]
                                                                          if kto.loss_type == "kto" else
                                                                          batch["n_examples"]])
                batch = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
                last = micro == args.grad_accum - 1
                if kto is not None:
                    ref, ref_kl = reference_kto_logps(model, batch, autocast=opt.autocast)
                    with opt.grad_sync(train_model, enabled=last) if world > 1 else nullcontext():
                        with opt.autocast():
                            pol, pol_kl = train_model(batch)
                        res = kto_loss(pol, ref, batch["label"], kto, policy_kl_logps=pol_kl, reference_kl_logps=ref_kl)
                        opt.backward(res.losses.sum(), res.losses.numel())  # per-example losses, mean over the window
                    stats.append({**res.stats, "n_pairs": int(res.losses.numel()),
                                  "n_desirable": int(batch["label"].sum())})
                    continue
                ref = None
                if loss_fn.needs_reference:  # precomputed values ride in the batch, else a no-grad pass
                    ref = reference_pair_logps(model, batch, autocast=opt.autocast)
                sync = opt.grad_sync(train_model, enabled=last) if world > 1 else nullcontext()
                with sync:
                    with opt.autocast():
                        policy = PairLogps(*train_model(batch))
                    res = loss_fn(policy, ref)
                    opt.backward(res.losses.sum(), res.losses.numel())  # per-pair losses, mean over the window
                stats.append(res.stats())
            result = opt.step(clipper)
            sched.step(1, loss=result.loss)
            step += 1
            # every step: TRL's names, pair-weighted over the window's micro-batches
            rec = {"step": step, "loss": round(result.loss, 4),
                   **{k: round(_pair_mean(stats, k), 4) for k in sorted({k for st in stats for k in st})
                      if "/" in k or k in ("nll_loss", "kl")},
                   "lr": sched.get_last_lr()[0], "grad_norm": round(result.grad_norm, 4), "skipped": opt.skipped_steps}
            if mfilter is not None:
                rec["filter"] = dict(mfilter.counts, threshold=round(mfilter.threshold(step), 4))
            logs.append(rec)
            loggers.log(rec)
            if args.eval_every and rank == 0 and "eval" in caches and step % args.eval_every == 0:
                ev = pair_metrics(model, caches["eval"], **eval_kw)
                loggers.log({"step": step, "kind": "eval", **ev})
                log(f"held-out at step {step}: " + _fmt(ev))
            if "logps/chosen" in rec and (msg := monitor.update(rec)):
                log(f"WARNING step {step}: {msg}")
            now = time.perf_counter()
            if t_first is None:  # the rate window starts after this process's first step
                t_first, first_step_s, real_tokens, tokens_seen_0 = now, now - t0, 0, tokens_seen
            if step % args.log_every == 0 or step == total:
                rates = {}
                if first_step_s is not None:  # on the first line logged
                    rates["first_step_s"], first_step_s = round(first_step_s, 3), None
                if now > t_first:
                    rates |= {"tokens_per_s": round(real_tokens / (now - t_first), 1),
                              "response_tokens_per_s": round((tokens_seen - tokens_seen_0) / (now - t_first), 1)}
                log(json.dumps(rec | rates))
            if ckpt is not None and ((save_every and step % save_every == 0) or step == total):
                extra = {**run_extra(settings, loader), "tokens_seen": tokens_seen, "logs": logs,
                         "displacement": monitor.state_dict()}
                if mfilter is not None:
                    extra["filter"] = mfilter.state_dict()
                ckpt.save(step, model=model, optimizer=opt, scheduler=sched, clipper=clipper, loader=loader,
                          base_model_name_or_path=args.model, extra=extra)
            if step >= total:
                break
    loggers.close()
    if ckpt is not None:
        ckpt.close()  # waits for the last background write
        for folder in sorted((out / "checkpoints").glob("step-*")):  # each adapter with the template it trained with
            if folder.is_dir():
                copy_tokenizer_files(args.model, folder, chat_template=template)
    if world > 1:
        torch.distributed.barrier()

    # 6. held-out numbers after, and the adapter.
    after = None
    if rank == 0:
        if "eval" in caches:
            after = pair_metrics(model, caches["eval"], **eval_kw)
            after.update(pair_exact_match(model, tok, args.eval_data, pcfg, **em_kw))
            log(pair_metrics_table(before, after))
        adapter_dir = save_adapter(model, out / "adapter", base_model_name_or_path=args.model)
        copy_tokenizer_files(args.model, adapter_dir, chat_template=template)
        (out / "train_log.json").write_text(json.dumps({"log": logs, "eval_before": before, "eval_after": after},
                                                       indent=1))
        log(f"adapter saved to {adapter_dir}" + (" (on the SFT-merged base)" if args.sft_adapter else ""))
        if args.save_merged:
            save_merged(model, out / "merged", tokenizer_from=args.model, dtype=torch.bfloat16, chat_template=template)
            log(f"merged checkpoint saved to {out / 'merged'}")
    if world > 1:
        torch.distributed.destroy_process_group()
    return model, {"log": logs, "before": before, "after": after}


class _KTOPolicy(torch.nn.Module):
    """The policy of a KTO step as one module (what DDP wraps): batch -> ``kto_logps``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch: dict):
        return kto_logps(self.model, batch)


def _pair_mean(stats: list[dict], key: str) -> float:
    """Pair-weighted mean of ``key`` over the micro-batches' ``PreferenceOutput.stats()``."""
    have = [s for s in stats if key in s and s["n_pairs"]]  # KTO: a micro-batch may hold no desirable example
    return sum(s[key] * s["n_pairs"] for s in have) / max(sum(s["n_pairs"] for s in have), 1)


def _fmt(m: dict | None) -> str:
    if not m:
        return "n/a"
    s = (f"reward accuracy {m['reward_accuracy']:.3f}, mean margin {m['reward_margin']:.4f}, "
         f"log-prob accuracy {m['logp_accuracy']:.3f} ({m['pairs']} pairs)")
    if "exact_match" in m:
        s += f", exact match {m['exact_match']:.3f} ({m['generated']} prompts)"
    return s


if __name__ == "__main__":
    sys.exit(main())
