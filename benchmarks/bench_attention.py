"""Attention throughput: ftlib's Triton kernel vs torch SDPA vs flash-attn, in one run.

Measures forward, backward and forward+backward TFLOP/s over sequence lengths (512..16k), head
dims (64, 128), causal and not, dense [B, T, H, D] and packed varlen batches, bf16, GQA 32/8
heads (Llama-3-8B's attention shape). Each case holds a fixed number of tokens (--tokens), so a
longer sequence means a smaller batch.

FLOPs are the useful ones, the flash-attn convention: forward 4 * T^2 * D per (document, query
head) (QK^T and PV), halved when causal; backward 2.5x forward; forward+backward 3.5x. In the
packed case T^2 is summed over the documents: a kernel that ignores document boundaries or pads
them does more work for the same count.

Providers: ``ftlib`` (attention_triton, dense and varlen), ``sdpa``
(F.scaled_dot_product_attention with K/V repeated for GQA; for packed batches it runs the
documents padded to the pack's longest one, the cost of not having varlen) and ``flash`` (flash_attn_func /
flash_attn_varlen_func, when installed). Ratios vs SDPA are printed; rows are appended to the CSV
given by --out with device, versions and date. Exits with a message when CUDA is absent.

Usage: python benchmarks/bench_attention.py [--out benchmarks/results/attention.csv] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.util
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _summary import summary  # noqa: E402

FIELDS = [
    "date", "device", "torch", "triton", "flash_attn", "provider", "layout", "causal", "seqlen",
    "head_dim", "hq", "hkv", "tokens", "mode", "ms", "tflops", "vs_sdpa",
]


def _versions():
    import triton

    flash = "-"
    if importlib.util.find_spec("flash_attn") is not None:
        import flash_attn

        flash = flash_attn.__version__
    return {"torch": torch.__version__, "triton": triton.__version__, "flash_attn": flash}


def _doc_lengths(tokens: int, max_len: int, rng: random.Random) -> list[int]:
    # Documents uniform in [max_len / 8, max_len], packed until `tokens`; the last is cut to fit.
    lens, left = [], tokens
    while left > 0:
        n = min(left, rng.randint(max(1, max_len // 8), max_len))
        lens.append(n)
        left -= n
    return lens


def _fwd_flops(lens, hq, d, causal):
    return sum(4.0 * n * n * d * hq for n in lens) / (2.0 if causal else 1.0)


def _providers(layout, lens, hq, hkv, d, causal, device):
    """{name: (inputs [q, k, v] requiring grad, forward closure)} for one case."""
    from ftlib.kernels.attention_triton import attention_triton

    dt = torch.bfloat16
    t = max(lens)
    out = {}
    if layout == "dense":
        b = len(lens)
        q = torch.randn(b, t, hq, d, device=device, dtype=dt)
        k = torch.randn(b, t, hkv, d, device=device, dtype=dt)
        v = torch.randn(b, t, hkv, d, device=device, dtype=dt)
    else:
        n = sum(lens)
        q = torch.randn(n, hq, d, device=device, dtype=dt)
        k = torch.randn(n, hkv, d, device=device, dtype=dt)
        v = torch.randn(n, hkv, d, device=device, dtype=dt)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)

    def leaves(*ts):
        return [x.detach().clone().requires_grad_() for x in ts]

    a = leaves(q, k, v)
    if layout == "dense":
        out["ftlib"] = (a, lambda a=a: attention_triton(*a, causal=causal))
    else:
        out["ftlib"] = (a, lambda a=a: attention_triton(*a, causal=causal, cu_seqlens=cu, max_seqlen=t))

    # SDPA wants (B, H, T, D); packed documents are padded to the longest (no varlen in SDPA).
    # GQA: K/V are repeated for SDPA outside the timed region, so SDPA's flash backend runs.
    kr, vr = k.repeat_interleave(hq // hkv, dim=-2), v.repeat_interleave(hq // hkv, dim=-2)
    if layout == "dense":
        sq, sk, sv = (x.transpose(1, 2) for x in (q, kr, vr))
    else:
        pads = [torch.nn.functional.pad(x[s:e], (0, 0, 0, 0, 0, t - (e - s))) for x in (q, kr, vr)
                for s, e in zip(cu.tolist(), cu.tolist()[1:])]
        nd = len(lens)
        sq, sk, sv = (torch.stack(pads[i * nd:(i + 1) * nd]).transpose(1, 2) for i in range(3))
    s_leaves = leaves(sq.contiguous(), sk.contiguous(), sv.contiguous())
    out["sdpa"] = (s_leaves, lambda a=s_leaves: F.scaled_dot_product_attention(*a, is_causal=causal))

    if importlib.util.find_spec("flash_attn") is not None:
        from flash_attn import flash_attn_func, flash_attn_varlen_func

        f = leaves(q, k, v)
        if layout == "dense":
            out["flash"] = (f, lambda a=f: flash_attn_func(*a, causal=causal))
        else:
            out["flash"] = (f, lambda a=f: flash_attn_varlen_func(*a, cu, cu, t, t, causal=causal))
    return out


def _time(inputs, fwd, mode):
    """Median milliseconds of one forward, one backward (graph kept), or one forward+backward."""
    from triton.testing import do_bench

    if mode == "fwd":
        with torch.no_grad():
            return do_bench(fwd, warmup=10, rep=40, return_mode="median")
    out = fwd()
    grad = torch.randn_like(out)
    if mode == "bwd":
        step = lambda: out.backward(grad, retain_graph=True)
    else:
        step = lambda: fwd().backward(grad)
    return do_bench(step, warmup=10, rep=40, grad_to_none=inputs, return_mode="median")


def _warm(provs, label):
    """One untimed forward+backward per provider: Triton compiles and autotunes here, not inside
    do_bench's run-time estimate (which would then schedule a single repetition). A provider that
    fails here is reported and dropped from the case; the others still run."""
    for name in list(provs):
        inputs, fwd = provs[name]
        try:
            o = fwd()
            o.backward(torch.ones_like(o))
            for x in inputs:
                x.grad = None
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a compile error or OOM in one provider is that provider's
            print(f"  {name} {label} warm-up: {type(e).__name__}: {str(e)[:160]}", flush=True)
            del provs[name]
            torch.cuda.empty_cache()


def _fmt(x):
    return f"{x:12.1f}" if x is not None else f"{'-':>12}"


def _ratio(a, b):
    return f"{a / b:12.2f}" if a and b else f"{'-':>12}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/attention.csv", help="CSV to append rows to")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--head-dims", default="128,64")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per case (batch = tokens / seqlen)")
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="seqlens 1024,4096 and head dim 128 only")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no new case after this many seconds (0: no limit); skipped cases are listed")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device; this benchmark measures GPU kernels, nothing to do.")
        return 0
    if importlib.util.find_spec("triton") is None:
        print("bench_attention: triton is not installed; nothing to measure.")
        return 0
    seqlens = [1024, 4096] if args.quick else [int(x) for x in args.seqlens.split(",")]
    head_dims = [128] if args.quick else [int(x) for x in args.head_dims.split(",")]
    device = torch.device("cuda")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), **_versions()}
    print(f"# {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  flash-attn {meta['flash_attn']}"
          f"  bf16  Hq={args.hq} Hkv={args.hkv}  tokens/case={args.tokens}")
    print(f"{'layout':7} {'causal':6} {'T':>6} {'D':>4} {'mode':8} " + " ".join(
        f"{n:>12}" for n in ("ftlib TF/s", "sdpa TF/s", "flash TF/s", "ftlib/sdpa", "ftlib/flash")), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    new = not os.path.exists(args.out)
    fh = open(args.out, "a", newline="")
    writer = csv.DictWriter(fh, fieldnames=FIELDS)
    if new:
        writer.writeheader()
    # Head dim 128, causal, packed (varlen), T = 4096 first: the case that matters most for Llama-class
    # fine-tuning (the headline a --budget-s 1 run measures), then the rest in the listed order.
    cases = [(d, causal, layout, t) for d in head_dims for causal in (True, False)
             for layout in ("packed", "dense") for t in seqlens]
    cases.sort(key=lambda c: (c[0] != 128, not c[1], c[2] != "packed", c[3] != 4096))
    t0, n_rows, skipped = time.monotonic(), 0, []
    for d, causal, layout, t in cases:
        if args.budget_s and time.monotonic() - t0 > args.budget_s:
            skipped.append(f"{layout}/causal={causal}/T={t}/D={d}")
            continue
        tokens = max(args.tokens, t)
        lens = [t] * (tokens // t) if layout == "dense" else _doc_lengths(tokens, t, random.Random(t))
        label = f"{layout} causal={causal} T={t} D={d}"
        try:
            provs = _providers(layout, lens, args.hq, args.hkv, d, causal, device)
        except Exception as e:  # noqa: BLE001 - the case's inputs (OOM) or an import: this case only
            print(f"  {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            torch.cuda.empty_cache()
            continue
        _warm(provs, label)
        fwd_flops = _fwd_flops(lens, args.hq, d, causal)
        for mode, mult in (("fwd", 1.0), ("bwd", 2.5), ("fwd+bwd", 3.5)):
            res = {}
            for name, (inputs, fwd) in provs.items():
                try:
                    ms = _time(inputs, fwd, mode)
                except Exception as e:  # noqa: BLE001 - any provider failure (OOM, a compile error) is reported; the rest run
                    print(f"  {name} {layout} T={t} D={d} {mode}: {type(e).__name__}: {str(e)[:120]}")
                    torch.cuda.empty_cache()
                    continue
                res[name] = mult * fwd_flops / (ms * 1e-3) / 1e12, ms
            base = res["sdpa"][0] if "sdpa" in res else None
            for name, (tf, ms) in res.items():
                writer.writerow({**meta, "provider": name, "layout": layout, "causal": causal, "seqlen": t,
                                 "head_dim": d, "hq": args.hq, "hkv": args.hkv, "tokens": sum(lens),
                                 "mode": mode, "ms": f"{ms:.4f}", "tflops": f"{tf:.1f}",
                                 "vs_sdpa": f"{tf / base:.3f}" if base else ""})
                n_rows += 1
            fh.flush()
            tf = {n: r[0] for n, r in res.items()}
            if d == 128 and causal and t == 4096:  # the headline cases: one summary line each
                summary(f"attention d{d} causal {layout} T={t} GQA {args.hq}:{args.hkv} {mode}: ftlib "
                        f"{tf.get('ftlib', float('nan')):.0f} TFLOP/s, sdpa {tf.get('sdpa', float('nan')):.0f}"
                        + (f" ({tf['ftlib'] / tf['sdpa']:.2f}x)" if 'ftlib' in tf and 'sdpa' in tf else ""))
            print(f"{layout:7} {causal!s:6} {t:>6} {d:>4} {mode:8} {_fmt(tf.get('ftlib'))} {_fmt(tf.get('sdpa'))} "
                  f"{_fmt(tf.get('flash'))} {_ratio(tf.get('ftlib'), tf.get('sdpa'))} "
                  f"{_ratio(tf.get('ftlib'), tf.get('flash'))}", flush=True)
        del provs
        torch.cuda.empty_cache()
    fh.close()
    if skipped:
        print(f"time budget reached; skipped {len(skipped)} cases: {', '.join(skipped)}")
    print(f"appended {n_rows} rows to {args.out} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
