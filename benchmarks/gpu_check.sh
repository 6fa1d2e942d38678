#!/usr/bin/env bash
# Every GPU number in one command of at most 540 s on one H100/H200, steps in priority order.
#
#   step                                       limit  what
#   preflight                                    25 s  versions, device, which optional packages import
#                                                      (a slow or failed preflight is noted; the steps run)
#   warm                                         55 s  benchmarks/warm_kernels.py: default kernel variants
#                                                      compiled in 12 parallel processes (the headline's first)
#   headline_8b                                 165 s  benchmarks/bench_8b.py: Llama-3-8B shape, 32 layers,
#                                                      packed 4096-token rows; ftlib LoRA, ftlib QLoRA (NF4),
#                                                      transformers + peft (sdpa, length-grouped padding)
#   attention                                    30 s  bench_attention: fwd / bwd TFLOP/s vs SDPA (d128 first)
#   lora_kernels                                 30 s  bench_lora --kernels: fused vs cuBLAS + 2 small GEMMs
#   pytest_kernels                               80 s  pytest -m gpu tests/kernels tests/lora
#   pytest_rest                                  35 s  pytest -m gpu on the rest, the torchrun test left out
#   pytest_distributed                           55 s  tests/distributed/test_gpu.py (torchrun + FSDP2 +
#                                                      checkpoint + exports) alone, with its own limit
#   dpo                                          20 s  bench_dpo --preset gpu
#   offload                                      10 s  bench_offload
#   memory                                       10 s  bench_memory
#   augment                                      10 s  bench_augment
#                                             -----
#                                               525 s  plus packing the archive after each step (< 1 s);
#                                                      no step runs past the 540 s total either
#
# Usage: benchmarks/gpu_check.sh [--dry-run] OUT_DIR     (PYTHON=... selects the interpreter)
#
# OUT_DIR receives two files, whatever happens: summary.txt (every headline number, one line each,
# appended by the benchmarks the moment each is measured - benchmarks/_summary.py - plus one line per
# step with its exit status and time, so a run cut at any point leaves it true) and results.tar.gz
# (every CSV and log, re-packed after each step; each log capped at its last 4 MiB). Logs, CSVs,
# built weights and the Triton cache live in a scratch directory outside OUT_DIR ($GPU_CHECK_SCRATCH,
# default a fresh one under ${TMPDIR:-/tmp}), removed at the end unless GPU_CHECK_KEEP=1.
#
# --dry-run walks every step with its work stubbed (each step writes its log and CSV stubs and its
# summary lines marked "dry"), without a GPU: OUT_DIR ends up with the same names a real run writes.
# Without a CUDA device (and without --dry-run) it writes one line saying why and exits 0 (a skip).
#
# Versions: written for the lease image (torch 2.11, Triton 3.6, no bitsandbytes, no flash-attn)
# and for Triton 3.9. TRITON_DEFAULT_FP_FUSION is set because Triton 3.9 warns when it is unset.
set -uo pipefail

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
if [ $# -ne 1 ]; then
    echo "usage: $0 [--dry-run] OUT_DIR" >&2
    exit 2
fi
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
PY=${PYTHON:-python}
cd "$(dirname "$0")/.."
REPO=$PWD
SCRATCH=${GPU_CHECK_SCRATCH:-$(mktemp -d "${TMPDIR:-/tmp}/ftlib_gpu_check.XXXXXX")}
case "$SCRATCH/" in "$OUT/"*) echo "gpu_check: the scratch dir must be outside OUT_DIR" >&2; exit 2 ;; esac
RES=$SCRATCH/results  # what results.tar.gz holds
mkdir -p "$RES" "$SCRATCH/work" "$SCRATCH/pack/results"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$SCRATCH/triton-cache}"
export FTLIB_BENCH_WORK="$SCRATCH/work"  # built weights, shared by the benchmarks, removed with SCRATCH
export FTLIB_SUMMARY="$OUT/summary.txt"
export TMPDIR="$SCRATCH/work"
TOTAL=540
RESERVE=5  # kept for the last archive
START=$SECONDS
: >"$FTLIB_SUMMARY"
rm -f "$OUT/results.tar.gz"

cleanup() { [ "${GPU_CHECK_KEEP:-0}" = 1 ] || rm -rf "$SCRATCH"; }
trap cleanup EXIT

sline() { printf '%s\n' "$*" >>"$FTLIB_SUMMARY"; }

