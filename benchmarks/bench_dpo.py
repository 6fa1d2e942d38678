"""DPO step on the same pairs in three layouts: ftlib's PairLoader as examples/dpo.py runs it, the same
pairs laid flat in one padding-free row, and the padded layout; real tokens/s, each variant in a fresh process.

One DPO step on a micro-batch = fetch the batch + the reference pass (no grad, LoRA adapters disabled)
+ the policy forward and backward + an AdamW step on the adapters, sigmoid loss. Every variant runs
the same steps over the same pairs: the pairs of step k are those of the k-th batch of a
``PairLoader`` (rows of --seq-len, --rows rows a step, seed --seed), laid out as

  pairloader  that batch, from the PairLoader itself, iterated live as examples/dpo.py does it, with
              its --num-workers default (``--loader-workers``; default: the example's, 2)
  pairloader_inproc  the same PairLoader with no worker (batches built in the loop)
  flat        the same pairs in one row exactly as long as their tokens (``collate_pairs_packed`` on a
              one-row plan): no padding, no worker, batch built in the loop
  padded      the same pairs as 2P rows (chosen, then rejected) right-padded to the longest
              (``collate_pairs_padded``), built in the loop
  padded_fulllogits  the padded layout with the usual full-logits log_softmax + gather ([2P, L, V]
              logits in memory): the common implementation, shown for its memory on CUDA

Every variant runs with the torch threads examples/dpo.py picks on CPU (``ftlib.train.cpu_threads``
with the example's workers: 1 on a 2-core machine) unless --threads is given, so the layouts and the
loader are compared on the same cores. Real tokens are the tokens of both sequences of a pair (the
prompt counted once per side; ``ftlib.data.pair_tokens``); padding is not counted. examples/dpo.py
logs this unit as ``tokens_per_s`` beside ``response_tokens_per_s`` (the labels alone, about half).
Throughput = real tokens of the steps after the first --warmup steps / their wall time, median over
--repeats rounds; rounds alternate the variants (A B C, B C A, ...) and every (round, variant) is a
fresh process, so no variant inherits another's warm allocator or threads. ``first s`` is the slowest
of the first three steps (the warm-up the issue saw), ``1st CPU s`` the same in this process's CPU
time, ``CPU s`` the median step's; ``cores`` is the CPU time of the process and its loader workers
over the wall time of the timed steps, and ``tok/CPU-s`` the real tokens per second of that CPU time
(what a busy shared machine cannot distort much at one thread). The optimizer runs with lr 0 (its cost
is in the step, the weights never change), so every variant's per-pair losses are checked against
flat's (WRONG in the table when they differ); ratios are against the fastest correct variant, by wall
time and by CPU time. On CUDA ``peak MB`` is the max allocated above the model during the steps.

    python benchmarks/bench_dpo.py --csv benchmarks/results/dpo.csv             # CPU, small model
    python benchmarks/bench_dpo.py --preset gpu --budget-s 90 --csv OUT/dpo.csv   # 1B-class model, bf16
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _summary import append_row, summary  # noqa: E402

import ftlib  # noqa: E402
from ftlib.data.packing import PackPlan  # noqa: E402
from ftlib.data.pair_batches import PairLoader, collate_pairs_packed, collate_pairs_padded  # noqa: E402
from ftlib.lora import LoRAConfig, apply_lora, disable_adapters, trainable_params  # noqa: E402
from ftlib.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from ftlib.preference import PairLogps, PreferenceLoss, pair_logps, reference_pair_logps  # noqa: E402

VARIANTS = ["pairloader", "pairloader_inproc", "flat", "padded", "padded_fulllogits"]
PRESETS = {
    # pairs of ~470 tokens (2 p + c + r), rows of 2048, 2 rows a step: ~8 pairs a step, ~5 % padding
    "cpu": dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=344, vocab=8192, pairs=80, rows=2,
                seq_len=2048, max_length=1024, prompt_median=110, response_median=120, steps=8, precision="fp32"),
    # Llama-3.2-1B's widths with 8 of its 16 layers (the logits, what padding and full logits cost, are whole)
    "gpu": dict(hidden=2048, layers=8, heads=32, kv_heads=8, intermediate=8192, vocab=128256, pairs=96, rows=2,
                seq_len=4096, max_length=2048, prompt_median=300, response_median=350, steps=10, precision="bf16"),
}


class SyntheticPairs:
    """In-memory pairs with the PairCache interface the loaders use (random token ids)."""

    def __init__(self, n, max_length, prompt_median, response_median, vocab, seed):
        rng = np.random.default_rng(seed)
        lognormal = lambda med, size: np.exp(rng.normal(np.log(med), 0.7, size)).astype(np.int64)
        p = np.clip(lognormal(prompt_median, n), 8, max_length // 2)
        c = np.clip(lognormal(response_median, n), 4, None)
        r = np.clip(lognormal(response_median, n), 4, None)
        c, r = np.minimum(c, max_length - p), np.minimum(r, max_length - p)
        self.prompt_len, self.chosen_len, self.rejected_len = p, c, r
        self.tokens = [(rng.integers(3, vocab, int(a)), rng.integers(3, vocab, int(b)), rng.integers(3, vocab, int(d)))
                       for a, b, d in zip(p, c, r)]
        self.effective_margin = np.full(n, np.nan)
        self.reference, self.path = None, "<synthetic>"

    def __len__(self):
        return len(self.tokens)

    @property
    def side_lengths(self):
        return self.prompt_len + self.chosen_len, self.prompt_len + self.rejected_len

    def sequence(self, i, side):
        prompt, c, r = self.tokens[i]
        s = c if side == "chosen" else r
        return (np.concatenate([prompt, s]).astype(np.int64),
                np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(s), np.uint8)]))


def flat_batch(pairs, pair_ids, pad_id=0):
    """The pairs in one row exactly as long as their tokens (no padding), through collate_pairs_packed."""
    sc, sr = pairs.side_lengths
    ids = np.asarray(pair_ids, dtype=np.int64)
    length = (sc[ids] + sr[ids]).astype(np.int64)
    plan = PackPlan(seq_len=int(length.sum()), row_ptr=np.array([0, len(ids)], np.int64), doc=ids,
                    start=np.zeros(len(ids), np.int64), length=length, stats=None)
    return collate_pairs_packed(pairs, plan, [0], pad_id)


def full_logits_pair_logps(model, batch) -> PairLogps:
    """The usual implementation: logits [2P, L, V], log_softmax, gather the labels."""
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])[:, :-1].float()
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask
    s, n = lp.sum(1), mask.sum(1)
    ci, ri = batch["chosen_index"], batch["rejected_index"]
    return PairLogps(s[ci], s[ri], n[ci], n[ri])


def dpo_step(model, opt, batch, variant, loss_fn, autocast):
    with torch.no_grad():
        if variant == "padded_fulllogits":
            with disable_adapters(model), autocast():
                ref = full_logits_pair_logps(model, batch)
        else:
            ref = reference_pair_logps(model, batch, autocast=autocast)
    with autocast():
        pol = full_logits_pair_logps(model, batch) if variant == "padded_fulllogits" else pair_logps(model, batch)
    out = loss_fn(pol, ref)
    out.losses.sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.losses.detach()


def example_num_workers() -> int:
    """``ftlib dpo``'s --num-workers default (what its PairLoader runs with unless told)."""
    from ftlib.cli.dpo import build_parser

    return int(build_parser().get_default("num_workers"))


