"""``ftlib grpo``: online RL with verifiable rewards (GRPO, Dr. GRPO, DAPO) on LoRA adapters.

The full command; ``examples/grpo.py`` is the same loop in under 200 lines to read and copy. Per step:
``--prompts`` training prompts, ``--group`` G sampled completions each (``ftlib.rl.rollout``, dropout
off), the rewards (``--reward``, summed with ``--reward-weights``), group advantages (zero-variance
groups dropped and counted), packed rows, then ``--mu`` passes of ``ftlib.rl.grpo_loss`` (clipped
ratio with ``--epsilon-low`` / ``--epsilon-high``, KL to the reference with ``--beta``, aggregation
``--loss-type``), each followed by a clipped optimizer step. The reference is the starting model (the
adapters disabled). Held-out prompts (``--eval-data``) are scored by their greedy completions' reward
before and after (``ftlib.rl.greedy_reward``).

    ftlib grpo --demo --out runs/grpo                      # tiny model, CPU, a few minutes
    ftlib grpo --model Qwen/Qwen2.5-0.5B-Instruct --data gsm8k_train.jsonl --eval-data gsm8k_test.jsonl \\
        --reward exact:last_number --reward format:'.*\\d+' --reward-weights 1,0.1 --out runs/grpo

Prompts are records (JSONL, Parquet, ... any source of ``ftlib.data``) with ``--prompt-field`` (a string:
one user turn, or a message list), rendered with the chat template (``--chat-template``, else the
tokenizer's; ``--raw-prompts`` uses the strings as they are); every other field goes to the reward
functions (e.g. ``answer``). A bad record is an error naming its file and line (``--lenient``: skipped
and counted). ``--reward``: ``exact[:EXTRACT]`` (1 when the extracted answer equals the record's
``--answer-field``; EXTRACT ``last_number`` (default), ``boxed`` or a regular expression), ``format:REGEX``
(1 when the completion matches), ``model:PATH`` (a reward model's score of prompt + completion, e.g.
``ftlib reward``'s ``reward_model/``).

Writes ``metrics.jsonl`` (TRL's names: ``reward``, ``frac_reward_zero_std``, ``completions/mean_length``,
...), ``summary.json``, ``checkpoints/`` (adapter, optimizer, the sampler's RNG, the settings) and
``adapter/`` (PEFT format). ``--resume`` continues from the newest good checkpoint exactly (the same
rollouts, bit for bit on CPU); a changed setting is refused, naming it.

``main(argv) -> int`` is the command; ``train(argv) -> summary`` runs it and returns ``summary.json``'s dict.
"""

from __future__ import annotations

import json
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from ftlib import rl
from ftlib.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint
from ftlib.clip import GlobalNormClipper
from ftlib.data import DataError, SkipReport, iter_records, render_chat, resolve_chat_template
from ftlib.data.cli import FlagParser, data_error_message, number, whole
from ftlib.distributed import init_distributed
from ftlib.lora import LoRAConfig, apply_lora, save_adapter, trainable_params
from ftlib.models import load_pretrained, load_reward_model, load_tokenizer, save_pretrained
from ftlib.train import ResumeError, compare_settings, copy_tokenizer_files

__all__ = ["build_parser", "main", "parse_reward", "train"]

DEFAULTS = {"steps": 200, "lr": 2e-5, "max_new_tokens": 256}
DEMO_DEFAULTS = {"steps": 80, "lr": 3e-3, "max_new_tokens": 16}
# what a resume compares with the checkpoint's run: a change is refused, naming it
SETTINGS = ("model", "data", "prompt_field", "answer_field", "chat_template", "raw_prompts", "reward", "reward_weights",
            "group", "prompts", "steps", "mu", "loss_type", "beta", "epsilon_low", "epsilon_high", "scale_rewards",
            "lr", "clip", "max_new_tokens", "temperature", "top_k", "top_p", "lora_r", "lora_alpha", "targets",
            "precision", "seed", "sft_steps", "sft_right")


