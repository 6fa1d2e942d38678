"""Compile every Triton kernel for real GPU targets without a GPU, and read what it costs.

``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", cc, 32))``
runs Triton's whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> ptxas) for compute capability
``cc`` on any machine: the ptxas and cuobjdump it uses ship in the triton wheel. From the result:

- ``metadata.shared``: bytes of shared memory one block needs (pipelined operand stages, layout
  conversions, reductions). It must fit the target's opt-in limit per block (``TARGETS``).
- ``cuobjdump -res-usage`` on the cubin: ``REG`` registers per thread and ``STACK`` bytes of
  local-memory frame, which for Triton kernels (no recursion, no local arrays) is register spill.

The cases are built from the launchers themselves: ``lora_triton.tile_configs`` and
``attention_triton.tile_configs`` give the configurations each launch may take on a device with
a given shared memory (the first is the one taken without autotuning) and the launcher's
shared-memory estimate, which the check holds to be no smaller than the compiled figure.

The interpreter (``TRITON_INTERPRET=1``, the CPU test mode) replaces ``@triton.jit`` functions at
import time, so compiling needs a process where it was never set: ``run_cases`` starts one
(``python -m ftlib.kernels.compile_check``) with the variable removed. Use it from tests, and from
``benchmarks/compile_report.py`` for the full sweep.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

__all__ = ["Case", "LORA_BLOCKS", "Result", "TARGETS", "augment_cases", "cases", "ci_cases", "clean_env",
           "compile_case", "config_text", "cuobjdump_path", "list_cases", "list_in_fresh_process", "run_cases", "signature_key"]

# target name -> (compute capability, shared memory per block in bytes, opt-in maximum)
TARGETS = {"sm_90": (90, 232_448), "sm_80": (80, 166_912), "sm_89": (89, 101_376)}

_DT = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


@dataclasses.dataclass
class Case:
    """One kernel compile: the function, its launch-time signature and constexprs, one tile config."""

    kernel: str  # e.g. "lora.fwd"
    variant: str  # e.g. "bf16", "nf4-b64-dq"
    config: str  # e.g. "128x256x64 w8 s3"
    target: str  # key of TARGETS
    module: str  # importable module holding the kernel table
    name: str  # kernel name in that table
    ptr_types: dict  # pointer argument -> Triton element type ("bf16", "fp32", "u8", ...)
    float_args: tuple  # scalar float arguments
    constexprs: dict
    num_warps: int
    num_stages: int
    estimate: int | None  # the launcher's shared-memory estimate, None when it makes none
    default: bool  # the configuration taken without autotuning on this target
    aligned: bool = True  # integer arguments divisible by 16 (as Triton specializes them at launch)
    unaligned_args: tuple = ()  # integer arguments not divisible by 16 even when ``aligned`` (recorded launches)
    source: str = ""  # recorded cases: the driving case that made the launch ("shipped: ..." for the models')


@dataclasses.dataclass
class Result:
    """What one compile gave: shared bytes, registers, spill (stack) bytes, or the error."""

    shared: int = -1
    registers: int = -1
    spill: int = -1
    error: str = ""


def _jit_fn(case: Case):
    import importlib

    module = importlib.import_module(case.module)
    table = getattr(module, "KERNELS", None)
    return table[case.name] if table is not None else getattr(module, case.name)


def cuobjdump_path() -> str:
    """The cuobjdump bundled in the triton wheel."""
    import triton

    try:  # Triton >= 3.3 resolves its bundled tools through knobs
        return triton.knobs.nvidia.cuobjdump.path
    except AttributeError:  # older layouts: the binary sits in the nvidia backend's bin folder
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _signature(fn, case: Case) -> tuple[dict, dict]:
    sig, attrs = {}, {}
    dns = set(getattr(fn, "do_not_specialize", []) or [])
    for i, arg in enumerate(fn.arg_names):
        if arg in case.constexprs:
            sig[arg] = "constexpr"
        elif arg in case.ptr_types:
            sig[arg] = "*" + case.ptr_types[arg]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in case.float_args:
            sig[arg] = "fp32"
        else:
            sig[arg] = "i32"
            if case.aligned and arg not in dns and i not in dns and arg not in case.unaligned_args:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_case(case: Case) -> Result:
    """Compile ``case`` for its target (in this process: TRITON_INTERPRET must be unset) and read its usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _jit_fn(case)
    sig, attrs = _signature(fn, case)
    cc = TARGETS[case.target][0]
    try:
        kernel = triton.compile(ASTSource(fn, sig, case.constexprs, attrs), target=GPUTarget("cuda", cc, 32),
                                options={"num_warps": case.num_warps, "num_stages": case.num_stages})
    except Exception as e:  # noqa: BLE001 - the check reports every failure as a result row
        inner = e
        while inner.__cause__ is not None:  # Triton chains one CompilationError per jit-call level
            inner = inner.__cause__
        lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
        where = next((line for line in lines if line.startswith("at ")), "")
        what = getattr(inner, "error_message", None) or (lines[-1] if lines else "")
        return Result(error=f"{type(e).__name__} {where}: {what}"[:600])
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump_path(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if m is None:
        return Result(error=f"cuobjdump -res-usage gave no REG/STACK line: {out[-300:]!r}")
    return Result(shared=int(kernel.metadata.shared), registers=int(m.group(1)), spill=int(m.group(2)))


def config_text(c, names) -> str:
    """A tile configuration as the tables print it: ``128x64x32 w8 s3`` (the named blocks, warps, stages)."""
    return "x".join(str(c.kwargs[n]) for n in names) + f" w{c.num_warps} s{c.num_stages}"


# ----------------------------------------------------------------------------------------------
# LoRA passes
# ----------------------------------------------------------------------------------------------

LORA_BLOCKS = {"fwd": ("BLOCK_M", "BLOCK_N", "BLOCK_K"), "dx": ("BLOCK_M", "BLOCK_K", "BLOCK_N"),
                "down": ("BLOCK_M", "BLOCK_K"), "v": ("BLOCK_M", "BLOCK_N"), "db": ("BLOCK_N", "BLOCK_M"),
                "da": ("BLOCK_K", "BLOCK_M")}
_LORA_FLOATS = ("scaling", "drop_scale")


def _lora_variants():
    """(variant name, dtype, settings) the LoRA launcher reaches; settings feed ``_lora_meta``."""
    v = [("bf16", "bf16", {}), ("fp16", "fp16", {}), ("fp32", "fp32", {}), ("bf16-bias", "bf16", {"bias": True}),
         ("bf16-dropout", "bf16", {"dropout": True}), ("bf16-dora", "bf16", {"dora": True}),
         ("bf16-dora-dropout", "bf16", {"dora": True, "dropout": True}), ("bf16-r64", "bf16", {"r": 64}),
         ("bf16-r256", "bf16", {"r": 256}), ("bf16-base", "bf16", {"base": True})]
    for block in (32, 64, 128, 256):
        for dq in (False, True):
            v.append((f"nf4-b{block}{'-dq' if dq else ''}", "bf16", {"nf4": block, "dq": dq}))
    v.append(("nf4-b64-dq-unaligned", "bf16", {"nf4": 64, "dq": True, "unaligned": True}))
    v.append(("nf4-b64-dq-dora-dropout", "bf16", {"nf4": 64, "dq": True, "dora": True, "dropout": True}))
    return v


def _lora_meta(kind, dtype, s):
    """(constexprs, pointer types) of pass ``kind`` for settings ``s``, as ``lora_triton``'s launchers pass them."""
    r = s.get("r", 16)
    br_full = max(16, 1 << (r - 1).bit_length())
    br_chunk = min(br_full, 64)
    prec = "ieee" if dtype == "fp32" else "tf32"
    dora, drop, nf4 = s.get("dora", False), s.get("dropout", False), "nf4" in s
    dq = s.get("dq", False)
    w = {"NF4": nf4, "DOUBLE_QUANT": dq, "NF4_BLOCK": s.get("nf4", 64), "NF4_K_ALIGNED": nf4 and not s.get("unaligned")}
    wptr = {"W": dtype, "CODES": "u8" if nf4 else dtype, "ABSMAX": ("u8" if dq else "fp32") if nf4 else dtype,
            "ABSMAX2": "fp32" if nf4 else dtype, "ABSMAX_CODE": "fp32" if nf4 else dtype,
            "DQ_OFFSET": "fp32" if nf4 else dtype,
            "NF4_TABLE": "fp32" if nf4 else dtype}  # the table pointer of kernels before the register lookup
    if kind == "fwd":
        base = s.get("base", False)
        meta = dict(HAS_LORA=not base, HAS_BIAS=s.get("bias", False), DORA=dora, DROP_DORA=dora and drop,
                    WRITE_Z=dora, PRECISION=prec, BLOCK_R=br_chunk, **w)
        ptr = dict(wptr, X=dtype, H=dtype, U="fp32", B=dtype, BIAS=dtype, MS="fp32", Y="fp32" if base else dtype,
                   Z=dtype)
    elif kind == "dx":
        meta = dict(DORA=dora, DROPOUT=drop, PRECISION=prec, BLOCK_R=br_chunk, **w)
        ptr = dict(wptr, G=dtype, V="fp32", A=dtype, MS="fp32", DX=dtype)
    elif kind == "down":
        meta = dict(DROPOUT=drop, WRITE_H=dora and drop, PRECISION=prec, BLOCK_R=br_full)
        ptr = dict(X=dtype, A=dtype, U="fp32", H=dtype)
    elif kind == "v":
        meta = dict(DORA=dora, PRECISION=prec, BLOCK_R=br_full)
        ptr = dict(G=dtype, B=dtype, MS="fp32", V="fp32")
    elif kind == "db":
        meta = dict(DORA_DC=dora, PRECISION=prec, BLOCK_R=br_full)
        ptr = dict(G=dtype, U="fp32", Z=dtype, DB="fp32", DC="fp32")
    else:  # da
        meta = dict(DROPOUT=drop, PRECISION=prec, BLOCK_R=br_full)
        ptr = dict(X=dtype, V="fp32", DA="fp32")
    return meta, ptr


def _lora_relevant(kind, s) -> bool:
    # a variant is listed under the passes it changes (the rest compile the same code as bf16)
    keys = set(s)
    touches = {"fwd": {"bias", "dora", "dropout", "r", "base", "nf4"}, "dx": {"dora", "dropout", "r", "nf4"},
               "down": {"dropout", "dora", "r"}, "v": {"dora", "r"}, "db": {"dora", "r"}, "da": {"dropout", "r"}}
    if kind != "fwd" and "base" in keys:
        return False
    if kind in ("down", "v", "db", "da") and "nf4" in keys:
        return False
    return not keys or bool(keys & touches[kind])


def _lora_cases(target, full):
    from . import lora_triton as lt

    limit = TARGETS[target][1]
    out = []
    for kind in ("fwd", "dx", "down", "v", "db", "da"):
        for variant, dtype, s in _lora_variants():
            if not _lora_relevant(kind, s) or (dtype != "bf16" and kind not in ("fwd", "dx")):
                continue
            meta, ptr = _lora_meta(kind, dtype, s)
            configs = lt.tile_configs(kind, meta, limit, TARGETS[target][0])
            fit = {id(c) for c, _ in configs}
            allc = [(c, None) for c in lt.CONFIGS[kind] if id(c) not in fit] if full else []
            for i, (c, est) in enumerate(list(configs) if full else configs[:1]):
                out.append(Case(f"lora.{kind}", variant, config_text(c, LORA_BLOCKS[kind]), target, "ftlib.kernels.lora_triton",
                                kind, ptr, _LORA_FLOATS, dict(meta, **c.kwargs), c.num_warps, c.num_stages, est,
                                i == 0, aligned=not s.get("unaligned")))
            for c, _ in allc:  # pruned by the launcher on this target: compiled for the report only
                est = lt.estimate_resources(kind, c, meta)[0]
                out.append(Case(f"lora.{kind}", variant, config_text(c, LORA_BLOCKS[kind]) + " (pruned)", target,
                                "ftlib.kernels.lora_triton", kind, ptr, _LORA_FLOATS, dict(meta, **c.kwargs),
                                c.num_warps, c.num_stages, est, False, aligned=not s.get("unaligned")))
    return out


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------

def _attention_cases(target, full):
    from . import attention_triton as at

    limit = TARGETS[target][1]
    variants = [("bf16-d128-causal", "bf16", 128, True, False), ("fp16-d128-causal", "fp16", 128, True, False),
                ("fp32-d64-causal", "fp32", 64, True, False), ("bf16-d64-causal", "bf16", 64, True, False),
                ("bf16-d128-full", "bf16", 128, False, False), ("bf16-d128-varlen", "bf16", 128, True, True),
                ("bf16-d80-causal", "bf16", 80, True, False), ("bf16-d256-causal", "bf16", 256, True, False),
                # the window / soft-cap variants: Mistral / Qwen (window, D = 128), Gemma-2 (both, D = 256),
                # Gemma-3 (window, D = 256), and fp32
                ("bf16-d128-varlen-window", "bf16", 128, True, True, True, False),
                ("bf16-d256-varlen-window-softcap", "bf16", 256, True, True, True, True),
                ("bf16-d256-window", "bf16", 256, True, False, True, False),
                ("fp32-d64-varlen-window-softcap", "fp32", 64, True, True, True, True),
                # separate key segments (cu_seqlens_k: context parallelism's local queries over gathered keys)
                ("bf16-d128-varlen-sepk", "bf16", 128, True, True, False, False, True),
                ("bf16-d128-varlen-sepk-window", "bf16", 128, True, True, True, False, True),
                ("fp32-d64-varlen-sepk", "fp32", 64, True, True, False, False, True)]
    out = []
    for variant, dtype, d, causal, varlen, *extra in variants:
        window, softcap, separate_k = (*extra, False, False, False)[:3]
        block_d = max(16, 1 << (d - 1).bit_length())
        meta = dict(IS_VARLEN=varlen, CAUSAL=causal, PRECISION="ieee" if dtype == "fp32" else "tf32",
                    HEAD_DIM=d, BLOCK_D=block_d, HAS_WINDOW=window, SOFTCAP=softcap, SEPARATE_K=separate_k)
        ptr = {n: dtype for n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")}
        ptr.update(LSE="fp32", DELTA="fp32", CU_SEQLENS="i32", CU_SEQLENS_K="i32")
        for kind in ("fwd", "dkdv", "dq"):
            configs = at.tile_configs(kind, meta, limit)
            for i, (c, est) in enumerate(configs if full else configs[:1]):
                out.append(Case(f"attention.{kind}", variant, config_text(c, ("BLOCK_M", "BLOCK_N")), target,
                                "ftlib.kernels.attention_triton", kind, ptr, ("qk_scale", "sm_scale", "cap_a", "cap_b"),
                                dict(meta, **c.kwargs), c.num_warps, c.num_stages, est, i == 0,
                                aligned=d % 16 == 0))
        pre = dict(IS_VARLEN=varlen, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=at.PREPROCESS_BLOCK_M)
        out.append(Case("attention.preprocess", variant, f"{at.PREPROCESS_BLOCK_M} w4 s3", target,
                        "ftlib.kernels.attention_triton", "preprocess", ptr, (), pre, 4, 3, None, True,
                        aligned=d % 16 == 0))
    return out


# ----------------------------------------------------------------------------------------------
# Token augmentation (one kernel, one launch configuration)
# ----------------------------------------------------------------------------------------------

def augment_cases(target: str) -> list[Case]:
    """The augmentation kernel's launches: with and without labels / attention mask / pad, default block."""
    from . import _augment_kernels as jit  # the kernel
    from . import augment_triton as ag  # its launch defaults

    ptr = {"ids_ptr": "i64", "labels_ptr": "i64", "amask_ptr": "i64", "out_ids_ptr": "i64",
           "out_labels_ptr": "i64", "tags_ptr": "u8", "offsets_ptr": "i32", "cands_ptr": "i32"}
    out = []
    for variant, on in (("ids-only", False), ("labels-amask-pad", True)):
        meta = dict(HAS_LABELS=on, HAS_AMASK=on, HAS_PAD=on, PROTECT_UNLABELED=on, FOLLOW=on, DROP_MASKED=on,
                    WRITE_LABELS=on, BLOCK=ag.DEFAULT_BLOCK)
        out.append(Case("augment", variant, f"{ag.DEFAULT_BLOCK} w{ag.DEFAULT_WARPS}", target, jit.__name__,
                        "_augment_kernel", ptr, (), meta, ag.DEFAULT_WARPS, 3, None, True))
    return out


def cases(targets=("sm_90", "sm_80"), full: bool = False) -> list[Case]:
    """Every kernel x variant on ``targets``: the default configuration of each, or (``full``) every one."""
    out = []
    for t in targets:
        out += _lora_cases(t, full) + _attention_cases(t, full) + augment_cases(t)
    return out


def ci_cases() -> list[Case]:
    """The subset the test suite compiles (~90 compiles, ~4 minutes on 2 cores): every kernel's default on sm_90 and sm_80 for
    the base variant, every other variant's default on sm_90 for the passes it changes (the GEMMs and
    the attention backward, where the variants differ; the separate-key-segment variants' forward, dK/dV and dQ
on sm_90 and sm_80), QLoRA's and rank 64's GEMM defaults on sm_80
    and sm_89, and every autotuning configuration of the rank-64 GEMMs on sm_90 (the rank-r
    epilogue is where the shared-memory estimate once fell short)."""
    base = {"bf16", "bf16-d128-causal", "ids-only", "labels-amask-pad"}
    out = []
    for c in cases(("sm_90", "sm_80", "sm_89")):
        heavy = c.kernel in ("lora.fwd", "lora.dx", "attention.dkdv")
        if c.variant in base and c.target in ("sm_90", "sm_80"):
            out.append(c)
        elif c.variant in ("nf4-b64-dq", "bf16-r64") and heavy:
            out.append(c)
        elif c.target == "sm_90" and heavy and c.variant not in base:
            out.append(c)
        elif "-sepk" in c.variant and c.kernel != "attention.preprocess" and c.target in ("sm_90", "sm_80"):
            out.append(c)  # separate key segments: every pass it changes, on both targets
    out += [c for c in _lora_cases("sm_90", full=True)
            if c.variant == "bf16-r64" and c.kernel in ("lora.fwd", "lora.dx") and not c.default
            and "(pruned)" not in c.config]
    return out


def signature_key(c: Case) -> tuple:
    """What makes two cases the same compile: kernel, target, constexprs, pointer types, warps, stages, alignment."""
    return (c.kernel, c.target, tuple(sorted(c.constexprs.items())), tuple(sorted(c.ptr_types.items())),
            c.num_warps, c.num_stages, c.aligned and not c.unaligned_args)


_SELECTIONS = {"ci": lambda: ci_cases(), "defaults": lambda: cases(tuple(TARGETS)),
               "full": lambda: cases(tuple(TARGETS), full=True)}


def clean_env(cache_dir: str | None = None) -> dict:
    """The environment a compile runs in: this one without TRITON_INTERPRET (and with ``cache_dir``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; fusion is every version's default
    if cache_dir:
        env["TRITON_CACHE_DIR"] = cache_dir
    return env


def list_cases(selection: str) -> list[Case]:
    """The cases of ``selection`` (``ci``, ``defaults`` or ``full``) as the GPU launchers choose them
    (the launches the code makes: ``ftlib.lora.compile_cases.list_cases``).

    The launchers' configuration lists depend on TRITON_INTERPRET (the interpreter uses 16-wide
    tiles), so under the interpreter they are listed by a fresh process without it.
    """
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return _SELECTIONS[selection]()
    return list_in_fresh_process("ftlib.kernels.compile_check", selection)


def list_in_fresh_process(module: str, selection: str) -> list[Case]:
    """``python -m MODULE --list SELECTION`` in a process without TRITON_INTERPRET: its cases."""
    with tempfile.TemporaryDirectory() as tmp:
        dst = os.path.join(tmp, "cases.json")
        subprocess.run([sys.executable, "-m", module, "--list", selection, dst],
                       env=clean_env(), check=True, timeout=600)
        with open(dst) as f:
            return [Case(**c) for c in json.load(f)]


def run_cases(selected: list[Case], jobs: int = 1, cache_dir: str | None = None, timeout: float = 1800) -> list[Result]:
    """Compile ``selected`` in ``jobs`` fresh processes without TRITON_INTERPRET; results in order."""
    env = clean_env(cache_dir)
    parts = [p for p in ([list(range(i, len(selected), jobs)) for i in range(jobs)]) if p]
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for j, idx in enumerate(parts):
            src = os.path.join(tmp, f"in{j}.json")
            with open(src, "w") as f:
                json.dump([dataclasses.asdict(selected[i]) for i in idx], f)
            procs.append(subprocess.Popen([sys.executable, "-m", "ftlib.kernels.compile_check", src,
                                           os.path.join(tmp, f"out{j}.json")], env=env))
        for p in procs:
            if p.wait(timeout=timeout) != 0:
                raise RuntimeError(f"compile_check worker exited with {p.returncode}")
        results: list[Result | None] = [None] * len(selected)
        for j, idx in enumerate(parts):
            with open(os.path.join(tmp, f"out{j}.json")) as f:
                for i, r in zip(idx, json.load(f)):
                    results[i] = Result(**r)
    return results


def _main(argv):
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("compile_check: TRITON_INTERPRET=1 is set; the compile needs the real @triton.jit functions")
    if argv[0] == "--list":
        with open(argv[2], "w") as f:
            json.dump([dataclasses.asdict(c) for c in _SELECTIONS[argv[1]]()], f)
        return
    src, dst = argv
    with open(src) as f:
        todo = [Case(**c) for c in json.load(f)]
    with open(dst, "w") as f:
        json.dump([dataclasses.asdict(compile_case(c)) for c in todo], f)


if __name__ == "__main__":
    _main(sys.argv[1:])
