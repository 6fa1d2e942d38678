"""Fill the Triton cache with the kernels the GPU checks launch, compiling in parallel processes.

Each worker process runs one group of launches (LoRA forward + backward for one variant, attention
forward + backward for one head dim / layout) on small tensors with autotuning off, so it compiles
exactly the default configuration of each kernel variant; token counts and sizes are runtime
arguments (or only their divisibility by 16 is specialized, which these shapes share with the
benchmarks'), so the compiled kernels are the ones the tests and benchmarks then find in the cache.
Run before them with the same TRITON_CACHE_DIR (gpu_check.sh does):

    python benchmarks/warm_kernels.py --jobs 12
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# group name -> (kind, settings); each runs in its own process
GROUPS = {
    "lora-bf16": ("lora", dict(dtype="bf16")),
    "lora-bf16-bias-dropout": ("lora", dict(dtype="bf16", bias=True, dropout=0.1)),
    "lora-fp16": ("lora", dict(dtype="fp16")),
    "lora-dora": ("lora", dict(dtype="bf16", dora=True)),
    "lora-dora-dropout": ("lora", dict(dtype="bf16", dora=True, dropout=0.1)),
    "lora-nf4-dq": ("lora", dict(dtype="bf16", nf4=(64, True))),
    "lora-nf4": ("lora", dict(dtype="bf16", nf4=(64, False))),
    "lora-nf4-dq-dora-dropout": ("lora", dict(dtype="bf16", nf4=(64, True), dora=True, dropout=0.05)),
    "attn-d128": ("attention", dict(d=128, varlen=False)),
    "attn-d128-varlen": ("attention", dict(d=128, varlen=True)),
    "attn-d64": ("attention", dict(d=64, varlen=False)),
    "attn-d64-varlen": ("attention", dict(d=64, varlen=True)),
}


def _lora(dtype="bf16", bias=False, dropout=0.0, dora=False, nf4=None):
    import torch
    from torch import nn

    from ftlib.kernels.lora_triton import lora_matmul_triton
    from ftlib.lora import NF4Linear

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    k, n, r, m = 512, 384, 16, 256
    w = torch.randn(n, k, device="cuda", dtype=dt) / k**0.5
    if nf4:
        lin = nn.Linear(k, n, bias=False, device="cuda", dtype=dt).requires_grad_(False)
        lin.weight.copy_(w)
        w = NF4Linear.from_linear(lin, blocksize=nf4[0], double_quant=nf4[1])
    a = torch.randn(r, k, device="cuda", requires_grad=True)
    b = torch.randn(n, r, device="cuda", requires_grad=True)
    mag = torch.rand(n, device="cuda", requires_grad=True) + 0.5 if dora else None
    x = torch.randn(m, k, device="cuda", dtype=dt, requires_grad=True)
    y = lora_matmul_triton(x, w, a, b, 2.0, bias=torch.zeros(n, device="cuda", dtype=dt) if bias else None,
                           dropout_p=dropout, seed=1, magnitude=mag)
    y.float().square().sum().backward()


def _attention(d=128, varlen=False):
    import torch

    from ftlib.kernels.attention_triton import attention_triton

    kw = {}
    for dt in (torch.bfloat16, torch.float16):
        if varlen:
            shape_q, shape_kv = (300, 8, d), (300, 2, d)
            kw = dict(cu_seqlens=torch.tensor([0, 100, 300], device="cuda", dtype=torch.int32), max_seqlen=200)
        else:
            shape_q, shape_kv = (2, 160, 8, d), (2, 160, 2, d)
        q = torch.randn(shape_q, device="cuda", dtype=dt, requires_grad=True)
        k = torch.randn(shape_kv, device="cuda", dtype=dt, requires_grad=True)
        v = torch.randn(shape_kv, device="cuda", dtype=dt, requires_grad=True)
        attention_triton(q, k, v, causal=True, **kw).float().sum().backward()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--group", default=None, help=argparse.SUPPRESS)  # worker mode: run one group
    args = ap.parse_args()
    if args.group:
        kind, settings = GROUPS[args.group]
        (_lora if kind == "lora" else _attention)(**settings)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("warm_kernels: no CUDA device; nothing to compile")
        return 0
    os.environ.setdefault("FTLIB_LORA_AUTOTUNE", "0")
    os.environ.setdefault("FTLIB_ATTN_AUTOTUNE", "0")
    t0 = time.monotonic()
    pending, running, failed = list(GROUPS), {}, []
    while pending or running:
        while pending and len(running) < args.jobs:
            g = pending.pop(0)
            running[g] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--group", g])
        for g, p in list(running.items()):
            if p.poll() is not None:
                del running[g]
                print(f"warm {g}: {'ok' if p.returncode == 0 else f'exit {p.returncode}'} "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
                if p.returncode:
                    failed.append(g)
        time.sleep(0.2)
    print(f"warm_kernels: {len(GROUPS) - len(failed)}/{len(GROUPS)} groups compiled in {time.monotonic() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