pack() {  # results.tar.gz from RES, every file capped at its last 4 MiB, written to a temp name, renamed
    local f
    rm -rf "$SCRATCH/pack/results" && mkdir -p "$SCRATCH/pack/results"
    for f in "$RES"/*; do
        [ -f "$f" ] || continue
        tail -c 4194304 "$f" >"$SCRATCH/pack/results/$(basename "$f")"
    done
    cp "$FTLIB_SUMMARY" "$SCRATCH/pack/results/summary.txt"
    tar -C "$SCRATCH/pack" -czf "$OUT/.results.tar.gz.tmp" results && mv -f "$OUT/.results.tar.gz.tmp" "$OUT/results.tar.gz"
}

# ---- preflight --------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
    sline "gpu_check: DRY RUN (stubbed work; every number below is marked dry)"
    echo "preflight: dry run, nothing imported" >"$RES/preflight.log"
else
    timeout -k 5 25 "$PY" - >"$RES/preflight.log" 2>&1 <<'EOF'
import importlib, sys
for name in ("torch", "triton", "numpy", "pytest", "xdist", "transformers", "peft", "bitsandbytes", "flash_attn"):
    try:
        mod = importlib.import_module(name)
        print(f"preflight: {name:13s} {getattr(mod, '__version__', 'ok')}")
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        print(f"preflight: {name:13s} not importable ({type(e).__name__}); steps that need it skip")
import torch
if not torch.cuda.is_available():
    print(f"gpu_check: SKIPPED - no CUDA device visible to {sys.executable} (torch {torch.__version__}, "
          f"CUDA build {torch.version.cuda}); nothing to measure.")
    sys.exit(3)
print(f"preflight: device {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), "
      f"CUDA {torch.version.cuda}")
EOF
    pre=$?
    if [ "$pre" -eq 3 ]; then
        reason=$(grep '^gpu_check: SKIPPED' "$RES/preflight.log")
        sline "$reason"
        pack
        echo "$reason"
        exit 0
    elif [ "$pre" -ne 0 ]; then
        # a cold machine can be slow to import everything: note it and measure anyway (each step
        # has its own limit and reports its own failure)
        sline "gpu_check: preflight did not finish (exit $pre, 124 = its 25 s limit); steps run anyway"
        echo "gpu_check: preflight did not finish (exit $pre); see results.tar.gz:results/preflight.log" >&2
    fi
    cat "$RES/preflight.log"
    sline "$(grep '^preflight: device' "$RES/preflight.log" || echo 'preflight: device unknown')"
    sline "$(grep -E '^preflight: (torch|triton) ' "$RES/preflight.log" | tr -s ' ' | paste -sd ';' -)"
fi
pack

status=0
STEPS_RUN=""
step() {  # step NAME LIMIT_S CMD...: CMD under min(LIMIT_S, time left), output to RES/NAME.log, then pack
    local name=$1 limit=$2
    shift 2
    local left=$((TOTAL - RESERVE - (SECONDS - START)))
    STEPS_RUN="$STEPS_RUN $name:$limit"
    if [ "$left" -lt 5 ]; then
        sline "step $name: skipped, the $TOTAL s total is spent"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit $limit s, $((SECONDS - START)) s elapsed)"
    local t0=$SECONDS rc
    if [ "$DRY" = 1 ]; then
        "$PY" "$REPO/benchmarks/_dry_step.py" "$name" "$RES" "$@" >>"$RES/$name.log" 2>&1
        rc=$?
    else
        timeout -k 5 "$limit" "$@" >>"$RES/$name.log" 2>&1
        rc=$?
    fi
    tail -n 8 "$RES/$name.log"
    local how="exit $rc"
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && how="stopped at its limit"
    sline "step $name: $how in $((SECONDS - t0)) s (limit $limit s)$([ "$DRY" = 1 ] && echo ' [dry]')"
    [ $rc -ne 0 ] && status=1
    pack
}

pytest_line() {  # the pytest summary line of a log, into summary.txt
    local name=$1 line
    line=$(grep -E '(passed|failed|error|skipped|no tests ran)' "$RES/$name.log" | tail -n 1)
    sline "$name: ${line:-no pytest summary line (cut before the end)}"
}

# Kernels take the first fitting tile configuration instead of timing them all (autotune off: no
# timing at all, on 3.6 as on 3.9), except the attention benchmark's, which autotunes.
export FTLIB_LORA_AUTOTUNE=0
workers=""
if [ "$DRY" = 1 ] || "$PY" -c "import xdist" 2>/dev/null; then workers="-n 8"; fi

step warm 55 "$PY" benchmarks/warm_kernels.py --jobs 12
FTLIB_ATTN_AUTOTUNE=0 step headline_8b 165 "$PY" benchmarks/bench_8b.py --out "$RES" --layers 32 --budget-s 155
step attention 30 "$PY" benchmarks/bench_attention.py --out "$RES/attention.csv" --budget-s 20
step lora_kernels 30 "$PY" benchmarks/bench_lora.py --kernels --out "$RES/lora_gpu.csv" --budget-s 20
FTLIB_ATTN_AUTOTUNE=0 step pytest_kernels 80 \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider $workers tests/kernels tests/lora
pytest_line pytest_kernels
FTLIB_ATTN_AUTOTUNE=0 step pytest_rest 35 \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider $workers tests --ignore=tests/kernels --ignore=tests/lora \
    --deselect tests/distributed/test_gpu.py::test_fsdp2_bf16_on_cuda
pytest_line pytest_rest
FTLIB_ATTN_AUTOTUNE=0 step pytest_distributed 55 \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/distributed/test_gpu.py
pytest_line pytest_distributed
FTLIB_ATTN_AUTOTUNE=0 step dpo 20 "$PY" benchmarks/bench_dpo.py --preset gpu --csv "$RES/dpo.csv" --budget-s 12
step offload 10 "$PY" benchmarks/bench_offload.py --out "$RES/offload.csv" --budget-s 4
step memory 10 "$PY" benchmarks/bench_memory.py --csv "$RES/memory.csv" --budget-s 4
step augment 10 "$PY" benchmarks/bench_augment.py --out "$RES/augment.csv" --budget-s 4

sline "gpu_check: done in $((SECONDS - START)) s, status $status (steps:$STEPS_RUN)"
pack
echo "gpu_check: done in $((SECONDS - START)) s, status $status; $OUT: $(ls "$OUT" | paste -sd ' ' -)"
exit $status
