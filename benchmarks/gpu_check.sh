#!/usr/bin/env bash
# GPU checks in one command, under 8 minutes on one H100/H200 (the limits below add up to 460 s):
#   1. every test marked `gpu` (kernels and the distributed path, natively on CUDA);
#   2. the attention kernel benchmark (TFLOP/s vs SDPA and flash-attn);
#   3. the end-to-end LoRA training step against transformers + peft (Llama-3.2-1B shape, bf16, MFU);
#   4. the LoRA kernel benchmark (fused vs unfused vs PEFT);
#   5. the token augmentation kernel benchmark (GB/s vs copy bandwidth);
#   6. the DPO step benchmark (packed vs padded pairs);
#   7. activation offloading vs checkpointing vs save_on_cpu;
#   8. the memory calculator against the measured peak of a training step.
# Usage: benchmarks/gpu_check.sh OUT_DIR   (PYTHON=... selects the interpreter)
# Writes into OUT_DIR: pytest_gpu.log, and per benchmark a log and a CSV: bench_attention.log +
# attention.csv, bench_train.log + train.csv, bench_lora.log + lora_gpu.csv, bench_augment.log +
# augment.csv, bench_dpo.log + dpo.csv, bench_offload.log + offload.csv, bench_memory.log + memory.csv.
# Each benchmark stops starting new cases at its --budget-s (rows already written stay), and is
# killed at its limit. Exits non-zero when a step fails; later steps still run.
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

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to $PY; nothing to check." | tee "$OUT/pytest_gpu.log"
    exit 1
fi
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"

status=0
# Kernels take the first fitting tile configuration instead of timing them all (results equal up to
# rounding order; compile time drops ~5x) everywhere except the attention benchmark, which autotunes.
export FTLIB_LORA_AUTOTUNE=0

step() {  # step NAME LIMIT_S LOG CMD...: run CMD under a time limit, tee its output into OUT/LOG
    local name=$1 limit=$2 log=$3
    shift 3
    echo "== $name (limit $limit s)"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$log" || status=1
}

workers=""
if "$PY" -c "import xdist" 2>/dev/null; then workers="-n 4"; fi  # workers compile kernel variants in parallel
FTLIB_ATTN_AUTOTUNE=0 step "pytest -m gpu" 120 pytest_gpu.log \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider $workers tests
step "bench_attention.py" 70 bench_attention.log \
    "$PY" benchmarks/bench_attention.py --out "$OUT/attention.csv" --budget-s 55
FTLIB_ATTN_AUTOTUNE=0 step "bench_train.py --device cuda --gpu-1b" 70 bench_train.log \
    "$PY" benchmarks/bench_train.py --device cuda --gpu-1b --variants ftlib,hf-budget,hf-group,hf-pad --rounds 1 \
    --docs 1200 --tokens 98304 --budget-s 40 --out "$OUT"
step "bench_lora.py --kernels" 45 bench_lora.log \
    "$PY" benchmarks/bench_lora.py --kernels --out "$OUT/lora_gpu.csv" --budget-s 30
step "bench_augment.py" 30 bench_augment.log \
    "$PY" benchmarks/bench_augment.py --out "$OUT/augment.csv" --budget-s 18
FTLIB_ATTN_AUTOTUNE=0 step "bench_dpo.py --preset gpu" 45 bench_dpo.log \
    "$PY" benchmarks/bench_dpo.py --preset gpu --csv "$OUT/dpo.csv" --budget-s 28
step "bench_offload.py" 40 bench_offload.log \
    "$PY" benchmarks/bench_offload.py --out "$OUT/offload.csv" --budget-s 25
step "bench_memory.py" 40 bench_memory.log \
    "$PY" benchmarks/bench_memory.py --csv "$OUT/memory.csv" --budget-s 25

echo "gpu_check: done, status $status, outputs in $OUT"
exit $status
