"""DPO step: padded pairs vs ftlib's packed pairs, same pairs, same model: real tokens/s and peak memory.

One DPO step on a micro-batch = the reference pass (no grad, LoRA adapters disabled) + the policy
forward and backward + an AdamW step on the adapters, sigmoid loss. Every variant processes the same
N synthetic pairs (prompt and response lengths log-normal, clipped to --max-length per side):

  padded          the common layout: P pairs per micro-batch (random order), 2P rows (chosen, then
                  rejected) right-padded to the longest; ftlib's chunked sequence log-probs
  padded_grouped  the same, with length-grouped micro-batches (Hugging Face's mega-batch sort): the
                  strongest padded configuration, and the ratio reference
  padded_fulllogits  the padded layout with the usual full-logits log_softmax + gather ([2P, L, V]
                  logits in memory): the common implementation, shown for its memory
  packed          ftlib: both sides of each pair in the same row (cu_seqlens segments), rows of
                  --seq-len (default 2 x --max-length) filled by best-fit decreasing, as many rows
                  per micro-batch as hold ~P pairs on average; chunked log-probs

Real tokens are the tokens of the 2N sequences (prompt counted once per side); padding is not
counted. Throughput = real tokens / seconds for one pass over the N pairs; passes are alternated
between variants (A B C D A B C D ...) and the median pass is reported. Peak memory: on CUDA the
max allocated during a pass; on CPU the profiler's allocator peak during the variant's largest
micro-batch. The optimizer runs with lr 0 (its cost is in the step, the weights never change), so the
per-pair losses of the first pass of every variant are checked against packed's (a variant that
disagrees is marked WRONG in the table).

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
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ftlib  # noqa: E402
from ftlib.data.collate import length_grouped_batches  # noqa: E402
from ftlib.data.pair_batches import PairLoader, collate_pairs_padded  # noqa: E402
from ftlib.lora import LoRAConfig, apply_lora, disable_adapters, trainable_params  # noqa: E402
from ftlib.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from ftlib.preference import PairLogps, PreferenceLoss, pair_logps, reference_pair_logps  # noqa: E402

VARIANTS = ["padded", "padded_grouped", "padded_fulllogits", "packed"]
PRESETS = {
    "cpu": dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=344, vocab=8192, pairs=24,
                pairs_per_batch=4, max_length=256, prompt_median=60, response_median=70, precision="fp32"),
    # Llama-3.2-1B's widths with 8 of its 16 layers (the logits, what padding and full logits cost, are whole)
    "gpu": dict(hidden=2048, layers=8, heads=32, kv_heads=8, intermediate=8192, vocab=128256, pairs=64,
                pairs_per_batch=4, max_length=2048, prompt_median=300, response_median=350, precision="bf16"),
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


def full_logits_pair_logps(model, batch) -> PairLogps:
    """The usual implementation: logits [2P, L, V], log_softmax, gather the labels."""
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])[:, :-1].float()
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask
    s, n = lp.sum(1), mask.sum(1)
    ci, ri = batch["chosen_index"], batch["rejected_index"]
    return PairLogps(s[ci], s[ri], n[ci], n[ri])


def micro_batches(variant, pairs, args, pad_id=0):
    P = args.pairs_per_batch
    n = len(pairs)
    rng = np.random.default_rng(args.seed)
    if variant == "packed":
        probe = PairLoader(pairs, batch_size=1, pad_id=pad_id, seq_len=args.seq_len, shuffle=False, drop_last=False)
        rows = max(1, round(P * probe.plan.n_rows / n))  # rows holding ~P pairs on average
        loader = PairLoader(pairs, batch_size=rows, pad_id=pad_id, seq_len=args.seq_len, seed=args.seed, drop_last=False)
        return list(loader), loader.pack_stats
    if variant == "padded_grouped":
        groups = length_grouped_batches(np.maximum(*pairs.side_lengths), P, rng)
    else:
        order = rng.permutation(n)
        groups = [order[i : i + P] for i in range(0, n, P)]
    return [collate_pairs_padded(pairs, g, pad_id) for g in groups], None


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


def _peak_cpu_bytes(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return max((e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"), default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: gpu on CUDA, else cpu")
    for k in PRESETS["cpu"]:
        ap.add_argument("--" + k.replace("_", "-"), type=str if k == "precision" else int, default=None)
    ap.add_argument("--seq-len", type=int, default=None, help="packed row length (default 2 x --max-length)")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per variant (alternated)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="stop starting passes after this many seconds")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", default=None, help="append result rows to this CSV file")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = PRESETS[args.preset or ("gpu" if device == "cuda" else "cpu")]
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.seq_len = args.seq_len or 2 * args.max_length
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    if "packed" not in variants or set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants must include packed and come from {VARIANTS}")
    t_start = time.monotonic()

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=max(4096, args.seq_len))
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    apply_lora(model, LoRAConfig(r=args.lora_r, alpha=2 * args.lora_r, target_modules="all-linear"), verbose=False)
    model.to(device)
    # lr 0: the step's full cost, weights unchanged, so every pass of every variant sees the same model and
    # the per-pair losses of the first pass check the variants against each other
    opt = torch.optim.AdamW(trainable_params(model).values(), lr=0.0)
    autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if args.precision == "bf16" else \
        (lambda: torch.autocast(device, enabled=False))
    loss_fn = PreferenceLoss("sigmoid", beta=0.1)
    pairs = SyntheticPairs(args.pairs, args.max_length, args.prompt_median, args.response_median, args.vocab, args.seed)
    sc, sr = pairs.side_lengths
    real_tokens = int((sc + sr).sum())
    to_dev = lambda b: {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in b.items()}
    batches, stats = {}, {}
    for v in variants:
        mbs, pstats = micro_batches(v, pairs, args)
        batches[v] = [to_dev(b) for b in mbs]
        slots = sum(b["input_ids"].numel() for b in mbs)
        stats[v] = {"micro_batches": len(mbs), "slots": slots, "pad_fraction": 1 - real_tokens / slots,
                    "pack": pstats}

    with torch.no_grad():  # adapters at init leave policy == reference: perturb B so the losses differ
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)

    # peak memory
    for v in variants:
        largest = max(batches[v], key=lambda b: b["input_ids"].numel())
        dpo_step(model, opt, largest, v, loss_fn, autocast)  # warm-up
        print(f"peak memory: {v}", flush=True)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            dpo_step(model, opt, largest, v, loss_fn, autocast)
            torch.cuda.synchronize()
            stats[v]["peak_mb"] = (torch.cuda.max_memory_allocated() - before) / 2**20
        else:
            stats[v]["peak_mb"] = _peak_cpu_bytes(lambda b=largest, v=v: dpo_step(model, opt, b, v, loss_fn, autocast)) / 2**20

    # throughput: whole passes over the N pairs, alternated between variants; pass 1 also checks the losses
    times = {v: [] for v in variants}
    losses = {v: np.full(len(pairs), np.nan) for v in variants}
    for rep in range(args.repeats):
        if rep and args.budget_s and time.monotonic() - t_start > args.budget_s:
            print(f"time budget reached after {rep} passes per variant")
            break
        for v in variants:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for b in batches[v]:
                out = dpo_step(model, opt, b, v, loss_fn, autocast)
                if rep == 0:
                    losses[v][b["pair_ids"].cpu().numpy()] = out.float().cpu().numpy()
            if device == "cuda":
                torch.cuda.synchronize()
            times[v].append(time.perf_counter() - t0)
        print(f"pass {rep + 1}: " + ", ".join(f"{v} {times[v][-1]:.2f} s" for v in variants), flush=True)
    tol = 1e-4 if args.precision == "fp32" else 2e-2
    for v in variants:
        stats[v]["loss_diff"] = float(np.abs(losses[v] - losses["packed"]).max())
        stats[v]["correct"] = stats[v]["loss_diff"] <= tol

    ref_v = "padded_grouped" if "padded_grouped" in variants else variants[0]
    for v in variants:
        s = stats[v]
        s["seconds"] = statistics.median(times[v])
        s["tokens_per_s"] = real_tokens / s["seconds"]
    dev_name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
    print(f"DPO step (reference pass + policy fwd/bwd + AdamW on LoRA r={args.lora_r}), {args.pairs} pairs, "
          f"{real_tokens} real tokens, model h={args.hidden} L={args.layers} V={args.vocab}, {args.precision}, "
          f"{device} ({dev_name}, {torch.get_num_threads()} threads), median of {len(times[variants[0]])} passes")
    print(f"{'variant':<18} {'mbs':>4} {'pad %':>6} {'s/pass':>8} {'real tok/s':>11} {'vs ' + ref_v:>18} "
          f"{'peak MB':>9} {'vs ' + ref_v:>18}  check")
    base = stats[ref_v]
    for v in variants:
        s = stats[v]
        print(f"{v:<18} {s['micro_batches']:>4} {100 * s['pad_fraction']:>6.1f} {s['seconds']:>8.2f} "
              f"{s['tokens_per_s']:>11.1f} {s['tokens_per_s'] / base['tokens_per_s']:>18.2f} {s['peak_mb']:>9.1f} "
              f"{s['peak_mb'] / base['peak_mb']:>18.2f}  "
              f"{'ok' if s['correct'] else 'WRONG'} (max |loss - packed| {s['loss_diff']:.1e})")
    if stats["packed"]["pack"] is not None:
        print(f"packed rows: {stats['packed']['pack']}")
    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["date", "device", "device_name", "threads", "torch", "ftlib", "precision", "hidden", "layers",
                            "vocab", "pairs", "pairs_per_batch", "max_length", "seq_len", "real_tokens", "variant",
                            "micro_batches", "pad_fraction", "seconds_median", "tokens_per_s", "tokens_per_s_ratio",
                            "peak_mb", "peak_ratio", "loss_max_diff", "correct", "reference_variant"])
            now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
            for v in variants:
                s = stats[v]
                w.writerow([now, device, dev_name, torch.get_num_threads(), torch.__version__, ftlib.__version__,
                            args.precision, args.hidden, args.layers, args.vocab, args.pairs, args.pairs_per_batch,
                            args.max_length, args.seq_len, real_tokens, v, s["micro_batches"], f"{s['pad_fraction']:.4f}",
                            f"{s['seconds']:.3f}", f"{s['tokens_per_s']:.1f}",
                            f"{s['tokens_per_s'] / base['tokens_per_s']:.3f}", f"{s['peak_mb']:.1f}",
                            f"{s['peak_mb'] / base['peak_mb']:.3f}", f"{s['loss_diff']:.2e}", s["correct"], ref_v])


if __name__ == "__main__":
    main()
