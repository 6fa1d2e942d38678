"""Peak host memory of ``load_pretrained`` against a naive load of the same checkpoint.

Each loader runs in a fresh subprocess that reports its peak resident set size
(``VmHWM``, reset through ``/proc/self/clear_refs`` after imports and warm-up;
Linux only) above the RSS it had then, so the numbers compare the loading itself:

- ``ftlib``: ``load_pretrained(dir, dtype=bfloat16)`` (meta init, tensor by tensor);
- ``safe_open``: the same meta init, tensors read with ``safetensors.safe_open(...).get_tensor``;
- ``naive``: build the model in float32, ``safetensors.torch.load_file`` the whole
  state dict, ``load_state_dict``, then ``.to(bfloat16)`` (the common recipe).

The checkpoint is generated here (random bf16 weights, sharded), of about
``--size-mb`` megabytes. Usage:

    python benchmarks/bench_load.py --csv benchmarks/results/load.csv [--size-mb 200]

Prints a table and appends one row per loader to the CSV (device, versions, date).

``--sharded``: FSDP2 loading on 1, 2 and 4 CPU ranks (torchrun, gloo), one fresh launch per world
size, through the test worker ``tests/distributed/_sharded_load_worker.py``: per rank, the peak RSS
above its baseline of the previous recipe (``load_pretrained`` of the whole model, then
``shard_model``), of ``ftlib.distributed.load_sharded`` (fp32 and QLoRA) and of resuming a sharded
checkpoint, against the bound ``model / world + 2 layers + allowance``. ``--size-mb`` is then the
fp32 size (default 250):

    python benchmarks/bench_load.py --sharded --csv benchmarks/results/load_sharded.csv
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

_LOADERS = {
    "ftlib": """
from ftlib.models import load_pretrained
model = load_pretrained(path, dtype=torch.bfloat16)
""",
    "safe_open": """
from safetensors import safe_open
from ftlib.models import LlamaForCausalLM, load_config
from ftlib.models.hub import set_tensor
import glob
with torch.device("meta"):
    model = LlamaForCausalLM(load_config(path))
for f in sorted(glob.glob(path + "/*.safetensors")):
    with safe_open(f, framework="pt") as st:
        for k in st.keys():
            set_tensor(model, k, st.get_tensor(k).to(torch.bfloat16))
model.tie_weights()
""",
    "naive": """
from safetensors.torch import load_file
from ftlib.models import LlamaForCausalLM, load_config
import glob
model = LlamaForCausalLM(load_config(path))
state = {}
for f in sorted(glob.glob(path + "/*.safetensors")):
    state.update(load_file(f))
model.load_state_dict(state, strict=False)
del state
model = model.to(torch.bfloat16)
""",
}


_PRELUDE = """
import json, os, time, torch, safetensors, ftlib.models

def vm(key):  # kB -> MB from /proc/self/status
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024

# One-time costs both loaders would pay anyway (torch registers its meta kernels on first use,
# ~150 MB of Python objects that do not grow with the model), then reset the high-water mark.
with torch.device("meta"):
    ftlib.models.LlamaForCausalLM(ftlib.models.LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
                                                           num_hidden_layers=1, num_attention_heads=2))
