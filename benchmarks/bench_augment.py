"""Token augmentation throughput: the Triton kernel vs the PyTorch reference, against copy bandwidth.

The operation (ftlib.kernels.augment_tokens) is memory-bound: per token it streams the id and the label
in and the new id out (24 B/token with labels kept; 32 B/token when labels follow the new
tokens; + 8 B for an int64 attention_mask), and gathers from tables that stay in L2. So the
figure of merit is GB/s as a fraction of the device's measured copy bandwidth (a
device-to-device ``copy_`` of 1 GiB: read + write bytes / time), next to tokens/s.

Providers, in one run on the same inputs:

- ``triton``: the kernel (default block, plus a block/warps sweep at the largest size on GPU);
- ``torch``: the vectorised reference on the same device (the strongest correct baseline: the
  same function in PyTorch ops, ~200 element-wise launches for Philox);
- ``torch-cpu``: the reference on the host (sizes up to --cpu-max-tokens), against the host's copy
  bandwidth.

Every kernel result is compared with the reference bit for bit (column ``identical``). Tables
are Llama-3-sized: 128256 ids, 30k of them with 1-8 synonyms, 17 tags, 256 protected ids. Rows
are appended to the CSV given by --out with device, versions and date. Without CUDA only the
CPU reference is measured.

Usage: python benchmarks/bench_augment.py --out OUT.csv [--quick] [--budget-s 45]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import os
import statistics
import sys
import time

import torch

FIELDS = ["date", "device", "torch", "triton", "provider", "mode", "tokens", "block", "warps", "bytes_per_token",
          "ms", "tokens_per_s", "gb_s", "copy_gb_s", "frac_copy", "vs_torch", "identical"]
MODES = {  # name -> (follow labels + drop masked, attention mask, bytes per token streamed)
    "keep": (False, False, 24),
    "follow": (True, False, 32),
    "padded-keep": (False, True, 32),
}


def _tables(vocab: int, device, seed: int = 0):
    from ftlib.kernels.augment_ref import PROTECTED_TAG

    g = torch.Generator().manual_seed(seed)
    tags = torch.randint(1, 18, (vocab,), generator=g).to(torch.uint8)
    tags[torch.randperm(vocab, generator=g)[:min(256, vocab // 8)]] = PROTECTED_TAG
    n_syn = min(30000, vocab // 4)  # tokens with synonyms (30k of Llama-3's 128k)
    counts = torch.zeros(vocab, dtype=torch.int64)
    counts[torch.randperm(vocab, generator=g)[:n_syn]] = torch.randint(1, 9, (n_syn,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    owner = torch.repeat_interleave(torch.arange(vocab), counts)
    cands = (owner + torch.randint(1, vocab, owner.shape, generator=g)) % vocab  # never the token itself
    return tags.to(device), offsets.to(torch.int32).to(device), cands.to(torch.int32).to(device)


def _batch(n: int, vocab: int, padded: bool, device, seed: int = 1):
    g = torch.Generator(device=device).manual_seed(seed)
    rows = 8
    ids = torch.randint(0, vocab, (rows, n // rows), generator=g, device=device)
    labels = torch.where(torch.rand(ids.shape, generator=g, device=device) < 0.3, -100, ids)
    amask = (torch.rand(ids.shape, generator=g, device=device) < 0.9).long() if padded else None
    return ids, labels, amask


def _params(follow: bool):
    from ftlib.kernels.augment_ref import AugmentParams, probability_threshold

    return AugmentParams(seed=1234, step=5, swap_threshold=probability_threshold(0.1),
                         mask_threshold=probability_threshold(0.05), mask_tag_bits=0b1110, mask_token_id=3,
                         follow_labels=follow, drop_masked=follow)


def _copy_gbs(device) -> float:
    n = (1 << 30) // 8 if device.type == "cuda" else (1 << 27) // 8
    src = torch.empty(n, dtype=torch.int64, device=device).random_()
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src), device)
    return 2 * src.numel() * 8 / (ms * 1e-3) / 1e9


def _time(fn, device, reps: int = 7) -> float:
    """Median milliseconds: triton.testing.do_bench on CUDA, wall-clock medians on the host."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is b[1] or torch.equal(a[1], b[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="CSV to append rows to")
    p.add_argument("--tokens", default="65536,1048576,4194304,16777216,67108864",
                   help="batch sizes in tokens (B*T), comma-separated")
    p.add_argument("--cpu-max-tokens", type=int, default=1 << 20, help="largest size for the CPU reference")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--quick", action="store_true", help="sizes 1M and 16M tokens, keep and follow modes")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no new case after this many seconds (0: no limit); skipped cases are listed")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads for the host reference")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from ftlib.kernels.augment_ref import augment_tokens_ref

    cuda = torch.cuda.is_available()
    have_triton = False
    if cuda:
        try:
            from ftlib.kernels.augment_triton import DEFAULT_BLOCK, DEFAULT_WARPS, augment_tokens_triton

            have_triton = True
        except ImportError:
            print("bench_augment: triton is not installed; measuring the reference only")
    sizes = [1 << 20, 1 << 24] if args.quick else [int(x) for x in args.tokens.split(",")]
    modes = ["keep", "follow"] if args.quick else list(MODES)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "-"
    host = f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton_version}
    names = {"cuda": torch.cuda.get_device_name() if cuda else "", "cpu": host}
    devices = ([torch.device("cuda")] if cuda else []) + [torch.device("cpu")]
    copy = {d.type: _copy_gbs(d) for d in devices}
    print(f"# {' + '.join(names[d.type] for d in devices)}  torch {meta['torch']}  triton {meta['triton']}  "
          f"vocab {args.vocab}  copy bandwidth: " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in copy.items()))
    print(f"{'provider':10} {'mode':12} {'tokens':>10} {'blk/wrp':>7} {'ms':>9} {'tokens/s':>10} {'GB/s':>8} "
          f"{'of copy':>8} {'vs torch':>9} identical", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    new = not os.path.exists(args.out)
    fh = open(args.out, "a", newline="")
    writer = csv.DictWriter(fh, fieldnames=FIELDS)
    if new:
        writer.writeheader()
    tables = {d.type: _tables(args.vocab, d) for d in devices}
    t0, n_rows, skipped = time.monotonic(), 0, []

    def over_budget(case: str) -> bool:
        if args.budget_s and time.monotonic() - t0 > args.budget_s:
            skipped.append(case)
            return True
        return False

    def row(provider, mode, n, ms, dev, block="", warps="", vs=None, identical=""):
        nonlocal n_rows
        bpt = MODES[mode][2]
        gbs = n * bpt / (ms * 1e-3) / 1e9
        writer.writerow({**meta, "device": names[dev], "provider": provider, "mode": mode, "tokens": n,
                         "block": block, "warps": warps, "bytes_per_token": bpt, "ms": f"{ms:.4f}",
                         "tokens_per_s": f"{n / (ms * 1e-3):.4g}", "gb_s": f"{gbs:.1f}",
                         "copy_gb_s": f"{copy[dev]:.1f}", "frac_copy": f"{gbs / copy[dev]:.3f}",
                         "vs_torch": f"{vs:.2f}" if vs else "", "identical": identical})
        n_rows += 1
        fh.flush()
        cfg = f"{block}/{warps}" if block else ""
        print(f"{provider:10} {mode:12} {n:>10} {cfg:>7} {ms:>9.4f} {n / (ms * 1e-3):>10.3g} {gbs:>8.1f} "
              f"{gbs / copy[dev]:>8.3f} {(f'{vs:.2f}' if vs else '-'):>9} {identical}", flush=True)

    # 1. GPU: the kernel and the reference on the same inputs, every mode and size (largest first).
    if cuda:
        dev = torch.device("cuda")
        tb = tables["cuda"]
        for mode in modes:
            follow, padded, _ = MODES[mode]
            params = _params(follow)
            for n in sorted(sizes, reverse=True):
                if over_budget(f"cuda/{mode}/{n}"):
                    continue
                ids, labels, am = _batch(n, args.vocab, padded, dev)
                ref = augment_tokens_ref(ids, labels, am, *tb, params)
                ms_ref = _time(functools.partial(augment_tokens_ref, ids, labels, am, *tb, params), dev)
                row("torch", mode, n, ms_ref, "cuda")
                if have_triton:
                    ok = _same(augment_tokens_triton(ids, labels, am, *tb, params), ref)
                    ms = _time(functools.partial(augment_tokens_triton, ids, labels, am, *tb, params), dev)
                    row("triton", mode, n, ms, "cuda", DEFAULT_BLOCK, DEFAULT_WARPS, ms_ref / ms, "yes" if ok else "NO")
                del ref, ids, labels, am
                torch.cuda.empty_cache()
    # 2. GPU: block / warps sweep at the largest size (the result is the same for every configuration).
    if cuda and have_triton:
        n = max(sizes)
        ids, labels, am = _batch(n, args.vocab, False, dev)
        params = _params(False)
        ref = augment_tokens_triton(ids, labels, am, *tb, params)
        for block in (512, 1024, 2048, 4096):
            for warps in (4, 8):
                if over_budget(f"sweep/{block}/{warps}"):
                    continue
                fn = functools.partial(augment_tokens_triton, ids, labels, am, *tb, params, block=block,
                                       num_warps=warps)
                ok = _same(fn(), ref)
                row("triton", "keep", n, _time(fn, dev), "cuda", block, warps, identical="yes" if ok else "NO")
        del ids, labels, am, ref
    # 3. Host: the reference on the CPU.
    for mode in modes:
        follow, padded, _ = MODES[mode]
        params = _params(follow)
        for n in sorted(x for x in sizes if x <= args.cpu_max_tokens):
            if over_budget(f"cpu/{mode}/{n}"):
                continue
            ids, labels, am = _batch(n, args.vocab, padded, torch.device("cpu"))
            ms = _time(functools.partial(augment_tokens_ref, ids, labels, am, *tables["cpu"], params),
                       torch.device("cpu"), reps=5)
            row("torch-cpu", mode, n, ms, "cpu")
    fh.close()
    if skipped:
        print(f"time budget reached; skipped {len(skipped)} cases: {', '.join(skipped)}")
    print(f"appended {n_rows} rows to {args.out} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
