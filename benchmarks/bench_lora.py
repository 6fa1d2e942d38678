"""LoRA vs DoRA forward+backward: time ratio and peak memory on one large linear layer.

Variants (same weights, same input, one training step = forward + backward of sum(y^2), with
gradients for the adapter and for the input, as for a layer inside a network):
  lora          ftlib LoRALinear
  dora          ftlib LoRALinear(use_dora=True): norm from W A^T, no out x in temporary
  dora_peft     DoRA as PEFT computes it: materialises B A and W + s B A each step
  dora_paper    the paper's formula taken literally: y = x ((m / ||W + sBA||) (W + sBA))^T,
                autograd through the full adapted weight
  peft_lora / peft_dora   peft's own layers, when peft is installed

Peak memory is the peak of bytes allocated by torch during one step beyond what existed
before it (weights, input): from the profiler's allocator events on CPU,
torch.cuda.max_memory_allocated on GPU.
Variants are timed round-robin (one step of each in turn, --iters rounds) after a warm-up.
Times are the median and the minimum (the minimum is
the steadier number on a shared machine); ratios are to lora's median / minimum.

    python benchmarks/bench_lora.py --csv benchmarks/results/lora.csv
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

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ftlib  # noqa: E402
from ftlib.lora import LoRALinear  # noqa: E402

VARIANTS = ["lora", "dora", "dora_peft", "dora_paper", "peft_lora", "peft_dora"]


class NaiveDoRA(nn.Module):
    """DoRA with the adapted weight materialised (``peft`` style or the paper's literal formula)."""

    def __init__(self, layer: LoRALinear, literal: bool):
        super().__init__()
        self.layer, self.literal = layer, literal

    def forward(self, x):
        L = self.layer
        w = L.base_layer.weight
        delta = L.scaling * (L.lora_B.weight @ L.lora_A.weight)  # (out, in)
        norm = torch.linalg.vector_norm(w + delta.detach(), dim=1).detach()  # (out,) from an out x in temporary
        scale = L.lora_magnitude_vector / norm
        if self.literal:
            return F.linear(x, scale.view(-1, 1) * (w + delta), L.base_layer.bias)
        base = F.linear(x, w)
        lora = L.lora_B(L.lora_A(x)) * L.scaling
        return base + L.base_layer.bias + (scale - 1) * base + scale * lora


def _build(variant: str, n_in: int, n_out: int, r: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    base = nn.Linear(n_in, n_out, device=device)
    if variant.startswith("peft"):
        import peft

        model = nn.Sequential()
        model.add_module("proj", base)
        cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["proj"], use_dora=variant == "peft_dora",
                              init_lora_weights=False)
        return peft.get_peft_model(model, cfg)
    layer = LoRALinear(base, r, 2 * r, use_dora=variant != "lora")
    with torch.no_grad():
        layer.lora_B.weight.normal_(0, 0.01)
    if variant in ("dora_peft", "dora_paper"):
        return NaiveDoRA(layer, literal=variant == "dora_paper")
    return layer


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_step_bytes(step, device: str) -> int:
    """Peak bytes allocated by torch during one call of ``step`` (beyond what existed before)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    # CPU: the profiler's allocator events carry the running total of bytes allocated in the window
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as d:
        trace = os.path.join(d, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(totals, default=0)


def run_all(variants: list[str], args) -> list[dict]:
    """Build every variant, then time them round-robin so machine noise hits all alike."""
    device = args.device
    # the input requires grad, as inside a network: backward also computes dL/dx through the frozen base
    x = torch.randn(args.tokens, args.n_in, device=device, requires_grad=True)
    steps = {}
    for v in variants:
        model = _build(v, args.n_in, args.n_out, args.r, device)

        def step(model=model):
            model(x).pow(2).sum().backward()
            x.grad = None
            for p in model.parameters():
                p.grad = None

        step()  # warm-up
        steps[v] = step
    peaks = {v: _peak_step_bytes(step, device) for v, step in steps.items()}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.iters):
        for v, step in steps.items():
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times[v].append(time.perf_counter() - t0)
    return [{"variant": v, "ms": 1000 * statistics.median(times[v]), "ms_min": 1000 * min(times[v]),
             "peak_mb": peaks[v] / 2**20} for v in variants]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-in", type=int, default=4096)
    ap.add_argument("--n-out", type=int, default=4096)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads (0: torch's default); 1 avoids OpenMP stalls on a busy machine")
    ap.add_argument("--csv", default=None, help="append result rows to this CSV file")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    try:
        import peft  # noqa: F401
        have_peft = True
    except ImportError:
        have_peft = False
    variants = [v for v in args.variants.split(",") if have_peft or not v.startswith("peft")]
    unknown = set(variants) - set(VARIANTS)
    if unknown or "lora" not in variants:
        raise SystemExit(f"--variants must include lora and come from {VARIANTS}, got {args.variants}")
    rows = run_all(variants, args)
    base_ms = next(r["ms"] for r in rows if r["variant"] == "lora")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or platform.machine())
    print(f"LoRA vs DoRA, {args.n_out}x{args.n_in} linear, r={args.r}, {args.tokens} tokens, fp32, "
          f"{args.device} ({device_name}, {torch.get_num_threads()} threads), forward+backward")
    base_min = next(r["ms_min"] for r in rows if r["variant"] == "lora")
    print(f"{'variant':<12} {'median ms':>10} {'vs lora':>8} {'min ms':>9} {'vs lora':>8} {'peak MB':>9}")
    for r in rows:
        print(f"{r['variant']:<12} {r['ms']:>10.1f} {r['ms'] / base_ms:>8.2f} {r['ms_min']:>9.1f} "
              f"{r['ms_min'] / base_min:>8.2f} {r['peak_mb']:>9.1f}")
    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["date", "device", "device_name", "threads", "torch", "ftlib", "n_in", "n_out", "r", "tokens",
                            "dtype", "variant", "ms_median", "ratio_vs_lora", "ms_min", "ratio_min_vs_lora", "peak_mb"])
            now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
            for r in rows:
                w.writerow([now, args.device, device_name, torch.get_num_threads(), torch.__version__, ftlib.__version__, args.n_in, args.n_out,
                            args.r, args.tokens, "float32", r["variant"], f"{r['ms']:.2f}",
                            f"{r['ms'] / base_ms:.3f}", f"{r['ms_min']:.2f}", f"{r['ms_min'] / base_min:.3f}",
                            f"{r['peak_mb']:.1f}"])


if __name__ == "__main__":
    main()