def build_parser() -> FlagParser:
    p = FlagParser(prog="ftlib grpo", description=__doc__.split("\n")[0])
    g = p.add_argument_group("model and data")
    g.add_argument("--model", help="causal LM: HF folder or hub id (--demo: the demo's SFT model)")
    g.add_argument("--data", nargs="+", help="training prompt records (JSONL/Parquet/folders)")
    g.add_argument("--eval-data", nargs="+", help="held-out prompt records: greedy reward before and after")
    g.add_argument("--prompt-field", default="prompt", help="record field holding the prompt (string or messages)")
    g.add_argument("--answer-field", default="answer", help="record field the exact reward compares with")
    g.add_argument("--chat-template", help="built-in name or Jinja file/text (default: the tokenizer's)")
    g.add_argument("--raw-prompts", action="store_true", help="prompts are text used as they are (no template)")
    g.add_argument("--lenient", action="store_true", help="skip bad records (counted) instead of stopping")
    g = p.add_argument_group("rewards")
    g.add_argument("--reward", action="append", default=None, metavar="SPEC",
                   help="exact[:last_number|boxed|REGEX], format:REGEX or model:PATH; repeat for several "
                        "(default: exact:last_number; --demo: exact:(.+))")
    g.add_argument("--reward-weights", default=None, help="comma-separated weights, one per --reward (default 1 each)")
    g = p.add_argument_group("GRPO")
    g.add_argument("--group", type=whole(2), default=8, help="G: completions per prompt")
    g.add_argument("--prompts", type=whole(1), default=8, help="prompts per step")
    g.add_argument("--steps", type=whole(1), default=None, help="rollout steps (200; demo 80)")
    g.add_argument("--mu", type=whole(1), default=1, help="optimisation passes per rollout batch")
    g.add_argument("--loss-type", choices=rl.LOSS_TYPES, default="dapo", help="loss aggregation")
    g.add_argument("--beta", type=number(0), default=0.0, help="KL coefficient to the reference (0: no reference pass)")
    g.add_argument("--epsilon-low", type=number(0, 1, below=True), default=0.2, help="clip range below 1")
    g.add_argument("--epsilon-high", type=number(0), default=0.28, help="clip range above 1 (DAPO's clip-higher)")
    g.add_argument("--scale-rewards", choices=["group", "batch", "none"], default="group",
                   help="advantage scaling (none: Dr. GRPO)")
    g.add_argument("--lr", type=number(0, above=True), default=None, help="AdamW learning rate (2e-5; demo 3e-3)")
    g.add_argument("--clip", type=number(0), default=1.0, help="global gradient-norm bound (0: off)")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=whole(1), default=None, help="completion length cap (256; demo 16)")
    g.add_argument("--temperature", type=number(0, above=True), default=1.0)
    g.add_argument("--top-k", type=whole(1), default=None)
    g.add_argument("--top-p", type=number(0, 1, above=True), default=None)
    g = p.add_argument_group("adapter and run")
    g.add_argument("--lora-r", type=whole(1), default=8)
    g.add_argument("--lora-alpha", type=number(0, above=True), default=16.0)
    g.add_argument("--targets", default="all-linear", help="'all-linear' or comma-separated module names")
    g.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                   help="bf16: autocast on CUDA, fp32 weights (default on CUDA); fp32 (default on CPU)")
    g.add_argument("--seed", type=whole(0), default=0)
    g.add_argument("--out", help="output folder (metrics, checkpoints, adapter); required")
    g.add_argument("--save-every", type=whole(1), default=5, help="steps between checkpoints")
    g.add_argument("--keep", type=whole(1), default=2, help="newest checkpoints kept")
    g.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint in --out")
    g.add_argument("--override", default="", help="with --resume: comma-separated settings whose new values it takes")
    g.add_argument("--threads", type=whole(1), default=1, help="torch CPU threads (a small model gains little from more)")
    g = p.add_argument_group("demo")
    g.add_argument("--demo", action="store_true", help="tiny self-made model and word-reversal task, SFT first")
    g.add_argument("--sft-steps", type=whole(0), default=2000, help="--demo: noisy SFT steps before GRPO")
    g.add_argument("--sft-right", type=number(0, 1), default=0.5, help="--demo: fraction of SFT answers that are right")
    return p


def parse_reward(spec: str, *, answer_field: str = "answer", device=None):
    """A ``--reward`` SPEC as a reward function (see the module docstring); ``ValueError`` naming what is wrong."""
    kind, _, arg = spec.partition(":")
    if kind == "exact":
        return rl.exact_answer_reward(arg or "last_number", answer_field=answer_field)
    if kind == "format":
        if not arg:
            raise ValueError(f"{spec!r}: format needs a pattern (format:REGEX)")
        return rl.format_reward(arg)
    if kind == "model":
        if not arg:
            raise ValueError(f"{spec!r}: model needs a path (model:PATH)")
        rm = load_reward_model(arg, dtype=torch.float32, device=device).eval()
        return rl.reward_model_reward(rm, load_tokenizer(arg), device=device)
    raise ValueError(f"{spec!r}: not exact[:EXTRACT], format:REGEX or model:PATH")


