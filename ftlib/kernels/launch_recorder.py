"""Record the Triton launches ftlib's code makes, on a CPU, as an H200 would see them.

The compile check (``compile_check``) builds its cases from the launchers' configuration lists and
a hand-written list of variants; this module finds the variants the code actually reaches instead.
Inside ``recording()`` every kernel the launchers call (the autotuned LoRA and attention kernels,
the attention preprocess pass, the dropout-mask kernel) is swapped for a recorder: a launch
``kernel[grid](*args, **kwargs)`` stores the argument types (pointer element types, float
scalars, which integers are not multiples of 16, as Triton specializes them) and the constexprs,
and runs nothing. An H200 is emulated (sm_90, 132 SMs, 227 KiB of shared memory per block), the
launchers' CUDA-tensor check is lifted, and the backends are forced to Triton, so ordinary
modules (``LoRALinear`` under bf16 autocast with fp32 adapters, the attention op) drive the real
launchers, forward and backward, with CPU tensors. Outputs are left unwritten: the values are
meaningless, the launch signatures are exact.

It must run in a process where ``TRITON_INTERPRET`` was never set (the interpreter's tile lists
differ). ``ftlib.lora.compile_cases`` drives ``LoRALinear`` and the attention op (``drive_attention``)
under ``recording()`` (the shipped models' launches and a wider sweep: head dims 64-256, causal and
not, ranks 8-256 including unaligned ones, NF4, DoRA, dropout) and turns the distinct launches into
``compile_check.Case`` rows; it sits at the adapters' layer because it builds adapters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from types import SimpleNamespace

import torch

__all__ = ["H200", "Launch", "drive_attention", "recording"]

_LORA_KINDS = {"_fwd_kernel": "fwd", "_down_kernel": "down", "_bwd_v_kernel": "v", "_bwd_db_kernel": "db",
               "_bwd_dx_kernel": "dx", "_bwd_da_kernel": "da"}
_ATTN_KINDS = {"_fwd_kernel": "fwd", "_bwd_dkdv_kernel": "dkdv", "_bwd_dq_kernel": "dq",
               "_bwd_preprocess": "preprocess"}
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
          torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.bool: "i1"}
H200 = SimpleNamespace(multi_processor_count=132, major=9, minor=0, name="NVIDIA H200 (emulated)",
                       total_memory=141 << 30)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch signature: what Triton compiles a kernel for (its tile configuration aside)."""

    family: str  # "lora" or "attention"
    kind: str  # the launcher's kernel name ("fwd", "dx", "dkdv", ...)
    constexprs: tuple  # sorted (name, value) the launcher passes
    ptr_types: tuple  # sorted (argument, element type)
    float_args: tuple  # float scalar arguments
    unaligned: tuple  # integer arguments not divisible by 16
    label: str = ""  # the driving case (the first that made this launch)

    def key(self):
        return (self.family, self.kind, self.constexprs, self.ptr_types, self.float_args, self.unaligned)


class _Recorder:
    def __init__(self, family, kind, jit_fn, log, label):
        self.family, self.kind, self.arg_names = family, kind, jit_fn.arg_names
        self.log, self.label = log, label
        self.dns = set(getattr(jit_fn, "do_not_specialize", []) or [])
        self.dns |= {jit_fn.arg_names[i] for i in self.dns if isinstance(i, int)}
        self.constexprs = {p.name for p in jit_fn.params if p.is_constexpr}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = dict(zip(self.arg_names, args), **kwargs)
            const, ptr, floats, unaligned = {}, {}, [], []
            for name, v in named.items():
                if isinstance(v, torch.Tensor):
                    ptr[name] = _TYPES[v.dtype]
                elif name in self.constexprs or v is None:
                    const[name] = v
                elif isinstance(v, float):
                    floats.append(name)
                elif isinstance(v, int) and name not in self.dns and v % 16:
                    unaligned.append(name)
            self.log.append(Launch(self.family, self.kind, tuple(sorted(const.items())), tuple(sorted(ptr.items())),
                                   tuple(sorted(floats)), tuple(sorted(unaligned)), self.label[0]))
        return launch


@contextlib.contextmanager
def recording():
    """Swap the kernels for recorders and emulate an H200; yields the list the launches go to and a
    one-element list holding the current case label (set it before each driven case)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("launch_recorder: needs a process without TRITON_INTERPRET (the GPU tile lists)")
    from . import _lora_kernels as lk
    from . import attention_triton as at
    from . import lora_triton as lt

    log, label = [], [""]
    saved = []

    def swap(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    for name, kind in _LORA_KINDS.items():
        swap(lt, name, _Recorder("lora", kind, lt.KERNELS[kind], log, label))
    for name, kind in _ATTN_KINDS.items():
        swap(at, name, _Recorder("attention", kind, at.KERNELS[kind], log, label))
    swap(lk, "_mask_kernel", _Recorder("lora", "mask", lk._mask_kernel, log, label))
    swap(lt, "_INTERPRET", True)  # the launchers' CUDA-tensor check only (their tile lists are the GPU ones)
    swap(at, "_INTERPRET", True)
    swap(torch.cuda, "get_device_properties", lambda *a, **k: H200)
    swap(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    env = {"TRITON_INTERPRET": "1", "FTLIB_LORA_BACKEND": "triton", "FTLIB_ATTN_BACKEND": "triton"}
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the backend choice reads these per call: Triton, CPU tensors allowed
    try:
        yield log, label
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def drive_attention(d, causal, varlen, dtype=torch.bfloat16, hq=4, hkv=2):
    """One forward and backward of the attention op (GQA hq:hkv, head dim d), packed or dense."""
    from .attention import attention

    if varlen:
        lens = [37, 64, 100]
        n = sum(lens)
        cu = torch.tensor([0, 37, 101, 201], dtype=torch.int32)
        q = torch.zeros(n, hq, d, dtype=dtype, requires_grad=True)
        kv = [torch.zeros(n, hkv, d, dtype=dtype, requires_grad=True) for _ in range(2)]
        o = attention(q, *kv, causal=causal, cu_seqlens=cu, max_seqlen=max(lens))
    else:
        q = torch.zeros(2, 96, hq, d, dtype=dtype, requires_grad=True)
        kv = [torch.zeros(2, 96, hkv, d, dtype=dtype, requires_grad=True) for _ in range(2)]
        o = attention(q, *kv, causal=causal)
    o.backward(torch.zeros_like(o))
