"""Stubbed work for ``gpu_check.sh --dry-run``: one step's log, CSV and summary lines, marked dry.

    python benchmarks/_dry_step.py NAME RESULTS_DIR CMD...

Writes what the real step would leave behind under the same names (the CSVs named by the command's
``--out`` / ``--csv``; ``bench_8b.py`` runs itself with ``--dry-run``), so a dry run produces OUT
exactly as a real one lays it out, without a GPU and in about a second per step.
"""

from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _summary import append_row, summary  # noqa: E402

# the summary lines each benchmark writes in a real run (bench_*.py: summary(...)), here marked dry
DRY_LINES = {
    "attention": [f"attention d128 causal {layout} T=4096 GQA 32:8 {mode}: dry" for layout in ("packed", "dense")
                  for mode in ("fwd", "bwd", "fwd+bwd")],
    "lora_kernels": [f"lora {shape} r{r} {base} {mode} (8192 tokens): dry" for shape in ("4096x4096", "4096x14336")
                     for r in (16, 64) for base in ("bf16", "nf4") for mode in ("fwd", "fwd+bwd")],
    "dpo": [f"dpo {v}: dry" for v in ("pairloader", "pairloader_inproc", "flat", "padded")],
    "offload": [f"offload {c}: dry" for c in ("ckpt_all", "offload_all", "save_on_cpu", "ckpt_3of4")],
}


def main() -> int:
    name, cmd = sys.argv[1], sys.argv[3:]  # argv[2]: the results dir (the CSV paths in CMD point into it)
    print(f"dry: step {name} would run: {' '.join(cmd)}")
    if any(a.endswith("bench_8b.py") for a in cmd):
        return subprocess.run([*cmd, "--dry-run"]).returncode
    for flag in ("--out", "--csv"):
        if flag in cmd:
            path = cmd[cmd.index(flag) + 1]
            if path.endswith(".csv"):
                append_row(path, ["date", "status"], ["dry", "dry"])
    for line in DRY_LINES.get(name, []):
        summary(line)
    if "pytest" in cmd:
        print("dry: stubbed, no tests ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