def parse_args(p: FlagParser, argv):
    args = p.parse_args(argv)
    if not args.out:
        p.error("--out is required (the run's folder)")
    for k, v in (DEMO_DEFAULTS if args.demo else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not args.demo and (args.model is None or not args.data):
        p.error("--model and --data are required (or use --demo)")
    if args.override and not args.resume:
        p.error("--override applies to --resume")
    if args.demo and (args.model or args.data):
        p.error("--demo builds its own model and prompts: drop --model / --data")
    args.reward = args.reward or (["exact:(.+)"] if args.demo else ["exact:last_number"])
    if args.reward_weights is not None:
        try:
            args.reward_weights = [float(w) for w in args.reward_weights.split(",")]
        except ValueError:
            p.error(f"--reward-weights: expected comma-separated numbers, got {args.reward_weights!r}")
        if len(args.reward_weights) != len(args.reward):
            p.error(f"--reward-weights: {len(args.reward_weights)} weights for {len(args.reward)} --reward")
    if args.loss_type == "dr_grpo" and args.scale_rewards != "none":
        print("note: --loss-type dr_grpo is usually run with --scale-rewards none (Dr. GRPO)", file=sys.stderr)
    return args


def read_prompts(spec, args, flag: str, render) -> list[dict]:
    """Prompt records of ``spec``: ``{"text": the rendered prompt, "fields": {other fields}}``."""
    report, out = SkipReport(strict=not args.lenient), []
    for rec, where in iter_records(spec, report):
        prompt = rec.get(args.prompt_field)
        ok = isinstance(prompt, str) and prompt.strip() if args.raw_prompts else (
            (isinstance(prompt, str) and prompt.strip()) or (isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt)))
        if not ok:
            report.add("bad_field", where, f"field {args.prompt_field!r} must be a non-empty string"
                       + ("" if args.raw_prompts else " or a list of {'role', 'content'} messages"))
            continue
        out.append({"text": render(prompt), "fields": {k: v for k, v in rec.items() if k != args.prompt_field}})
    if report.total:
        print(f"{flag}: {report}")
    if not out:
        raise ValueError("no prompt records")
    return out


def demo_setup(args, out: Path) -> None:
    """The demo's model (noisy SFT of the tiny demo base, made once) and prompt files."""
    from ftlib.onpolicy import write_pairs
    from ftlib.train.demo import demo_records, heldout_records, make_demo_assets, noisy_sft, prompt_records

    assets = make_demo_assets(out / "assets", seed=args.seed)
    train_recs, held = prompt_records(demo_records(2000, args.seed)), prompt_records(heldout_records())
    if not (out / "sft" / "config.json").exists():  # the starting point, made once (a resumed run reuses it)
        print(f"== noisy SFT first: {args.sft_steps} steps, {args.sft_right:.0%} of the answers right", flush=True)
        model = load_pretrained(assets / "base", dtype=torch.float32)
        noisy_sft(model, load_tokenizer(assets / "base"), train_recs, steps=args.sft_steps, seed=args.seed,
                  right=args.sft_right)
        save_pretrained(model, out / "sft")
        copy_tokenizer_files(assets / "base", out / "sft")
    args.model, args.data = str(out / "sft"), [str(write_pairs(train_recs, out / "demo" / "train.jsonl"))]
    args.eval_data = [str(write_pairs(held, out / "demo" / "eval.jsonl"))]


def main(argv: list[str] | None = None) -> int:
    """``ftlib grpo ...``: 0 when the run ends (a user error exits 2 with one line on stderr)."""
    train(argv)
    return 0


