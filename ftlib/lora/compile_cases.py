"""The compile cases of the Triton launches ftlib's adapters and attention make, recorded on a CPU.

``ftlib.kernels.compile_check`` builds its cases from the launchers' configuration lists and a
hand-written list of variants; this module drives the real modules instead (``LoRALinear`` under
bf16 autocast with fp32 adapters: ranks 8-256 including unaligned ones, NF4, NF4 with double
quantization and dropout, DoRA, bias, odd shapes; the attention op at head dims 64/96/128/256,
causal and not, packed and dense, fp32 at d16/d64) under ``ftlib.kernels.launch_recorder.recording``
(kernels swapped for recorders, an H200 emulated) and turns each distinct launch into a
``compile_check.Case`` with the configuration the launcher takes without autotuning. "Shipped"
launches are those Llama / Qwen / Mistral-class fine-tuning makes (head dims 64 and 128, ranks <= 64).

It sits at the adapters' layer because it builds adapters; the compile itself is
``compile_check.run_cases``. Selections: ``recorded`` (sm_90 and sm_80), ``recorded-shipped``
(sm_90), ``recorded-ci`` (the CI's sample). ``python -m ftlib.lora.compile_cases --list SELECTION
OUT.json`` writes one as JSON (what ``list_cases`` runs under the interpreter).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from ftlib.kernels import compile_check as cc
from ftlib.kernels.launch_recorder import Launch, drive_attention, recording

__all__ = ["SELECTIONS", "drive", "list_cases", "recorded_cases", "recorded_ci_cases"]


def _lora_layer(k, n, r, *, nf4=None, dora=False, dropout=0.0, bias=False):
    from torch import nn

    from .layers import LoRALinear
    from .nf4 import NF4Linear

    base = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    if nf4:
        base = NF4Linear.from_linear(base, blocksize=nf4[0], double_quant=nf4[1])
    layer = LoRALinear(base, r, 2 * r, dropout=dropout, use_dora=dora).train()  # adapters fp32
    return layer


def _drive_lora(label, m, k, n, r, **kw):
    layer = _lora_layer(k, n, r, **kw)
    x = torch.zeros(m, k, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(torch.zeros_like(y))


# (label, shipped) -> driver; "shipped": the launches Llama / Qwen / Mistral-class fine-tuning makes
# (head dims 64 and 128, ranks <= 64, every linear a multiple of 16 wide)
def _cases():
    out = []
    for d in (64, 96, 128, 256):
        for causal in (True, False):
            for varlen in (True, False):
                shipped = d in (64, 128) and causal
                out.append((f"attn d{d} {'causal' if causal else 'full'} {'varlen' if varlen else 'dense'}", shipped,
                            lambda d=d, c=causal, v=varlen: drive_attention(d, c, v)))
    out.append(("attn d16 fp32 causal varlen", False, lambda: drive_attention(16, True, True, torch.float32)))
    out.append(("attn d64 fp32 causal varlen", False, lambda: drive_attention(64, True, True, torch.float32)))
    for r in (8, 16, 32, 64, 128, 200, 256):
        shipped = r <= 64
        for tag, kw in (("", {}), (" dropout", {"dropout": 0.05}), (" nf4", {"nf4": (64, False)}),
                        (" nf4-dq dropout", {"nf4": (64, True), "dropout": 0.05}), (" dora", {"dora": True}),
                        (" bias", {"bias": True})):
            out.append((f"lora r{r}{tag}", shipped, lambda r=r, kw=kw: _drive_lora("", 256, 512, 384, r, **kw)))
    for tag, kw in (("", {}), (" nf4-dq dropout", {"nf4": (64, True), "dropout": 0.05})):  # odd K / N / M
        out.append((f"lora r16 odd shapes{tag}", False, lambda kw=kw: _drive_lora("", 100, 200, 136, 16, **kw)))
    return out


def drive(shipped_only: bool = False) -> list[tuple[Launch, bool]]:
    """Run every driving case under ``recording()``; the distinct launches, each with whether a
    shipped-model case makes it (first seen order)."""
    torch.manual_seed(0)
    seen: dict = {}
    with recording() as (log, label):
        for name, shipped, fn in _cases():
            if shipped_only and not shipped:
                continue
            label[0] = name
            start = len(log)
            fn()
            for launch in log[start:]:
                prev = seen.get(launch.key())
                seen[launch.key()] = (prev[0], prev[1] or shipped) if prev else (launch, shipped)
    return list(seen.values())


_BLOCK_NAMES = {"lora": cc.LORA_BLOCKS, "attention": {k: ("BLOCK_M", "BLOCK_N") for k in ("fwd", "dkdv", "dq")}}


def recorded_cases(targets=("sm_90",), shipped_only: bool = False, full: bool = False) -> list:
    """The launches ``drive`` records (LoRALinear under autocast, the attention op;
    shipped models' and the wider sweep), each with the configuration the launcher takes without
    autotuning on each target (``full``: every configuration it keeps). Needs a process without
    TRITON_INTERPRET (``list_cases("recorded")`` starts one)."""
    from ftlib.kernels import attention_triton as at
    from ftlib.kernels import lora_triton as lt

    out = []
    for launch, shipped in drive(shipped_only):
        meta, ptr = dict(launch.constexprs), dict(launch.ptr_types)
        variant = ",".join(f"{k}={v}" for k, v in launch.constexprs if k not in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        variant += "".join(f" {k}:{t}" for k, t in launch.ptr_types if t != "bf16")
        if launch.unaligned:
            variant += " unaligned:" + ",".join(launch.unaligned)
        src = ("shipped: " if shipped else "") + launch.label
        module = f"ftlib.kernels.{launch.family}_triton"
        for target in targets:
            cap, limit = cc.TARGETS[target]
            if launch.kind == "preprocess":
                out.append(cc.Case(f"{launch.family}.preprocess", variant, f"{meta['BLOCK_M']} w4 s3", target, module,
                                "preprocess", ptr, launch.float_args, meta, 4, 3, None, True,
                                unaligned_args=launch.unaligned, source=src))
                continue
            if launch.family == "lora":
                configs = lt.tile_configs(launch.kind, meta, limit, cap)
            else:
                configs = at.tile_configs(launch.kind, meta, limit)
            for i, (c, est) in enumerate(configs if full else configs[:1]):
                out.append(cc.Case(f"{launch.family}.{launch.kind}", variant,
                                cc.config_text(c, _BLOCK_NAMES[launch.family][launch.kind]), target, module, launch.kind,
                                ptr, launch.float_args, dict(meta, **c.kwargs), c.num_warps, c.num_stages, est,
                                i == 0, unaligned_args=launch.unaligned, source=src))
    return out


def recorded_ci_cases() -> list:
    """The CI share of the recorded cases (a few compiles: the suite's time is bounded): of the shipped
    models' launches on sm_90 (head dims 64 / 128, ranks <= 64) that the hand-written CI subset does
    not already compile, the first per kernel and feature set (NF4, double quantization, dropout, DoRA,
    bias, varlen). Every recorded launch is compiled by ``test_compile_targets``'s slow test
    and by ``benchmarks/compile_report.py --selection recorded``."""
    have = {cc.signature_key(c) for c in cc.ci_cases()}
    out, seen = [], set()
    feats = ("NF4", "DOUBLE_QUANT", "DROPOUT", "DORA", "HAS_BIAS", "IS_VARLEN")
    for c in recorded_cases(("sm_90",), shipped_only=True):
        key = (c.kernel, *(c.constexprs.get(f) for f in feats))
        if cc.signature_key(c) not in have and key not in seen:
            seen.add(key)
            out.append(c)
    return out


SELECTIONS = {"recorded": lambda: recorded_cases(("sm_90", "sm_80")),
              "recorded-ci": lambda: recorded_ci_cases(),
              "recorded-shipped": lambda: recorded_cases(("sm_90",), shipped_only=True)}


def list_cases(selection: str) -> list:
    """The cases of ``selection`` (``recorded``, ``recorded-ci`` or ``recorded-shipped``); under the
    interpreter, listed by a fresh process without it (the GPU tile lists)."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return SELECTIONS[selection]()
    return cc.list_in_fresh_process("ftlib.lora.compile_cases", selection)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--list"] or len(sys.argv) != 4:
        raise SystemExit("usage: python -m ftlib.lora.compile_cases --list SELECTION OUT.json")
    with open(sys.argv[3], "w") as f:
        json.dump([dataclasses.asdict(c) for c in SELECTIONS[sys.argv[2]]()], f)
