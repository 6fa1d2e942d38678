"""Every Triton kernel compiled for the GPUs it is written for, on a machine without one.

``ftlib.kernels.compile_check`` compiles each kernel x variant x tile configuration for sm_90
(H100/H200), sm_80 (A100) and sm_89 (L40S/4090) with the ptxas bundled in the triton wheel, in a
subprocess without TRITON_INTERPRET (the CPU interpreter never builds the kernels, so it cannot
see a compile error, a shared-memory overflow or a register spill). Per compile this asserts:

- it compiles (the interpreter runs Python: a return-type mismatch between constexpr branches or a
  zero-length ``tl.arange`` in a branch not taken there only fails on a real target);
- its shared memory fits the target (sm_90 232,448 B, sm_80 166,912 B, sm_89 101,376 B per block);
- the launcher's estimate, which prunes the configurations, is not below the compiled figure;
- the configuration taken without autotuning spills no registers (``STACK`` 0 in
  ``cuobjdump -res-usage``).

The CI subset (``compile_check.ci_cases``: defaults of every kernel on sm_90 and sm_80, one
default per variant) takes ~3 minutes on 2 cores; the full sweep of every configuration is
``benchmarks/compile_report.py``. The Triton cache goes to a directory of this run
(``FTLIB_COMPILE_CACHE`` names one to keep between runs).
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")

from ftlib.kernels import compile_check as cc  # noqa: E402
from ftlib.lora import compile_cases  # noqa: E402


def _have_nvidia_tools() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        return False
    return os.path.exists(cc.cuobjdump_path())


pytestmark = pytest.mark.skipif(not _have_nvidia_tools(), reason="triton without its bundled CUDA tools")

# the hand-written CI subset, then a sample of the launches the code makes (ftlib.lora.compile_cases.recorded_ci_cases:
# LoRALinear under bf16 autocast with fp32 adapters, the attention op, as shipped models launch them)
CASES = cc.list_cases("ci") + compile_cases.list_cases("recorded-ci") if _have_nvidia_tools() else []
IDS = [f"{c.kernel}-{c.variant}-{c.target}-{c.config.replace(' ', '_')}" for c in CASES]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cache = os.environ.get("FTLIB_COMPILE_CACHE") or str(tmp_path_factory.mktemp("triton-cache"))
    return dict(zip(IDS, cc.run_cases(CASES, jobs=2, cache_dir=cache)))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_compiles_and_fits(case, results, request):
    r = results[request.node.callspec.id]
    assert not r.error, f"{case.kernel} {case.variant} {case.config} does not compile for {case.target}: {r.error}"
    limit = cc.TARGETS[case.target][1]
    assert r.shared <= limit, (f"{case.kernel} {case.variant} {case.config}: {r.shared} B of shared memory > "
                               f"{limit} B on {case.target}")
    if case.estimate is not None:
        assert case.estimate >= r.shared, (f"{case.kernel} {case.variant} {case.config} on {case.target}: the "
                                           f"launcher estimates {case.estimate} B, the compiled kernel needs {r.shared} B")


@pytest.mark.parametrize("case", [c for c in CASES if c.default], ids=[i for c, i in zip(CASES, IDS) if c.default])
def test_default_config_does_not_spill(case, results, request):
    r = results[request.node.callspec.id]
    assert not r.error, f"does not compile: {r.error}"
    assert r.spill == 0, (f"{case.kernel} {case.variant} {case.config} on {case.target}: {r.registers} registers "
                          f"and {r.spill} B of stack (register spill) in the configuration taken without autotuning")


def test_ci_subset_covers_every_kernel_and_variant():
    # every kernel on both main targets, every variant somewhere: a variant dropped from the list
    # (or a kernel the launchers stop reporting) would silently leave it unchecked
    every = cc.list_cases("defaults")
    kernels = {c.kernel for c in every}
    for target in ("sm_90", "sm_80"):
        assert kernels <= {c.kernel for c in CASES if c.target == target}
    assert {c.variant for c in every} <= {c.variant for c in CASES}
    # the GPU launchers' tiles, not the interpreter's 16-wide ones
    first = {(c.kernel, c.variant, c.target): c.config for c in CASES if c.default}
    assert first[("lora.fwd", "bf16", "sm_90")] == "128x256x64 w8 s3"
    assert first[("attention.fwd", "bf16-d128-causal", "sm_90")] == "128x64 w8 s3"


def test_recorded_launches_cover_the_sweep():
    # the recorder sees what the code launches: fp32 adapters beside bf16 activations, varlen and dense
    # attention at head dims 64-256 causal and not, unaligned ranks (r = 200 here)
    rec = compile_cases.list_cases("recorded")
    assert {c.ptr_types.get("A") for c in rec if c.kernel == "lora.down"} == {"fp32"}
    assert {c.ptr_types.get("X") for c in rec if c.kernel == "lora.fwd"} == {"bf16"}
    att = {(c.constexprs["HEAD_DIM"], c.constexprs["CAUSAL"], c.constexprs["IS_VARLEN"])
           for c in rec if c.kernel == "attention.fwd"}
    assert {(d, causal, True) for d in (64, 96, 128, 256) for causal in (True, False)} <= att
    assert any(c.constexprs["BLOCK_R"] == 256 and "R" in c.unaligned_args for c in rec if c.kernel == "lora.down")
    assert all(c.source for c in rec) and any(c.source.startswith("shipped") for c in rec)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FTLIB_COMPILE_RECORDED") != "1",
                    reason="88 more compiles (~4 min on 2 cores): set FTLIB_COMPILE_RECORDED=1, or run "
                    "benchmarks/compile_report.py --selection recorded")
def test_every_shipped_launch_compiles_without_spill(tmp_path):
    # every launch the shipped models make (head dims 64 / 128, ranks <= 64), default tiles on sm_90;
    # the whole sweep, both Triton versions: benchmarks/compile_report.py --selection recorded
    shipped = compile_cases.list_cases("recorded-shipped")
    bad = []
    for c, r in zip(shipped, cc.run_cases(shipped, jobs=2, cache_dir=str(tmp_path))):
        if r.error or r.spill or r.shared > cc.TARGETS[c.target][1] or (c.estimate is not None and c.estimate < r.shared):
            bad.append(f"{c.kernel} {c.variant} {c.config}: {r}")
    assert not bad, "\n".join(bad)
