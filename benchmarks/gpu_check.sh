#!/usr/bin/env bash
# Every GPU number in one lease: <= 11 minutes (660 s) on one H100/H200, steps in priority order.
#
#   step                                    limit   what
#   0  preflight                              45 s  versions, device, which optional packages import
#   1  warm the Triton cache                  90 s  benchmarks/warm_kernels.py: default kernel variants
#                                                   compiled in 12 parallel processes
#   2  native correctness, kernels           110 s  pytest -m gpu on tests/kernels + tests/lora (bf16 odd
#                                                   shapes, NF4 without bitsandbytes, attention varlen/GQA)
#   3  native correctness, the rest           50 s  pytest -m gpu on the other tests
#   4  headline case of each benchmark       190 s  attention 30, lora 35, train 45, augment 15, dpo 25,
#                                                   offload 20, memory 20 (each --budget-s 1: first case)
#   5  the rest of each benchmark            165 s  the same benchmarks with their remaining budgets
#                                          -----
#                                           650 s  (a step never runs past the 660 s total either)
#
# Usage: benchmarks/gpu_check.sh OUT_DIR   (PYTHON=... selects the interpreter)
# Writes into OUT_DIR: preflight.log, warm.log, pytest_kernels.log, pytest_rest.log, and per
# benchmark a log and a CSV (attention.csv, lora_gpu.csv, train CSVs, augment.csv, dpo.csv,
# offload.csv, memory.csv); the benchmarks write each row as soon as it is measured and report an
# exception per provider instead of stopping, so a step cut at its limit keeps its rows.
# Without a CUDA device it prints why and exits 0 having run nothing (a skip, not a failure).
#
# Versions: written for the lease image (torch 2.11, Triton 3.6, no bitsandbytes, no flash-attn)
# and for Triton 3.9: nothing here or in the kernels needs a 3.9-only feature. TRITON_DEFAULT_FP_FUSION
# is set because Triton 3.9 warns when it is unset (3.6 does not read it; fusion on is both defaults).
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
fi
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
PY=${PYTHON:-python}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$OUT/triton-cache}"
TOTAL=660
START=$SECONDS

# ---- 0. preflight -----------------------------------------------------------------------------
timeout 45 "$PY" - <<'EOF' 2>&1 | tee "$OUT/preflight.log"
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
pre=${PIPESTATUS[0]}
if [ "$pre" -eq 3 ]; then
    exit 0
elif [ "$pre" -ne 0 ]; then
    echo "gpu_check: preflight failed (exit $pre); see $OUT/preflight.log" >&2
    exit 1
fi

status=0
step() {  # step NAME LIMIT_S LOG CMD...: run CMD under min(LIMIT_S, time left of TOTAL), output to OUT/LOG
    local name=$1 limit=$2 log=$3
    shift 3
    local left=$((TOTAL - (SECONDS - START)))
    if [ "$left" -lt 5 ]; then
        echo "== $name: skipped, the $TOTAL s total is spent" | tee -a "$OUT/skipped.log"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit $limit s, $((SECONDS - START)) s elapsed)"
    timeout "$limit" "$@" >>"$OUT/$log" 2>&1
    local rc=$?
    tail -n 15 "$OUT/$log"
    if [ $rc -eq 124 ]; then echo "== $name: stopped at its limit ($limit s)"; fi
    [ $rc -ne 0 ] && status=1
}

# Kernels take the first fitting tile configuration instead of timing them all (results equal up to
# rounding order; compile time drops ~5x), except the attention benchmark's, which autotunes.
export FTLIB_LORA_AUTOTUNE=0
workers=""
if "$PY" -c "import xdist" 2>/dev/null; then workers="-n 8"; fi  # workers compile kernel variants in parallel

# ---- 1. warm the Triton cache -------------------------------------------------------------------
step "warm the Triton cache" 90 warm.log "$PY" benchmarks/warm_kernels.py --jobs 12

# ---- 2-3. native correctness ----------------------------------------------------------------------
FTLIB_ATTN_AUTOTUNE=0 step "pytest -m gpu tests/kernels tests/lora" 110 pytest_kernels.log \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider $workers tests/kernels tests/lora
FTLIB_ATTN_AUTOTUNE=0 step "pytest -m gpu (the rest)" 50 pytest_rest.log \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider $workers tests --ignore=tests/kernels --ignore=tests/lora

# ---- 4. one headline case per benchmark (--budget-s 1: the first case of each, in its priority order)
step "headline: bench_attention" 30 bench_attention.log \
    "$PY" benchmarks/bench_attention.py --out "$OUT/attention.csv" --budget-s 1
step "headline: bench_lora --kernels" 35 bench_lora.log \
    "$PY" benchmarks/bench_lora.py --kernels --out "$OUT/lora_gpu.csv" --budget-s 1
FTLIB_ATTN_AUTOTUNE=0 step "headline: bench_train (ftlib, hf-budget)" 45 bench_train.log \
    "$PY" benchmarks/bench_train.py --device cuda --gpu-1b --variants ftlib,hf-budget --rounds 1 \
    --docs 1200 --tokens 98304 --budget-s 1 --out "$OUT"
step "headline: bench_augment" 15 bench_augment.log \
    "$PY" benchmarks/bench_augment.py --out "$OUT/augment.csv" --budget-s 1
FTLIB_ATTN_AUTOTUNE=0 step "headline: bench_dpo" 25 bench_dpo.log \
    "$PY" benchmarks/bench_dpo.py --preset gpu --csv "$OUT/dpo.csv" --budget-s 1
step "headline: bench_offload" 20 bench_offload.log \
    "$PY" benchmarks/bench_offload.py --out "$OUT/offload.csv" --budget-s 1
step "headline: bench_memory" 20 bench_memory.log \
    "$PY" benchmarks/bench_memory.py --csv "$OUT/memory.csv" --budget-s 1

# ---- 5. the rest (cases already measured above are measured again: rows are appended) ------------
step "bench_attention" 35 bench_attention.log \
    "$PY" benchmarks/bench_attention.py --out "$OUT/attention.csv" --budget-s 25
step "bench_lora --kernels" 40 bench_lora.log \
    "$PY" benchmarks/bench_lora.py --kernels --out "$OUT/lora_gpu.csv" --budget-s 30
FTLIB_ATTN_AUTOTUNE=0 step "bench_train (hf-group, hf-pad)" 40 bench_train.log \
    "$PY" benchmarks/bench_train.py --device cuda --gpu-1b --variants hf-group,hf-pad --rounds 1 \
    --docs 1200 --tokens 98304 --budget-s 25 --out "$OUT"
step "bench_augment" 15 bench_augment.log \
    "$PY" benchmarks/bench_augment.py --out "$OUT/augment.csv" --budget-s 10
FTLIB_ATTN_AUTOTUNE=0 step "bench_dpo" 15 bench_dpo.log \
    "$PY" benchmarks/bench_dpo.py --preset gpu --csv "$OUT/dpo.csv" --budget-s 8
step "bench_offload" 10 bench_offload.log \
    "$PY" benchmarks/bench_offload.py --out "$OUT/offload.csv" --budget-s 6
step "bench_memory" 10 bench_memory.log \
    "$PY" benchmarks/bench_memory.py --csv "$OUT/memory.csv" --budget-s 6

echo "gpu_check: done in $((SECONDS - START)) s, status $status, outputs in $OUT"
exit $status
