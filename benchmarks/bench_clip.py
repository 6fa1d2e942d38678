"""Cost of ftlib's gradient clippers against torch.nn.utils.clip_grad_norm_ (foreach) in one run.

The parameter list mimics a decoder's shapes (square and MLP matrices plus norm vectors), about
100M parameters by default. Each method is timed on fresh gradients (a copy is restored before
every call, outside the timed region; methods alternate round-robin); the table shows the median time and the ratio to
clip_grad_norm_. Rows are appended to a CSV with device, versions and date.

    python benchmarks/bench_clip.py --out benchmarks/results/clip.csv
"""

import argparse
import csv
import datetime
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import ftlib
from ftlib.clip import AGCClipper, GlobalNormClipper, PerLayerClipper, ZScoreClipper


def make_params(total: int, hidden: int, device: str) -> list[tuple[str, nn.Parameter]]:
    """Layers of [h, h] x 4 (attention), [3h, h] x 3 (MLP) and two [h] norms, until ~total elements."""
    g = torch.Generator().manual_seed(0)
    named, count, layer = [], 0, 0
    shapes = [("q", (hidden, hidden)), ("k", (hidden, hidden)), ("v", (hidden, hidden)), ("o", (hidden, hidden)),
              ("gate", (3 * hidden, hidden)), ("up", (3 * hidden, hidden)), ("down", (hidden, 3 * hidden)),
              ("norm1", (hidden,)), ("norm2", (hidden,))]
    while count < total:
        for name, shape in shapes:
            p = nn.Parameter(torch.randn(shape, generator=g).to(device) * 0.02)
            p.grad = torch.randn(shape, generator=g).to(device)
            named.append((f"layers.{layer}.{name}", p))
            count += p.numel()
        layer += 1
    return named


def timed(methods: dict, named, grads, repeats: int, device: str) -> dict[str, float]:
    """Median seconds per method. Methods run round-robin, so load drift on a shared machine hits
    all of them alike; fresh gradients are restored (untimed) before every call."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(repeats + 1):  # round 0 warms up
        for name, fn in methods.items():
            for (_, p), g in zip(named, grads):
                p.grad.copy_(g)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            if r:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=100_000_000, help="parameters in the list")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/clip.csv"))
    args = ap.parse_args()

    named = make_params(args.numel, args.hidden, args.device)
    params = [p for _, p in named]
    grads = [p.grad.clone() for p in params]
    numel = sum(p.numel() for p in params)
    zscore = ZScoreClipper(z=2.0, warmup=0)
    zscore(named)  # seed the EMA: the timed calls take the post-warm-up path
    methods = {
        "torch.clip_grad_norm_(foreach)": lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True),
        "ftlib.GlobalNormClipper": lambda: GlobalNormClipper(1.0)(named),
        "ftlib.ZScoreClipper": lambda: zscore(named),
        "ftlib.PerLayerClipper": lambda: PerLayerClipper([(r"\.(q|k|v|o)$", 0.5)], default=1.0)(named),
        "ftlib.AGCClipper": lambda: AGCClipper(0.01)(named),
    }
    results = timed(methods, named, grads, args.repeats, args.device)
    base = results["torch.clip_grad_norm_(foreach)"]

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or platform.machine())
    threads = torch.get_num_threads()
    print(f"{numel / 1e6:.1f}M parameters in {len(params)} tensors, {args.device} ({device_name}, {threads} threads)")
    print(f"{'method':34s} {'median ms':>10s} {'vs torch':>9s}")
    for name, t in results.items():
        print(f"{name:34s} {t * 1e3:10.1f} {t / base:9.2f}x")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    new = not args.out.exists()
    with open(args.out, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["date", "device", "device_name", "threads", "torch", "ftlib", "numel", "method",
                        "median_ms", "ratio_vs_torch"])
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        for name, t in results.items():
            w.writerow([date, args.device, device_name, threads, torch.__version__, ftlib.__version__, numel, name,
                        f"{t * 1e3:.3f}", f"{t / base:.3f}"])
        f.flush()
        os.fsync(f.fileno())
    print(f"appended {len(results)} rows to {args.out}")


if __name__ == "__main__":
    main()
