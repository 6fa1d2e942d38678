#!/usr/bin/env bash
# GPU checks in one command (under 8 minutes on one H100/H200):
#   1. every test marked `gpu` (correctness of the kernels, natively on CUDA), and
#   2. the attention kernel benchmark (TFLOP/s vs SDPA and flash-attn),
#   3. the end-to-end LoRA training step against transformers + peft (bench_train.py, Llama-3.2-1B shape).
# Usage: benchmarks/gpu_check.sh OUT_DIR   (PYTHON=... selects the interpreter)
# Writes OUT_DIR/pytest_gpu.log, OUT_DIR/bench_attention.log, OUT_DIR/attention.csv, OUT_DIR/bench_train.log
# and OUT_DIR/train.csv.

#   3. the LoRA kernel benchmark (fused vs unfused vs PEFT),
#   4. the token augmentation kernel benchmark (GB/s vs copy bandwidth),
#   5. the DPO step benchmark (packed vs padded pairs).
# Usage: benchmarks/gpu_check.sh OUT_DIR   (PYTHON=... selects the interpreter)
# Writes OUT_DIR/pytest_gpu.log, OUT_DIR/bench_attention.log, OUT_DIR/attention.csv,
# OUT_DIR/bench_lora.log, OUT_DIR/lora_gpu.csv, OUT_DIR/bench_augment.log, OUT_DIR/augment.csv,
# OUT_DIR/bench_dpo.log and OUT_DIR/dpo.csv.

# Writes OUT_DIR/pytest_gpu.log, OUT_DIR/bench_attention.log and OUT_DIR/attention.csv
# (and OUT_DIR/bench_offload.log, OUT_DIR/offload.csv).
# Exits non-zero when a step fails; later steps still run.
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

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to $PY; nothing to check." | tee "$OUT/pytest_gpu.log"
    exit 1
fi
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"

status=0
# LoRA kernels: the first fitting tile configuration, no autotune timing (compile time; the same
# switch as FTLIB_ATTN_AUTOTUNE below), for the gpu tests and the LoRA benchmark.
export FTLIB_LORA_AUTOTUNE=0
# Correctness first. FTLIB_ATTN_AUTOTUNE=0 takes the first fitting kernel configuration instead of
# timing them all (results are the same up to rounding order; compile time drops ~5x); pytest-xdist
# workers compile the kernel variants in parallel.
workers=""
if "$PY" -c "import xdist" 2>/dev/null; then workers="-n 4"; fi
echo "== pytest -m gpu (limit 200 s)"
FTLIB_ATTN_AUTOTUNE=0 timeout 200 "$PY" -m pytest -m gpu -q -p no:cacheprovider $workers tests \
    2>&1 | tee "$OUT/pytest_gpu.log" || status=1

# Benchmark: autotuned kernels; stops starting new cases after 190 s (partial rows stay in the CSV).
echo "== benchmarks/bench_attention.py (limit 240 s)"
PYTHONUNBUFFERED=1 timeout 240 "$PY" benchmarks/bench_attention.py --out "$OUT/attention.csv" --budget-s 190 \
    2>&1 | tee "$OUT/bench_attention.log" || status=1

# ---- end-to-end LoRA step (benchmarks/bench_train.py): Llama-3.2-1B shape, bf16, random weights ----
# ftlib vs transformers+peft (length-grouped and plain dynamic padding), real tokens/s, MFU against the
# device's bf16 peak, peak memory, held-out loss; rows in OUT_DIR/train.csv. Stops starting runs after 90 s.
echo "== benchmarks/bench_train.py --device cuda --gpu-1b (limit 150 s)"
PYTHONUNBUFFERED=1 FTLIB_ATTN_AUTOTUNE=0 timeout 150 "$PY" benchmarks/bench_train.py --device cuda --gpu-1b \
    --variants ftlib,hf-group,hf-pad --rounds 1 --docs 1200 --tokens 98304 --budget-s 90 --out "$OUT" \
    2>&1 | tee "$OUT/bench_train.log" || status=1

# LoRA benchmark: fused vs unfused vs PEFT, priority cases first; stops starting new cases after 65 s.
echo "== benchmarks/bench_lora.py --kernels (limit 90 s)"
PYTHONUNBUFFERED=1 timeout 90 "$PY" benchmarks/bench_lora.py --kernels --out "$OUT/lora_gpu.csv" --budget-s 65 \
    2>&1 | tee "$OUT/bench_lora.log" || status=1

# Token augmentation kernel: GB/s vs copy bandwidth and vs the PyTorch reference (limit 60 s);
# writes OUT_DIR/bench_augment.log and OUT_DIR/augment.csv.
echo "== benchmarks/bench_augment.py (limit 60 s)"
PYTHONUNBUFFERED=1 timeout 60 "$PY" benchmarks/bench_augment.py --out "$OUT/augment.csv" --budget-s 40 \
    2>&1 | tee "$OUT/bench_augment.log" || status=1

# DPO step, packed vs padded pairs (real tokens/s, peak memory); stops starting passes after 90 s.
echo "== benchmarks/bench_dpo.py (limit 150 s)"
PYTHONUNBUFFERED=1 timeout 150 "$PY" benchmarks/bench_dpo.py --preset gpu --csv "$OUT/dpo.csv" --budget-s 90 \
    2>&1 | tee "$OUT/bench_dpo.log" || status=1

# Activation offloading vs checkpointing vs save_on_cpu: step time and peak memory (stops new rounds at 90 s).
echo "== benchmarks/bench_offload.py (limit 120 s)"
PYTHONUNBUFFERED=1 timeout 120 "$PY" benchmarks/bench_offload.py --out "$OUT/offload.csv" --budget-s 90 \
    2>&1 | tee "$OUT/bench_offload.log" || status=1

echo "gpu_check: done, status $status, outputs in $OUT"
exit $status
