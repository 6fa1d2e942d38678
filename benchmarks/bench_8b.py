"""The headline GPU number: a LoRA / QLoRA step on a Llama-3-8B-shaped model, ftlib against transformers + peft.

    python benchmarks/bench_8b.py --out DIR                  # GPU: all variants, 32 layers
    python benchmarks/bench_8b.py --layers 16 --budget-s 120 # the first 16 layers (the count is in every row)
    python benchmarks/bench_8b.py --device cpu --tiny        # smoke run of every code path on a tiny shape
    python benchmarks/bench_8b.py --dry-run --out DIR        # writes the rows and summary lines, marked dry

The model: Llama-3-8B's shape (hidden 4096, intermediate 14336, 32 query / 8 key-value heads, head
dim 128, vocab 128256, RoPE theta 500k, untied head), random weights initialised **on the device**
(no checkpoint files are read or written), bf16 weights, bf16 autocast, fp32 adapters. ``--layers N``
keeps the first N decoder layers (the count is stated in every row and summary line).

Variants (each in its own process, so each peak memory is its own):
  ftlib-lora   ftlib's model, LoRA r16 / alpha 32 on every linear layer, packed rows of ``--seq-len``
               (4096) tokens (cu_seqlens: no token sees another document), Triton attention and
               fused LoRA kernels, chunked cross-entropy
  ftlib-qlora  the same with the base projections in ftlib's NF4 (``LoRAConfig(quantize="nf4")``:
               no bitsandbytes)
  hf-lora      transformers (sdpa) + peft on the same documents as dynamic padding with length
               grouping (transformers' LengthGroupedSampler order cut into batches of at most 1.125 x
               ``--seq-len`` padded tokens, as ``bench_train.py``'s hf-budget), built from the config
               on the device

Every variant: AdamW (fused, lr 3e-4), global-norm clipping at 1.0, no gradient checkpointing,
``--warmup`` steps (compilation) then ``--steps`` timed steps. Reported: real (non-pad) tokens/s,
model TFLOP/s (``ftlib.metrics.FlopsModel``: PaLM's convention, padding not counted), MFU against
``--peak-tflops`` (989, the H200's dense bf16 peak), peak memory (``torch.cuda.max_memory_allocated``).
Each row is appended to ``<out>/bench_8b.csv`` and its headline line to ``$FTLIB_SUMMARY`` as soon as
the variant finishes. Without CUDA (and without ``--device cpu``) the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _summary import append_row, summary  # noqa: E402

VARIANTS = ["ftlib-lora", "ftlib-qlora", "hf-lora"]
LR = 3e-4
LORA = dict(r=16, alpha=32, dropout=0.0)
SHAPE_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                rope_theta=500000.0, tie_word_embeddings=False)
VOCAB_8B = 128256
SHAPE_TINY = dict(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2,
                  rope_theta=500000.0, tie_word_embeddings=False)
HEADER = ["date", "device_name", "torch", "triton", "transformers", "peft", "variant", "layers", "vocab", "seq_len",
          "steps", "real_tokens_per_s", "tflops", "mfu", "peak_mb", "padded_fraction", "loss_first", "loss_last",
          "step_s_median", "warmup_s", "build_s", "status"]


def shape(spec) -> dict:
    base = SHAPE_TINY if spec["tiny"] else SHAPE_8B
    return dict(base, num_hidden_layers=spec["layers"])


def vocab(spec) -> int:
    return 1024 if spec["tiny"] else VOCAB_8B


def corpus(spec):
    from bench_train import Corpus

    return Corpus(vocab(spec), spec["docs"], seed=0, max_len=spec["seq_len"])


def flops_of(spec, lens, n_target) -> float:
    from bench_train import flops_model

    pairs = sum(n * (n + 1) // 2 for n in lens)
    return flops_model(shape(spec), vocab(spec)).flops(sum(lens), n_target, pairs)


# ---------------------------------------------------------------------------------------------
# workers (one variant per process)


def build_ftlib(spec):
    import torch

    from ftlib.lora import LoRAConfig, apply_lora
    from ftlib.models import LlamaConfig, LlamaForCausalLM

    dev = spec["device"]
    cfg = LlamaConfig(vocab_size=vocab(spec), max_position_embeddings=max(8192, spec["seq_len"]), **shape(spec))
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: no fp32 copy of 8B weights
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    quant = "nf4" if spec["variant"] == "ftlib-qlora" else None
    apply_lora(model, LoRAConfig(target_modules="all-linear", quantize=quant, **LORA), verbose=False)
    for p in model.parameters():  # adapters in fp32 (the autocast dtype is bf16)
        if p.requires_grad:
            p.data = p.data.float()
    return model


def worker_ftlib(spec):

    from bench_train import endless, ftlib_step, real_tokens

    from ftlib.clip import GlobalNormClipper
    from ftlib.data import TokenLoader
    from ftlib.optim import TrainOptimizer, make_adamw, param_groups

    t0 = time.perf_counter()
    model = build_ftlib(spec)
    model.train()
    opt = TrainOptimizer(make_adamw(param_groups(model, lr=LR), lr=LR, impl="fused" if spec["device"] == "cuda"
                                    else "foreach"), precision="bf16")
    loader = TokenLoader(corpus(spec), batch_size=1, seq_len=spec["seq_len"], pad_id=0, packing=True, seed=0)
    step = ftlib_step(model, opt, GlobalNormClipper(1.0), spec["device"])
    build_s = time.perf_counter() - t0
    return run_steps(spec, endless(loader), step, real_tokens, build_s)


def worker_hf(spec):
    import numpy as np
    import torch
    import transformers
    from bench_train import budget_batches, pad_batch, padded_batch_size, real_tokens
    from peft import LoraConfig, get_peft_model

    dev = spec["device"]
    t0 = time.perf_counter()
    s = shape(spec)
    cfg = transformers.LlamaConfig(vocab_size=vocab(spec), max_position_embeddings=max(8192, spec["seq_len"]),
                                   attn_implementation="sdpa", **s)
    cfg.use_cache = False
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model = get_peft_model(model, LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # fp32 adapters, as ftlib's (recent peft does this itself: autocast_adapter_dtype)
        p.data = p.data.float()
    model.train()
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=dev == "cuda")
    train = corpus(spec)
    budget = int(spec["seq_len"] * 1.125)
    B = padded_batch_size(train, spec["seq_len"])
    build_s = time.perf_counter() - t0

    def batches():
        from transformers.trainer_pt_utils import LengthGroupedSampler

        g = torch.Generator()
        epoch = 0
        while True:
            g.manual_seed(epoch)
            idx = list(LengthGroupedSampler(B, lengths=train.lengths.tolist(), generator=g))
            for b in budget_batches(idx, train.lengths, budget):
                yield pad_batch([train[j] for j in b])
            epoch += 1

    amp = torch.autocast(dev, dtype=torch.bfloat16)

    def step(batch):
        batch = {k: v.to(dev) for k, v in batch.items()}
        with amp:
            out = model(**batch, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        n = int((batch["labels"][:, 1:] != -100).sum())
        return float(out.loss.detach()) * n, n

    del np
    return run_steps(spec, batches(), step, real_tokens, build_s)


def run_steps(spec, batches, step_fn, n_real, build_s):
    import statistics

    import torch
    from bench_train import doc_lengths

    dev = spec["device"]

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    warm, steps = spec["warmup"], spec["steps"]
    deadline = time.perf_counter() + spec["max_s"]
    tokens = padded = 0
    flops, times, losses = 0.0, [], []
    t_warm = time.perf_counter()
    t_start = None
    for i, batch in enumerate(batches):
        if i == warm:
            sync()
            t_start = time.perf_counter()
            warmup_s = t_start - t_warm
        t = time.perf_counter()
        loss_sum, n_tgt = step_fn(batch)  # returns Python floats: the step has synchronised
        times.append(time.perf_counter() - t)
        losses.append(loss_sum / max(n_tgt, 1))
        if i >= warm:
            real = n_real(batch)
            tokens += real
            padded += batch["input_ids"].numel()
            flops += flops_of(spec, doc_lengths(batch), n_tgt)
        if i + 1 >= warm + steps or (time.perf_counter() > deadline and i >= warm):
            break
    sync()
    if t_start is None:
        raise RuntimeError(f"the {spec['max_s']:.0f} s allowed ran out during the {warm} warm-up steps")
    elapsed = time.perf_counter() - t_start
    timed = times[warm:]
    return {
        "steps": len(timed), "real_tokens_per_s": tokens / elapsed, "tflops": flops / elapsed / 1e12,
        "peak_mb": torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda" else float("nan"),
        "padded_fraction": 1 - tokens / padded if padded else float("nan"),
        "loss_first": losses[0], "loss_last": losses[-1], "step_s_median": statistics.median(timed),
        "warmup_s": warmup_s, "build_s": build_s,
    }


def run_worker(spec_json: str, out_path: str) -> int:
    spec = json.loads(spec_json)
    import torch

    torch.manual_seed(0)
    fn = worker_hf if spec["variant"].startswith("hf") else worker_ftlib
    out = fn(spec)
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


# ---------------------------------------------------------------------------------------------
# the parent


def versions() -> dict:
    import importlib

    out = {}
    for name in ("torch", "triton", "transformers", "peft"):
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception:  # noqa: BLE001 - not importable: recorded as such
            out[name] = "none"
    return out


def write(args, variant, r, status, vers, dev_name):
    mfu = r["tflops"] / args.peak_tflops if r else float("nan")
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    f = (lambda k, fmt: format(r[k], fmt)) if r else (lambda k, fmt: "nan")
    append_row(os.path.join(args.out, "bench_8b.csv"), HEADER,
               [date, dev_name, vers["torch"], vers["triton"], vers["transformers"], vers["peft"], variant,
                args.layers, 1024 if args.tiny else VOCAB_8B, args.seq_len, r["steps"] if r else 0,
                f("real_tokens_per_s", ".1f"), f("tflops", ".2f"), format(mfu, ".4f"), f("peak_mb", ".0f"),
                f("padded_fraction", ".4f"), f("loss_first", ".4f"), f("loss_last", ".4f"),
                f("step_s_median", ".4f"), f("warmup_s", ".1f"), f("build_s", ".1f"), status])
    shape_txt = f"llama3-8b-shape {args.layers}/32 layers" if not args.tiny else f"tiny {args.layers} layers"
    if status == "dry":
        summary(f"8b {variant}: dry ({shape_txt}, seq {args.seq_len}; would report tok/s, TFLOP/s, MFU, peak MB)")
    elif r:
        summary(f"8b {variant}: {r['real_tokens_per_s']:.0f} tok/s, {r['tflops']:.1f} TFLOP/s, MFU {mfu:.1%}, peak "
                f"{r['peak_mb'] / 1024:.1f} GiB ({shape_txt}, seq {args.seq_len}, {r['steps']} steps, loss "
                f"{r['loss_first']:.3f}->{r['loss_last']:.3f})")
    else:
        summary(f"8b {variant}: {status} ({shape_txt})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--layers", type=int, default=32, help="decoder layers kept (Llama-3-8B has 32)")
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per packed row (padded: ~as many)")
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (kernel compilation)")
    ap.add_argument("--budget-s", type=float, default=None, help="the whole run's time; split over the variants")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H200: 989)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (CPU smoke test of the code paths)")
    ap.add_argument("--dry-run", action="store_true", help="write the rows and summary lines, marked dry")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return run_worker(args.worker, args.worker_out)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; choose from {VARIANTS}")
    os.makedirs(args.out, exist_ok=True)
    if args.dry_run:
        vers = {k: "dry" for k in ("torch", "triton", "transformers", "peft")}
        for v in variants:
            write(args, v, None, "dry", vers, "dry")
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench_8b: no CUDA device (torch {torch.__version__}); nothing measured")
        return 0
    vers = versions()
    if vers["transformers"] == "none" or vers["peft"] == "none":
        print("bench_8b: transformers/peft not importable: the hf-lora baseline is skipped")
        variants = [v for v in variants if not v.startswith("hf")]
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    t0 = time.perf_counter()
    failed = 0
    results = {}
    with tempfile.TemporaryDirectory(prefix="ftlib_bench_8b_") as work:
        for i, v in enumerate(variants):
            left = args.budget_s - (time.perf_counter() - t0) if args.budget_s else 1e9
            share = left / (len(variants) - i)  # what is left, split over the variants still to run
            if share < 10:
                write(args, v, None, "skipped (budget spent)", vers, dev_name)
                continue
            spec = dict(variant=v, layers=args.layers, seq_len=args.seq_len, docs=args.docs, steps=args.steps,
                        warmup=args.warmup, device=args.device, tiny=args.tiny, max_s=max(5.0, share - 25))
            out = os.path.join(work, f"{v}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec), "--worker-out", out]
            ts = time.perf_counter()
            try:
                rc = subprocess.run(cmd, timeout=share).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc == 0 and os.path.exists(out):
                with open(out) as f:
                    r = json.load(f)
                write(args, v, r, "ok", vers, dev_name)
                results[v] = r
                if v.startswith("hf"):
                    for ft in [k for k in results if k.startswith("ftlib")]:
                        x = results[ft]["real_tokens_per_s"] / r["real_tokens_per_s"]
                        m = results[ft]["peak_mb"] / r["peak_mb"]
                        summary(f"8b {ft} vs {v}: {x:.2f}x tok/s, {m:.2f}x peak memory")
            else:
                failed += 1
                write(args, v, None, f"failed (exit {rc} after {time.perf_counter() - ts:.0f} s)", vers, dev_name)
    print(f"bench_8b: rows appended to {os.path.join(args.out, 'bench_8b.csv')} in {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
