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

GPU part (``--kernels``): the fused LoRA matmul (ftlib.kernels.lora_matmul, dispatch in ftlib/kernels/lora.py) against the unfused
PyTorch composition and PEFT, on Llama-3-8B projection shapes (in x out = 4096 x 4096, 4096 x
14336, 14336 x 4096, 4096 x 1024), r in {16, 64}, 8192 tokens, a bf16 and an NF4 base (double
quantization), LoRA and DoRA, dropout 0.05 (--dropout), all under bf16 autocast with fp32 adapters
(the usual mixed-precision recipe). Providers, each a one-layer forward / backward / both:
  fused     LoRALinear with FTLIB_LORA_BACKEND=triton (the kernels; DoRA's norm included)
  unfused   LoRALinear with FTLIB_LORA_BACKEND=torch (base layer, dropout, two adapter GEMMs, adds;
            NF4: bitsandbytes' dequantization then cuBLAS) - the reference of the ratios
  peft      peft's LoRA layer on nn.Linear / bitsandbytes' Linear4bit, when installed
FLOPs are the useful ones: forward 2 M N K + 2 M r (K + N), backward 2 M N K + 4 M r (K + N) (dX,
v, v A, dA, dB; no dW); DoRA with dropout runs a second base GEMM that is not counted. TFLOP/s are
also given as a fraction of the device's bf16 peak measured in the same run (an 8192^3 cuBLAS
matmul). Cases run in priority order (4096 x 4096, r = 16 first); --budget-s stops starting new
ones and lists the skipped. Rows go to --out (benchmarks/results/lora_gpu.csv).

    python benchmarks/bench_lora.py --kernels --out benchmarks/results/lora_gpu.csv --budget-s 80

Host part (``--host-overhead``, no GPU needed): the Python cost of one fused LoRA call (forward +
backward through autograd: argument checks, the launch plan, allocations, grids, splits) with
the six Triton kernels replaced by stubs that only evaluate their grid, on small zero-filled CPU
tensors (1024 x 1024, 512 tokens unless given: the few torch ops the launcher runs itself, the
partial-sum reductions, then cost about what their dispatch costs), so nearly nothing but host
work is timed. The launcher accepts CPU tensors when TRITON_INTERPRET=1, which this part sets for
its own process (the K / N / token splits then assume 2 SMs, as in the tests). The median over
--iters x 50 calls per case, in microseconds.

    python benchmarks/bench_lora.py --host-overhead --iters 20
"""

from __future__ import annotations

import argparse
import copy
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _summary import summary  # noqa: E402

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


# ----------------------------------------------------------------------------------------------
# GPU part: fused vs unfused vs PEFT
# ----------------------------------------------------------------------------------------------

GPU_FIELDS = ["date", "device", "torch", "triton", "peft", "autotune", "n_in", "n_out", "r", "tokens", "base",
              "adapter", "dropout", "provider", "mode", "ms", "tflops", "frac_peak", "vs_unfused", "peak_mb",
              "measured_peak_tflops"]
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 1024)]


def _measured_peak() -> float:
    """TFLOP/s of an 8192^3 bf16 cuBLAS matmul: the device's practical dense peak."""
    from triton.testing import do_bench

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def _gpu_layers(n_in, n_out, r, base_kind, adapter, dropout, have_peft):
    """{provider: (module, backend or None)} sharing one set of weights."""
    torch.manual_seed(0)
    lin = nn.Linear(n_in, n_out, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    dora = adapter == "dora"
    if base_kind == "nf4":
        from ftlib.lora import NF4Linear

        base = NF4Linear.from_linear(lin, double_quant=True)
    else:
        base = lin
    layer = LoRALinear(base, r, 2 * r, dropout=dropout, use_dora=dora).train()
    with torch.no_grad():
        layer.lora_B.weight.normal_(0, 0.01)
    out = {"fused": (layer, "triton"), "unfused": (layer, "torch")}
    if have_peft:
        import peft

        try:
            if base_kind == "nf4":
                import bitsandbytes as bnb

                pbase = bnb.nn.Linear4bit(n_in, n_out, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                                          compress_statistics=True)
                pbase.weight = bnb.nn.Params4bit(lin.weight.detach().cpu(), requires_grad=False, quant_type="nf4",
                                                 compress_statistics=True)
                pbase = pbase.cuda()
            else:
                pbase = copy.deepcopy(lin)
            model = nn.Sequential()
            model.add_module("proj", pbase)
            cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=["proj"],
                                  use_dora=dora, init_lora_weights=False)
            pm = peft.get_peft_model(model, cfg).cuda()
            out["peft"] = (pm, None)
        except Exception as e:  # noqa: BLE001 - report and go on without this provider
            print(f"  peft {base_kind}/{adapter}: not measured ({type(e).__name__}: {str(e)[:100]})")
    return out


def _gpu_time(module, backend, x, mode):
    """(median ms, peak MB of one step) of forward / backward / forward+backward under bf16 autocast."""
    from triton.testing import do_bench

    def fwd():
        if backend is not None:
            os.environ["FTLIB_LORA_BACKEND"] = backend
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return module(x)

    params = [p for p in module.parameters() if p.requires_grad] + [x]
    grad = torch.randn(x.shape[0], fwd().shape[-1], device="cuda", dtype=torch.bfloat16)
    if mode == "fwd":
        step = lambda: fwd()
    elif mode == "bwd":
        out = fwd()
        step = lambda: out.backward(grad, retain_graph=True)
    else:
        step = lambda: fwd().backward(grad)
    step()  # compile / autotune outside the timing
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    ms = do_bench(step, warmup=10, rep=40, grad_to_none=params, return_mode="median")
    return ms, peak


def gpu_kernels(args) -> int:
    if not torch.cuda.is_available():
        print("bench_lora --kernels: no CUDA device; this part measures GPU kernels, nothing to do.")
        return 0
    try:
        import triton
    except ImportError:
        print("bench_lora --kernels: triton is not installed; nothing to measure.")
        return 0
    try:
        import peft
        have_peft, peft_version = True, peft.__version__
    except ImportError:
        have_peft, peft_version = False, "-"
    peak = _measured_peak()
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "peft": peft_version, "autotune": os.environ.get("FTLIB_LORA_AUTOTUNE", "1"),
            "measured_peak_tflops": f"{peak:.0f}"}
    print(f"# {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  peft {peft_version}  "
          f"bf16 autocast, fp32 adapters, tokens={args.tokens}, dropout={args.dropout}, "
          f"measured bf16 peak {peak:.0f} TFLOP/s, autotune={meta['autotune']}")
    ranks = [int(v) for v in args.ranks.split(",")]
    shapes = SHAPES[:1] if args.quick else SHAPES
    cases = [(s, r, base, adapter) for r in ranks for adapter in ("lora", "dora") for s in shapes
             for base in ("bf16", "nf4")]
    # priority order: LoRA on the two Llama-3-8B shapes first (r16 before r64, bf16 before NF4), then DoRA
    cases.sort(key=lambda c: (c[3] != "lora", c[0] not in SHAPES[:2], c[1] != ranks[0], c[0] != SHAPES[0]))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    new = not os.path.exists(args.out)
    fh = open(args.out, "a", newline="")
    writer = csv.DictWriter(fh, fieldnames=GPU_FIELDS)
    if new:
        writer.writeheader()
    print(f"{'in x out':>12} {'r':>3} {'base':4} {'adapter':7} {'mode':8} {'provider':8} {'ms':>8} {'TFLOP/s':>8} "
          f"{'of peak':>7} {'vs unfused':>10} {'peak MB':>8}", flush=True)
    t0, skipped, fused_ms = time.monotonic(), [], {}
    for (n_in, n_out), r, base, adapter in cases:
        if args.budget_s and time.monotonic() - t0 > args.budget_s:
            skipped.append(f"{n_in}x{n_out}/r={r}/{base}/{adapter}")
            continue
        m = args.tokens
        flops = {"fwd": 2 * m * n_out * n_in + 2 * m * r * (n_in + n_out),
                 "bwd": 2 * m * n_out * n_in + 4 * m * r * (n_in + n_out)}
        flops["fwd+bwd"] = flops["fwd"] + flops["bwd"]
        try:
            layers = _gpu_layers(n_in, n_out, r, base, adapter, args.dropout, have_peft)
            x = torch.randn(m, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        except Exception as e:  # noqa: BLE001 - building the case (OOM, quantizing): this case only
            print(f"  {n_in}x{n_out} r={r} {base}/{adapter}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            torch.cuda.empty_cache()
            continue
        for mode in ("fwd", "bwd", "fwd+bwd"):
            res = {}
            for name, (module, backend) in layers.items():
                try:
                    res[name] = _gpu_time(module, backend, x, mode)
                except Exception as e:  # noqa: BLE001 - any provider failure (OOM, a compile error) is reported, the rest run
                    print(f"  {name} {n_in}x{n_out} r={r} {base}/{adapter} {mode}: {type(e).__name__}: {str(e)[:120]}")
                    torch.cuda.empty_cache()
            ref = res.get("unfused", (None,))[0]
            for name, (ms, peak_mb) in res.items():
                tf = flops[mode] / (ms * 1e-3) / 1e12
                vs = ref / ms if ref else None
                fused_ms[(n_in, n_out, r, base, adapter, mode, name)] = ms
                writer.writerow({**meta, "n_in": n_in, "n_out": n_out, "r": r, "tokens": m, "base": base,
                                 "adapter": adapter, "dropout": args.dropout, "provider": name, "mode": mode,
                                 "ms": f"{ms:.4f}", "tflops": f"{tf:.1f}", "frac_peak": f"{tf / peak:.3f}",
                                 "vs_unfused": f"{vs:.3f}" if vs else "", "peak_mb": f"{peak_mb:.0f}"})
                print(f"{f'{n_in}x{n_out}':>12} {r:>3} {base:4} {adapter:7} {mode:8} {name:8} {ms:8.3f} {tf:8.1f} "
                      f"{tf / peak:7.2f} {vs if vs else float('nan'):10.2f} {peak_mb:8.0f}", flush=True)
            fh.flush()
            if adapter == "lora" and "fused" in res and (n_in, n_out) in SHAPES[:2] and mode != "bwd":
                f_ms, u_ms = res["fused"][0], res.get("unfused", (float("nan"),))[0]
                summary(f"lora {n_in}x{n_out} r{r} {base} {mode} ({m} tokens): fused {f_ms:.3f} ms "
                        f"({flops[mode] / (f_ms * 1e-3) / 1e12:.0f} TFLOP/s), cuBLAS + 2 GEMMs {u_ms:.3f} ms "
                        f"({u_ms / f_ms:.2f}x)")
        del layers, x
        torch.cuda.empty_cache()
    fh.close()
    os.environ.pop("FTLIB_LORA_BACKEND", None)
    # NF4 against the bf16 base (same shape, rank, adapter and provider): the QLoRA cost of the kernel
    for key, ms in fused_ms.items():
        n_in, n_out, r, base, adapter, mode, name = key
        other = fused_ms.get((n_in, n_out, r, "bf16", adapter, mode, name))
        if base == "nf4" and other and mode == "fwd+bwd":
            print(f"nf4 / bf16 time  {n_in}x{n_out} r={r} {adapter:4} {name:8} {ms / other:.2f}")
    if skipped:
        print(f"time budget reached; skipped {len(skipped)} cases: {', '.join(skipped)}")
    print(f"appended rows to {args.out} ({time.monotonic() - t0:.0f} s)")
    return 0


_STUBBED = ("_fwd_kernel", "_down_kernel", "_bwd_v_kernel", "_bwd_db_kernel", "_bwd_dx_kernel", "_bwd_da_kernel")


class _StubKernel:
    """Stands in for an autotuned kernel: ``kernel[grid](*args, **meta)`` evaluates the grid only."""

    _META = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return grid(self._META) if callable(grid) else grid
        return launch


def host_overhead(args) -> int:
    os.environ["TRITON_INTERPRET"] = "1"  # before the launcher module is imported: CPU tensors allowed
    if "ftlib.kernels.lora_triton" in sys.modules:
        raise SystemExit("bench_lora --host-overhead: the launcher was imported before TRITON_INTERPRET was set")
    from ftlib.kernels import lora_triton as lt
    from ftlib.lora import NF4Linear

    for name in _STUBBED:
        setattr(lt, name, _StubKernel())
    torch.set_num_threads(1)
    m, k, n, r = args.tokens, args.n_in, args.n_out, args.r
    cases = [("lora", {}), ("lora+dropout", {"dropout_p": 0.05}), ("nf4", {"nf4": True}),
             ("lora m=16", {"m": 16})]
    print(f"host overhead per fused LoRA call (forward + backward, kernels stubbed), {k}x{n}, r={r}, "
          f"tokens={m}, bf16, torch {torch.__version__}")
    for name, kw in cases:
        mm = kw.pop("m", m)
        w = torch.zeros(n, k, dtype=torch.bfloat16)
        if kw.pop("nf4", False):
            lin = nn.Linear(k, n, bias=False, dtype=torch.bfloat16).requires_grad_(False)
            w = NF4Linear.from_linear(lin, double_quant=True)
        a = torch.zeros(r, k, requires_grad=True)
        b = torch.zeros(n, r, requires_grad=True)
        x = torch.zeros(mm, k, dtype=torch.bfloat16, requires_grad=True)
        g = torch.zeros(mm, n, dtype=torch.bfloat16)

        def call(x=x, w=w, a=a, b=b, g=g, kw=kw):
            y = lt.lora_matmul_triton(x, w, a, b, 2.0, seed=1, **kw)
            y.backward(g)
            x.grad = a.grad = b.grad = None  # no accumulation into last call's gradients

        for _ in range(20):
            call()
        per_call = []
        for _ in range(args.iters):
            t = time.perf_counter()
            for _ in range(50):
                call()
            per_call.append((time.perf_counter() - t) / 50 * 1e6)
        print(f"  {name:14s} median {statistics.median(per_call):7.1f} us   min {min(per_call):7.1f} us", flush=True)
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-in", type=int, default=4096)
    ap.add_argument("--n-out", type=int, default=4096)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (default 256; --kernels: 8192)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads (0: torch's default); 1 avoids OpenMP stalls on a busy machine")
    ap.add_argument("--csv", default=None, help="append result rows to this CSV file")
    ap.add_argument("--kernels", action="store_true", help="GPU part: fused vs unfused vs PEFT (see above)")
    ap.add_argument("--out", default="benchmarks/results/lora_gpu.csv", help="--kernels: CSV to append rows to")
    ap.add_argument("--ranks", default="16,64", help="--kernels: adapter ranks")
    ap.add_argument("--dropout", type=float, default=0.05, help="--kernels: LoRA dropout")
    ap.add_argument("--quick", action="store_true", help="--kernels: the 4096 x 4096 shape only")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="--kernels: start no new case after this many seconds (0: no limit)")
    ap.add_argument("--host-overhead", action="store_true", help="host cost per fused call, kernels stubbed")
    args = ap.parse_args()
    if args.host_overhead:
        args.tokens = args.tokens or 512
        if "--n-in" not in sys.argv:
            args.n_in = args.n_out = 1024
        sys.exit(host_overhead(args))
    if args.kernels:
        args.tokens = args.tokens or 8192
        sys.exit(gpu_kernels(args))
    args.tokens = args.tokens or 256
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