def child(args) -> dict:
    """One variant in this (fresh) process: the timed steps, as a JSON-able dict."""
    from ftlib.train import cpu_threads

    v = args.child
    device = "cuda" if torch.cuda.is_available() else "cpu"
    workers = args.loader_workers if v == "pairloader" else 0
    if device == "cpu":  # every variant: examples/dpo.py's thread count (its rule with its workers) unless --threads
        torch.set_num_threads(args.threads or cpu_threads(None, num_workers=args.loader_workers))
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=max(4096, args.seq_len))
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    apply_lora(model, LoRAConfig(r=args.lora_r, alpha=2 * args.lora_r, target_modules="all-linear"), verbose=False)
    model.to(device)
    with torch.no_grad():  # adapters at init leave policy == reference: perturb B so the losses differ
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    # lr 0: the step's full cost, weights unchanged, so every variant's per-pair losses can be compared
    opt = torch.optim.AdamW(trainable_params(model).values(), lr=0.0)
    autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if args.precision == "bf16" else \
        (lambda: torch.autocast(device, enabled=False))
    loss_fn = PreferenceLoss("sigmoid", beta=0.1)
    pairs = SyntheticPairs(args.pairs, args.max_length, args.prompt_median, args.response_median, args.vocab, args.seed)
    sc, sr = pairs.side_lengths
    loader = PairLoader(pairs, batch_size=args.rows, pad_id=0, seq_len=args.seq_len, seed=args.seed,
                        num_workers=workers, pin_memory=device == "cuda", trim_padding=device == "cpu")  # as dpo.py
    n_steps = min(args.steps, len(loader))
    step_pairs = [np.concatenate([loader.plan.doc[loader.plan.row_ptr[r]:loader.plan.row_ptr[r + 1]] for r in rows])
                  for rows in loader.rank_steps()[:n_steps]]

    def batches():
        if v.startswith("pairloader"):
            yield from loader  # live: the DataLoader, its workers, the collate
        for ids in step_pairs:
            yield flat_batch(pairs, ids) if v == "flat" else collate_pairs_padded(pairs, ids, 0)

    times, cpus, tokens, slots, losses = [], [], [], [], {}
    cpu0 = time.process_time()
    it = batches()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    peak0 = torch.cuda.memory_allocated() if device == "cuda" else 0
    for k in range(n_steps):
        if k == args.warmup:
            cpu0, wall0 = time.process_time(), time.perf_counter()
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        batch = next(it)
        ids = batch["pair_ids"].numpy()
        if set(ids.tolist()) != set(step_pairs[k].tolist()):
            raise RuntimeError(f"{v}: step {k} holds other pairs than the PairLoader's")
        slots.append(int(batch["input_ids"].numel()))
        batch = {key: (t.to(device, non_blocking=True) if torch.is_tensor(t) else t) for key, t in batch.items()}
        out = dpo_step(model, opt, batch, v, loss_fn, autocast)
        sync()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        tokens.append(int((sc[ids] + sr[ids]).sum()))
        losses.update(zip(ids.tolist(), out.float().cpu().tolist()))
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    del it  # shuts the loader's workers down, so their CPU time is counted below
    import gc

    gc.collect()
    child_cpu = sum(getattr(resource.getrusage(resource.RUSAGE_CHILDREN), f) for f in ("ru_utime", "ru_stime"))
    timed = slice(args.warmup, None)
    return {"variant": v, "threads": torch.get_num_threads(), "workers": workers, "steps": n_steps,
            "step_s": times, "tokens": tokens, "slots": slots,
            "tokens_per_s": sum(tokens[timed]) / sum(times[timed]), "first_s": max(times[:3]),
            "first_cpu_s": max(cpus[:3]), "later_cpu_s": statistics.median(cpus[timed]),
            "later_s": statistics.median(times[timed]), "cores": (cpu + child_cpu) / wall,
            "tokens_per_cpu_s": sum(tokens[timed]) / (cpu + child_cpu),
            "peak_mb": (torch.cuda.max_memory_allocated() - peak0) / 2**20 if device == "cuda" else float("nan"),
            "losses": {str(k): x for k, x in losses.items()},
            "device": device, "device_name": torch.cuda.get_device_name() if device == "cuda" else
            (platform.processor() or platform.machine())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: gpu on CUDA, else cpu")
    for k in PRESETS["cpu"]:
        ap.add_argument("--" + k.replace("_", "-"), type=str if k == "precision" else int, default=None)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s (shown as 'first s')")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (each variant once per round, fresh process)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="stop starting rounds after this many seconds")
    ap.add_argument("--variants", default="pairloader,pairloader_inproc,flat,padded")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads for every variant (0: what examples/dpo.py picks: "
                         "ftlib.train.cpu_threads with its workers)")
    ap.add_argument("--loader-workers", type=int, default=None,
                    help="pairloader's DataLoader workers (default: examples/dpo.py's --num-workers default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", default=None, help="write the table's rows to this CSV file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = PRESETS[args.preset or ("gpu" if device == "cuda" else "cpu")]
    for k, val in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, val)
    if args.loader_workers is None:
        args.loader_workers = example_num_workers()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    variants = args.variants.split(",")
    if "flat" not in variants or set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants must include flat and come from {VARIANTS}")

    t_start = time.monotonic()
    runs = {v: [] for v in variants}
    base_argv = [a for a in sys.argv[1:] if not a.startswith("--csv=")]
    if "--csv" in base_argv:  # the children print; the parent writes
        i = base_argv.index("--csv")
        del base_argv[i : i + 2]
    for rep in range(args.repeats):
        if rep and args.budget_s and time.monotonic() - t_start > args.budget_s:
            print(f"time budget reached after {rep} rounds")
            break
        order = variants[rep % len(variants):] + variants[: rep % len(variants)]
        for v in order:
            cmd = [sys.executable, os.path.abspath(__file__), *base_argv, "--loader-workers",
                   str(args.loader_workers), "--child", v]
            res = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if res.returncode or line is None:  # reported; the other variants and rounds go on
                print(f"{v} round {rep + 1} failed (exit {res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}",
                      flush=True)
                continue
            r = json.loads(line[7:])
            runs[v].append(r)
            print(f"round {rep + 1}: {v} {r['tokens_per_s']:.0f} tok/s", flush=True)
            if args.csv:  # the run's own row, written as soon as it is measured (the table's medians follow)
                stem, ext = os.path.splitext(args.csv)
                os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
                append_row(f"{stem}_runs{ext or '.csv'}",
                           ["date", "device", "device_name", "torch", "ftlib", "precision", "variant", "round",
                            "tokens_per_s", "first_s", "later_s", "peak_mb"],
                           [dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), r["device"],
                            r["device_name"], torch.__version__, ftlib.__version__, args.precision, v, rep,
                            f"{r['tokens_per_s']:.1f}", f"{r['first_s']:.3f}", f"{r['later_s']:.3f}",
                            f"{r['peak_mb']:.1f}"])
    variants = [v for v in variants if runs[v]]
    if "flat" not in variants:
        print("bench_dpo: the flat reference variant did not run; no table")
        raise SystemExit(1)

    tol = 1e-4 if args.precision == "fp32" else 2e-2
    ref = runs["flat"][0]["losses"]
    stats = {}
    for v in variants:
        rs = runs[v]
        diff = max(abs(x - ref[k]) for r in rs for k, x in r["losses"].items())
        r0 = rs[0]
        stats[v] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                    "first_s": statistics.median(r["first_s"] for r in rs),
                    "first_cpu_s": statistics.median(r["first_cpu_s"] for r in rs),
                    "later_cpu_s": statistics.median(r["later_cpu_s"] for r in rs),
                    "later_s": statistics.median(r["later_s"] for r in rs),
                    "cores": statistics.median(r["cores"] for r in rs),
                    "tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] for r in rs),
                    "peak_mb": statistics.median(r["peak_mb"] for r in rs),
                    "pad": 1 - sum(r0["tokens"]) / sum(r0["slots"]), "threads": r0["threads"],
                    "workers": r0["workers"], "loss_diff": diff, "correct": diff <= tol, "rounds": len(rs)}
    best = max((v for v in variants if stats[v]["correct"]), key=lambda v: stats[v]["tokens_per_s"])
    best_cpu = max((v for v in variants if stats[v]["correct"]), key=lambda v: stats[v]["tokens_per_cpu_s"])
    r0 = runs["flat"][0]
    n_pairs = len(r0["losses"])
    head = (f"DPO step (fetch + reference pass + policy fwd/bwd + AdamW on LoRA r={args.lora_r}), {r0['steps']} steps "
            f"of {args.rows} rows x {args.seq_len} ({n_pairs} pairs, {n_pairs / r0['steps']:.1f} a step), "
            f"model h={args.hidden} L={args.layers} V={args.vocab}, {args.precision}, {r0['device']} "
            f"({r0['device_name']}), tokens/s over steps {args.warmup + 1}-{r0['steps']}, median of "
            f"{stats['flat']['rounds']} rounds, fresh process each")
    cols = f"{'variant':<18} {'threads':>7} {'workers':>7} {'pad %':>6} {'first s':>8} {'step s':>7} " \
           f"{'real tok/s':>11} {'vs ' + best:>14} {'cores':>6} {'1st CPU s':>9} {'CPU s':>6} {'tok/CPU-s':>10} " \
           f"{'vs ' + best_cpu:>14} {'peak MB':>8}  check"
    lines = [head, cols]
    for v in variants:
        s = stats[v]
        lines.append(f"{v:<18} {s['threads']:>7} {s['workers']:>7} {100 * s['pad']:>6.1f} {s['first_s']:>8.2f} "
                     f"{s['later_s']:>7.2f} {s['tokens_per_s']:>11.1f} {s['tokens_per_s'] / stats[best]['tokens_per_s']:>14.2f} "
                     f"{s['cores']:>6.2f} {s['first_cpu_s']:>9.2f} {s['later_cpu_s']:>6.2f} {s['tokens_per_cpu_s']:>10.1f} "
                     f"{s['tokens_per_cpu_s'] / stats[best_cpu]['tokens_per_cpu_s']:>14.2f} {s['peak_mb']:>8.1f}  {'ok' if s['correct'] else 'WRONG'} "
                     f"(max |loss - flat| {s['loss_diff']:.1e})")
    print("\n".join(lines))
    for v in variants:
        summary(f"dpo {v}: {stats[v]['tokens_per_s']:.0f} tok/s ({stats[v]['tokens_per_s'] / stats[best]['tokens_per_s']:.2f}x "
                f"{best}), peak {stats[v]['peak_mb']:.0f} MB, {'ok' if stats[v]['correct'] else 'WRONG'}")
    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["date", "device", "device_name", "torch", "ftlib", "precision", "hidden", "layers", "vocab",
                            "pairs", "rows", "seq_len", "steps", "variant", "threads", "workers", "pad_fraction",
                            "first_steps_s", "step_s_median", "tokens_per_s", "tokens_per_s_ratio", "cores_busy", "first_steps_cpu_s", "step_cpu_s_median",
                            "tokens_per_cpu_s", "tokens_per_cpu_s_ratio",
                            "peak_mb", "loss_max_diff", "correct", "reference_variant", "rounds"])
            now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
            for v in variants:
                s = stats[v]
                w.writerow([now, r0["device"], r0["device_name"], torch.__version__, ftlib.__version__, args.precision,
                            args.hidden, args.layers, args.vocab, args.pairs, args.rows, args.seq_len, r0["steps"], v,
                            s["threads"], s["workers"], f"{s['pad']:.4f}", f"{s['first_s']:.3f}", f"{s['later_s']:.3f}",
                            f"{s['tokens_per_s']:.1f}", f"{s['tokens_per_s'] / stats[best]['tokens_per_s']:.3f}",
                            f"{s['cores']:.2f}", f"{s['first_cpu_s']:.3f}", f"{s['later_cpu_s']:.3f}",
                            f"{s['tokens_per_cpu_s']:.1f}",
                            f"{s['tokens_per_cpu_s'] / stats[best_cpu]['tokens_per_cpu_s']:.3f}", f"{s['peak_mb']:.1f}", f"{s['loss_diff']:.2e}", s["correct"], best,
                            s["rounds"]])


if __name__ == "__main__":
    main()
