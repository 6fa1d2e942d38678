"""GRPO step: ftlib.rl vs TRL's GRPOTrainer on the same tiny model, prompts, G, max new tokens and steps (CPU).

    python benchmarks/bench_grpo.py [--steps 6] [--prompts 8] [--group 8] [--max-new-tokens 16]

Both start from the same checkpoint (the demo's 2-layer Llama of ``ftlib/train/demo.py``), LoRA
r=8 on every linear layer, loss ``dapo``, beta 0, one optimisation pass (μ = 1), temperature 1. Each
provider runs in its own process (peak RSS is per process); the first step is a warm-up and is not
timed. Seconds per step are split into generation (sampling the G completions per prompt) and the
rest (rewards, log-probs, loss, backward, optimizer step). TRL runs its default correct settings for
this setup: transformers ``generate`` with its KV cache, its fused chunked LM head, SDPA attention.
Rows are appended to ``benchmarks/results/grpo.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))


def _setup(root: Path, n_prompts: int):
    import torch

    from ftlib.data import render_chat
    from ftlib.train.demo import CHATML, PROMPT, demo_records, make_demo_assets

    torch.manual_seed(0)
    assets = make_demo_assets(root / "assets")
    recs = demo_records(200, 0)[:n_prompts]
    prompts, answers = [], []
    for r in recs:
        words = r["messages"][-2]["content"][len(PROMPT):].split()
        prompts.append(render_chat([{"role": "user", "content": PROMPT + " ".join(words)}], CHATML,
                                   add_generation_prompt=True))
        answers.append(" ".join(reversed(words)))
    return assets, prompts, answers


def run_ftlib(args) -> dict:
    import torch

    from ftlib import rl
    from ftlib.lora import LoRAConfig, apply_lora, trainable_params
    from ftlib.models import load_pretrained, load_tokenizer

    assets, prompts, answers = _setup(Path(args.root), args.prompts)
    tok = load_tokenizer(assets / "base")
    model = load_pretrained(assets / "base", dtype=torch.float32)
    apply_lora(model, LoRAConfig(r=8, alpha=16, target_modules="all-linear"), verbose=False)
    opt = torch.optim.AdamW(list(trainable_params(model).values()), lr=1e-3)
    cfg = rl.GRPOConfig(loss_type="dapo")
    sampling = rl.SamplingConfig(max_new_tokens=args.max_new_tokens, stop_tokens=(tok.eos_token_id,))
    gen, rng = rl.ModelGenerator(model, tok.pad_token_id), torch.Generator().manual_seed(0)
    reward = rl.exact_answer_reward(extract=r"(.+)")
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    gen_s, train_s = [], []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        ro = rl.rollout(gen, tok, ids, group_size=args.group, sampling=sampling, rng=rng, prompts=prompts,
                        fields={"answer": answers})
        t1 = time.perf_counter()
        rw = rl.compute_rewards([reward], ro.prompts, ro.completions, answer=ro.fields["answer"])
        adv = rl.group_advantages(rw.total, args.group)
        for b in rl.pack_rollouts(ro, pad_id=tok.pad_token_id):
            lp = rl.policy_logprobs(model, b)
            rl.grpo_loss(lp.logp, adv.advantages[b["sample_index"]], b["token_seq"], cfg).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        gen_s.append(t1 - t0)
        train_s.append(time.perf_counter() - t1)
    return {"gen_s": gen_s[1:], "train_s": train_s[1:]}


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    assets, prompts, answers = _setup(Path(args.root), args.prompts)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(assets / "base" / "tokenizer.json"), eos_token="<|im_end|>",
                                  pad_token="<pad>")
    model = AutoModelForCausalLM.from_pretrained(assets / "base", dtype=torch.float32)

    def exact(completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    ds = Dataset.from_list([{"prompt": p, "answer": a} for p, a in zip(prompts, answers)] * (args.steps + 1))
    cfg = GRPOConfig(output_dir=str(Path(args.root) / "trl"), per_device_train_batch_size=args.prompts * args.group,
                     num_generations=args.group, max_completion_length=args.max_new_tokens, max_steps=args.steps + 1,
                     learning_rate=1e-3, loss_type="dapo", beta=0.0, temperature=1.0, logging_steps=1, report_to=[],
                     save_strategy="no", use_cpu=True, bf16=False, dataloader_num_workers=0, seed=0)
    tr = GRPOTrainer(model=model, reward_funcs=exact, args=cfg, train_dataset=ds, processing_class=tok,
                     peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    gen_s, step_s = [], []
    generate, step = tr._generate, tr.training_step

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        out = generate(*a, **k)
        gen_s.append(time.perf_counter() - t0)
        return out

    def timed_step(*a, **k):
        t0 = time.perf_counter()
        out = step(*a, **k)
        step_s.append(time.perf_counter() - t0)
        return out

    tr._generate, tr.training_step = timed_generate, timed_step
    tr.train()
    return {"gen_s": gen_s[1:], "train_s": [s - g for s, g in zip(step_s[1:], gen_s[1:])]}


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    res = (run_ftlib if args.provider == "ftlib" else run_trl)(args)
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(res))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads, the same for both")
    p.add_argument("--provider", choices=["ftlib", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.provider:
        return child(args)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for provider in ("ftlib", "trl"):
            cmd = [sys.executable, __file__, "--provider", provider, "--root", root, "--steps", str(args.steps),
                   "--prompts", str(args.prompts), "--group", str(args.group), "--max-new-tokens",
                   str(args.max_new_tokens), "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode or not line:
                raise SystemExit(f"{provider} failed:\n{out.stderr[-3000:]}")
            r = json.loads(line[-1][7:])
            g, t = sum(r["gen_s"]) / len(r["gen_s"]), sum(r["train_s"]) / len(r["train_s"])
            rows.append({"provider": provider, "gen_s_per_step": round(g, 4), "train_s_per_step": round(t, 4),
                         "s_per_step": round(g + t, 4), "peak_rss_mb": round(r["peak_rss_mb"], 1)})
    base = rows[1]
    print(f"GRPO step, {args.prompts} prompts x G={args.group}, max {args.max_new_tokens} new tokens, "
          f"{args.steps} timed steps, CPU, {args.threads} thread(s)")
    print(f"{'provider':<8} {'gen s/step':>11} {'train s/step':>13} {'total s/step':>13} {'peak RSS MB':>12} "
          f"{'speedup':>8} {'memory':>7}")
    for r in rows:
        print(f"{r['provider']:<8} {r['gen_s_per_step']:>11.3f} {r['train_s_per_step']:>13.3f} {r['s_per_step']:>13.3f} "
              f"{r['peak_rss_mb']:>12.1f} {base['s_per_step'] / r['s_per_step']:>7.2f}x "
              f"{r['peak_rss_mb'] / base['peak_rss_mb']:>6.2f}x")
    import torch

    path = HERE / "results" / "grpo.csv"
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["date", "provider", "prompts", "group", "max_new_tokens", "steps", "gen_s_per_step",
                        "train_s_per_step", "s_per_step", "peak_rss_mb", "threads", "cpu", "torch"])
        for r in rows:
            w.writerow([datetime.now(timezone.utc).isoformat(timespec="seconds"), r["provider"], args.prompts,
                        args.group, args.max_new_tokens, args.steps, r["gen_s_per_step"], r["train_s_per_step"],
                        r["s_per_step"], r["peak_rss_mb"], args.threads, platform.processor() or platform.machine(),
                        torch.__version__])


if __name__ == "__main__":
    main()