def train(argv: list[str] | None = None) -> dict:
    """Run ``ftlib grpo`` with ``argv``; returns the summary written to ``summary.json``."""
    p = build_parser()
    args = parse_args(p, argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = init_distributed()
    if env.world_size > 1:
        p.error("ftlib grpo runs in one process (torchrun is not supported here): run it without torchrun")
    device = env.device
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    if precision == "bf16" and device.type != "cuda":
        p.error("--precision bf16 autocasts on CUDA; on the CPU use fp32 (its default)")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    if args.demo:
        demo_setup(args, out)

    model = load_pretrained(args.model, dtype=torch.float32, device=device)
    tok = load_tokenizer(args.model)
    template = None
    if not args.raw_prompts:
        try:
            resolved = resolve_chat_template(args.chat_template, tokenizer=tok)
        except (OSError, ValueError) as e:
            p.error(f"--chat-template: {e}" if args.chat_template else f"{e} (or --raw-prompts)")
        template = resolved.text
    render = (lambda x: x) if args.raw_prompts else (lambda x: render_chat(
        [{"role": "user", "content": x}] if isinstance(x, str) else x, template, add_generation_prompt=True,
        bos_token=tok.bos_token or "", eos_token=tok.eos_token or ""))
    sets = {}
    for name, spec, flag in (("train", args.data, "--data"), ("eval", args.eval_data, "--eval-data")):
        if spec:
            try:
                sets[name] = read_prompts(spec, args, flag, render)
            except DataError as e:
                p.error(data_error_message(flag, e, args.lenient))
            except (OSError, ValueError) as e:
                p.error(f"{flag}: {e}")
    try:
        funcs = [parse_reward(s, answer_field=args.answer_field, device=device) for s in args.reward]
    except (OSError, ValueError) as e:
        p.error(f"--reward {e}")
    weights = args.reward_weights
    missing = [k for k in ("train", "eval") if k in sets for r in sets[k][:1] if any(
        s.startswith("exact") for s in args.reward) and args.answer_field not in r["fields"]]
    if missing:
        p.error(f"--reward exact needs the field {args.answer_field!r} in every record (--answer-field); "
                f"the first {'--data' if missing[0] == 'train' else '--eval-data'} record has none")
    stop = tuple(t for t in (tok.eos_token_id, tok.tokenizer.token_to_id("<|im_end|>")) if t is not None)
    autocast = (lambda: torch.autocast("cuda", torch.bfloat16)) if precision == "bf16" else nullcontext

    def held_out() -> float | None:
        if "eval" not in sets:
            return None
        ev = sets["eval"]
        keys = sorted(set.intersection(*(set(r["fields"]) for r in ev)))
        with autocast():
            return rl.greedy_reward(model, tok, [r["text"] for r in ev], funcs, weights=weights, stop_tokens=stop,
                                    max_new_tokens=args.max_new_tokens, **{k: [r["fields"][k] for r in ev] for k in keys})

    acc_before = held_out()
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    apply_lora(model, LoRAConfig(r=args.lora_r, alpha=args.lora_alpha, target_modules=targets), verbose=False)
    params = list(trainable_params(model).values())
    opt = torch.optim.AdamW(params, lr=args.lr)
    clipper = GlobalNormClipper(args.clip) if args.clip else None
    cfg = rl.GRPOConfig(loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon_low,
                        epsilon_high=args.epsilon_high, scale_rewards=args.scale_rewards,
                        max_completion_length=args.max_new_tokens, temperature=args.temperature)
    sampling = rl.SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                 max_new_tokens=args.max_new_tokens, stop_tokens=stop)
    pad = tok.pad_id
    gen = rl.ModelGenerator(model, pad)
    rng = torch.Generator().manual_seed(args.seed)  # the sampler's RNG: saved in every checkpoint
    settings = {k: getattr(args, k) for k in SETTINGS} | {"chat_template": template}
    if args.demo:
        settings |= {"model": "<demo>", "data": "<demo>"}
    ckpt, step, metrics_file = Checkpointer(out / "checkpoints", keep=args.keep), 0, out / "metrics.jsonl"
    last = latest_checkpoint(out / "checkpoints")
    if last is not None and not args.resume:
        p.error(f"--out {out} holds checkpoints ({last.name}): pass --resume to continue, or another --out")
    if last is not None:
        state = load_checkpoint(last, model=model, optimizer=opt)
        try:
            compare_settings(state.extra["settings"], settings,
                             overrides=[o.strip().replace("-", "_") for o in args.override.split(",") if o.strip()])
        except ResumeError as e:
            raise SystemExit(f"ftlib grpo: error: --resume: {e}") from None
        step, acc_before = state.step, state.extra["acc_before"]
        rng.set_state(state.extra["sampler_rng"])
        recs = [line for line in open(metrics_file) if json.loads(line)["step"] <= step]
        metrics_file.write_text("".join(recs))  # drop what the interrupted run logged after it
        print(f"resumed from {last} (step {step})")
    elif metrics_file.exists():
        metrics_file.unlink()
    train_set = sets["train"]
    keys = sorted(set.intersection(*(set(r["fields"]) for r in train_set)))
    model.train()
    while step < args.steps:
        t0 = time.perf_counter()
        recs = random.Random(args.seed * 100003 + step).sample(train_set, min(args.prompts, len(train_set)))
        texts = [r["text"] for r in recs]
        with autocast():
            ro = rl.rollout(gen, tok, [tok.encode(t, add_special_tokens=False) for t in texts], group_size=args.group,
                            sampling=sampling, rng=rng, prompts=texts,
                            fields={k: [r["fields"][k] for r in recs] for k in keys})
        rw = rl.compute_rewards(funcs, ro.prompts, ro.completions, weights=weights, lenient=args.lenient, **ro.fields)
        adv = rl.group_advantages(rw.total, args.group, scale_rewards=args.scale_rewards, drop_zero_std=True)
        rec = {"step": step + 1, **rw.stats(), **ro.stats(), **adv.stats}
        keep = adv.keep.nonzero().squeeze(1).tolist()
        if keep:
            batches = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in b.items()}
                       for b in rl.pack_rollouts(ro, indices=keep, pad_id=pad)]
            advantages = adv.advantages.to(device)
            n_items = sum(int(b["token_seq"].numel()) for b in batches)  # dapo: tokens of the whole step
            for b in batches:  # π_old (μ > 1) and the reference, once per rollout batch, no gradient
                with autocast():
                    if args.mu > 1:
                        with torch.no_grad():
                            b["old"] = rl.policy_logprobs(model, b, temperature=cfg.temperature).logp
                    if cfg.beta:
                        b["ref"] = rl.reference_logprobs(model, b, temperature=cfg.temperature)
            t1 = time.perf_counter()
            for _ in range(args.mu):
                for b in batches:
                    with autocast():
                        lp = rl.policy_logprobs(model, b, temperature=cfg.temperature, entropy=True)
                    res = rl.grpo_loss(lp.logp, advantages[b["sample_index"]], b["token_seq"],
                                       cfg, old_logps=b.get("old"), ref_logps=b.get("ref"), num_items=n_items,
                                       entropy=lp.entropy)
                    (res.loss / (1 if cfg.loss_type == "dapo" else len(batches))).backward()
                if clipper is not None:
                    rec["grad_norm"] = float(clipper(params).norm_before)
                opt.step()
                opt.zero_grad(set_to_none=True)
            rec.update(res.stats, **{"train/tokens_per_s": args.mu * sum(b["n_tokens"] for b in batches)
                                     / (time.perf_counter() - t1)})
        rec["step_seconds"] = time.perf_counter() - t0
        step += 1
        with open(metrics_file, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"step {step:3d}  reward {rec['reward']:.3f}  zero-std groups {rec['frac_reward_zero_std']:.2f}  "
              f"len {rec['completions/mean_length']:.1f}  {rec['step_seconds']:.2f}s", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            ckpt.save(step, model=model, optimizer=opt, base_model_name_or_path=args.model,
                      extra={"sampler_rng": rng.get_state(), "acc_before": acc_before, "settings": settings})
    ckpt.close()
    acc_after = held_out()
    save_adapter(model, out / "adapter", base_model_name_or_path=args.model)
    copy_tokenizer_files(args.model, out / "adapter", chat_template=template)
    rewards = [json.loads(line)["reward"] for line in open(metrics_file)]
    summary = {"seed": args.seed, "heldout_reward_before": acc_before, "heldout_reward_after": acc_after,
               "reward_first10": sum(rewards[:10]) / len(rewards[:10]),
               "reward_last10": sum(rewards[-10:]) / len(rewards[-10:])}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if acc_before is not None:
        print(f"held-out greedy reward {acc_before:.3f} -> {acc_after:.3f}  |  ", end="")
    print(f"mean reward first 10 steps {summary['reward_first10']:.3f}, last 10 {summary['reward_last10']:.3f}")
    return summary


if __name__ == "__main__":
    sys.exit(main())