open("/proc/self/clear_refs", "w").write("5")
base = vm("VmRSS")
t0 = time.perf_counter()
"""


def run_loader(name: str, path: str) -> dict:
    code = (
        _PRELUDE
        + f"path = {path!r}\n"
        + _LOADERS[name]
        + "dt = time.perf_counter() - t0\n"
        "n = sum(p.numel() * p.element_size() for p in model.parameters())\n"
        "peak = vm('VmHWM') - base\n"
        "for p in model.parameters():  # what the first forward does: read every weight\n"
        "    p.sum()\n"
        "print(json.dumps({'peak_mb': peak, 'touched_mb': vm('VmRSS') - base, 'seconds': dt,\n"
        "                  'weights_mb': n / 2**20}))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def make_checkpoint(path: str, size_mb: float) -> None:
    import torch

    from ftlib.models import LlamaConfig, LlamaForCausalLM, save_pretrained

    hidden, layers, vocab = 1024, 8, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * 2816  # q,k,v,o (no GQA) + SwiGLU
    layers = max(1, round((size_mb * 2**20 / 2 - 2 * vocab * hidden) / per_layer))
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2816, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=16)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.reset_parameters()
    save_pretrained(model, path, max_shard_size="64MB")


def sharded_main(args) -> None:
    """The --sharded table: peak RSS per rank while loading on 1, 2, 4 ranks, old recipe vs sharded."""
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path[:0] = [str(tests), str(tests / "distributed")]
    from _sharded_load_worker import prepare_memory_dir
    from test_sharded_load import ALLOWANCE_MB, BIG, run_memory

    size_mb = args.size_mb or 250.0
    layer_mb = (2 * 1024 * 1024 + 2 * 1024 * 256 + 3 * 1024 * 2816) * 4 / 2**20  # q, o; k, v (GQA 4); MLP
    layers = max(1, round((size_mb - 64) / layer_mb))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = prepare_memory_dir(Path(tmp) / "ckpt", dict(BIG, num_hidden_layers=layers))
        for world in (1, 2, 4):
            recs = run_memory(root, Path(tmp) / f"out{world}", world, "--baseline")
            for r in recs:
                rows.append(r)
    print(f"model: {rows[0]['model_mb']:.0f} MB fp32, {layers} layers of {rows[0]['layer_mb']:.0f} MB; "
          f"allowance {ALLOWANCE_MB:.0f} MB; peaks are RSS above each rank's baseline")
    hdr = (f"{'world':>5} {'rank':>4} {'model MB':>8} {'bound MB':>8} {'whole+shard MB':>14} {'sharded MB':>10} "
           f"{'x whole':>7} {'qlora MB':>8} {'qlora bound':>11} {'resume MB':>9}")
    print(hdr)
    for r in rows:
        print(f"{r['world']:5d} {r['rank']:4d} {r['model_mb']:8.0f} {r['bound_mb']:8.0f} {r['whole_peak_mb']:14.0f} "
              f"{r['plain_peak_mb']:10.0f} {r['plain_peak_mb'] / r['whole_peak_mb']:7.2f} {r['qlora_peak_mb']:8.0f} "
              f"{r['qlora_bound_mb']:11.0f} {r['resume_peak_mb']:9.0f}")
    import torch

    new = not os.path.exists(args.csv)
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    with open(args.csv, "a", newline="") as f:
        w = csv.writer(f)
        keys = ["world", "rank", "model_mb", "layer_mb", "bound_mb", "whole_peak_mb", "plain_peak_mb", "nf4_mb",
                "qlora_bound_mb", "qlora_peak_mb", "resume_peak_mb", "resume_ckpt_peak_mb"]
        if new:
            w.writerow(["date", "device", "python", "torch", *keys])
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        for r in rows:
            w.writerow([now, f"cpu:{platform.processor() or platform.machine()}", platform.python_version(),
                        torch.__version__, *[r[k] if isinstance(r[k], int) else f"{r[k]:.1f}" for k in keys]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", required=True, help="CSV file to append results to")
    ap.add_argument("--size-mb", type=float, default=None, help="approximate checkpoint size (bf16; 200, "
                    "--sharded: fp32, 250)")
    ap.add_argument("--sharded", action="store_true", help="FSDP2 sharded loading on 1, 2, 4 CPU ranks")
    args = ap.parse_args()
    if args.sharded:
        return sharded_main(args)
    args.size_mb = args.size_mb or 200.0

    import safetensors
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(tmp, args.size_mb)
        disk_mb = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp)) / 2**20
        results = {name: run_loader(name, tmp) for name in _LOADERS}

    base = results["naive"]["peak_mb"]
    print(f"checkpoint on disk: {disk_mb:.0f} MB (bf16)")
    print(f"{'loader':10s} {'peak RSS MB':>12s} {'weights MB':>11s} {'peak/weights':>13s} {'vs naive':>9s} "
          f"{'RSS after touch MB':>19s} {'seconds':>8s}")
    for name, r in results.items():
        print(f"{name:10s} {r['peak_mb']:12.0f} {r['weights_mb']:11.0f} {r['peak_mb'] / r['weights_mb']:13.2f} "
              f"{r['peak_mb'] / base:9.2f} {r['touched_mb']:19.0f} {r['seconds']:8.2f}")
    print("(safe_open tensors alias a memory map of the file: their bytes become resident at first touch)")

    new = not os.path.exists(args.csv)
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    with open(args.csv, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["date", "device", "python", "torch", "safetensors", "checkpoint_mb", "loader",
                        "peak_rss_mb", "weights_mb", "ratio_vs_naive", "rss_after_touch_mb", "seconds"])
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        for name, r in results.items():
            w.writerow([now, f"cpu:{platform.processor() or platform.machine()}", platform.python_version(),
                        torch.__version__, safetensors.__version__, f"{disk_mb:.0f}", name,
                        f"{r['peak_mb']:.0f}", f"{r['weights_mb']:.0f}", f"{r['peak_mb'] / base:.3f}",
                        f"{r['touched_mb']:.0f}", f"{r['seconds']:.2f}"])


if __name__ == "__main__":
    main()
