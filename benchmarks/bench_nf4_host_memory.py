"""Host memory of quantizing one weight to NF4 on the CPU: the peak above the bf16 weight, bytes per weight.

The memory calculator's ``load host`` column (``ftlib.distributed.memory``) counts, for a
linear that becomes NF4 while loading, its bf16 weight and the NF4 result; the quantizer's own
temporaries are stated beside it, not counted (a GPU machine quantizes on the device). This
measures them: ``ftlib.kernels.nf4_ref.quantize_nf4`` on a bf16 weight of each shape, each in a
fresh process, the peak resident memory (``VmHWM``, reset through ``/proc/self/clear_refs``)
minus the resident memory with the weight already allocated. Linux only.

    python benchmarks/bench_nf4_host_memory.py --csv benchmarks/results/nf4_host_memory.csv
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SHAPES = [(4096, 4096), (4096, 8192), (8192, 8192)]

CHILD = r"""
import json, sys, torch
from ftlib.kernels.nf4_ref import quantize_nf4
out_f, in_f = int(sys.argv[1]), int(sys.argv[2])
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
w = torch.randn(out_f, in_f, dtype=torch.bfloat16)
base = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
codes, absmax = quantize_nf4(w)
print(json.dumps({"peak_above_weight": status("VmHWM") - base, "result": codes.nbytes + absmax.nbytes}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--csv", default=None, help="append one row per shape")
    args = p.parse_args()
    rows = []
    for out_f, in_f in SHAPES:
        r = subprocess.run([sys.executable, "-c", CHILD, str(out_f), str(in_f)], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), check=True)
        m = json.loads(r.stdout.strip().splitlines()[-1])
        n = out_f * in_f
        rows.append({"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "shape": f"{out_f}x{in_f}",
                     "weights": n, "peak_bytes_per_weight": round(m["peak_above_weight"] / n, 3),
                     "result_bytes_per_weight": round(m["result"] / n, 4)})
        print(f"{out_f:>6} x {in_f:<6} peak above the bf16 weight {rows[-1]['peak_bytes_per_weight']:6.2f} B/weight, "
              f"result (codes + absmax) {rows[-1]['result_bytes_per_weight']:.4f} B/weight")
    if args.csv:
        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
