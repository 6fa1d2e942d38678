"""Compile every Triton kernel for sm_90 / sm_80 / sm_89 and tabulate shared memory, registers, spills.

No GPU needed: ``ftlib.kernels.compile_check`` runs Triton's compiler for each target with the ptxas
bundled in the triton wheel and reads ``cuobjdump -res-usage``. Selections:

  defaults  the configuration each launch takes without autotuning, every kernel x variant x target
  full      every configuration the launchers may choose (autotuning), plus the ones they prune on
            a target (marked "(pruned)": compiled for the record, never launched there)
  recorded  the launches the code makes (``ftlib.lora.compile_cases``: LoRALinear under bf16
            autocast with fp32 adapters, the attention op; head dims 16-256, causal and not, varlen
            and dense, ranks 8-256 incl. unaligned, NF4, DoRA, dropout), each launch's default
            configuration on sm_90 and sm_80; ``source`` names the driving case ("shipped: ..." for
            the launches Llama-class models make: head dims 64 / 128, ranks <= 64)

Rows (CSV): kernel, variant, config, target, shared_bytes, registers, spill_bytes, estimate
(the launcher's shared-memory estimate, empty where it makes none), default (1 for the
configuration taken without autotuning), fits (shared memory within the target's limit), error.
A row is written as soon as its chunk compiles, so an interrupted sweep keeps what it measured.

    nice python benchmarks/compile_report.py --out benchmarks/results/compile.csv --jobs 2
    python benchmarks/compile_report.py --selection defaults --targets sm_90,sm_80
    nice python benchmarks/compile_report.py --kernels lora.fwd,lora.dx --jobs 2   # redo two kernels' rows
    nice python benchmarks/compile_report.py --selection recorded --targets sm_90 \
        --out benchmarks/results/compile_recorded_triton3.9.csv   # per Triton version installed

With ``--kernels``, only those kernels are compiled and the other rows of ``--out`` (as they were,
for the selected targets and every other target) are kept, so one kernel's change does not need
the whole sweep again.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402

from ftlib.kernels import compile_check as cc  # noqa: E402

FIELDS = ["kernel", "variant", "config", "target", "triton", "shared_bytes", "registers", "spill_bytes", "estimate",
          "default", "fits", "source", "error"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/compile.csv")
    ap.add_argument("--selection", default="full", choices=("defaults", "full", "ci", "recorded", "recorded-ci", "recorded-shipped"))
    ap.add_argument("--targets", default=",".join(cc.TARGETS), help="comma-separated subset of " + ",".join(cc.TARGETS))
    ap.add_argument("--jobs", type=int, default=max(1, min(16, os.cpu_count() or 1)))
    ap.add_argument("--cache-dir", default=None, help="Triton cache (default: a fresh directory for this run)")
    ap.add_argument("--kernels", default=None, help="comma-separated kernels to redo (e.g. lora.fwd,lora.dx); "
                    "the other rows of --out are kept")
    ap.add_argument("--chunk", type=int, default=32, help="cases compiled between two CSV flushes")
    args = ap.parse_args()
    targets = set(args.targets.split(","))
    if args.selection.startswith("recorded"):  # the launches the code makes (built from the adapters)
        from ftlib.lora import compile_cases

        listed = compile_cases.list_cases(args.selection)
    else:
        listed = cc.list_cases(args.selection)
    todo = [c for c in listed if c.target in targets]
    kept = []
    if args.kernels:
        redo = set(args.kernels.split(","))
        unknown = redo - {c.kernel for c in todo}
        if unknown:
            ap.error(f"--kernels: no such kernel {sorted(unknown)} in the selection")
        todo = [c for c in todo if c.kernel in redo]
        if os.path.exists(args.out):
            with open(args.out, newline="") as fh:
                kept = [r for r in csv.DictReader(fh) if not (r["kernel"] in redo and r["target"] in targets)]
    # defaults first: an interrupted sweep still has the table that matters most
    todo.sort(key=lambda c: (not c.default, c.target != "sm_90", c.kernel))
    print(f"compile_report: {len(todo)} compiles, {args.jobs} processes", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t0 = time.monotonic()
    bad = 0
    with tempfile.TemporaryDirectory() as tmp, open(args.out, "w", newline="") as fh:
        cache = args.cache_dir or os.path.join(tmp, "triton-cache")
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(kept)
        for i in range(0, len(todo), args.chunk):
            part = todo[i:i + args.chunk]
            for c, r in zip(part, cc.run_cases(part, jobs=args.jobs, cache_dir=cache)):
                limit = cc.TARGETS[c.target][1]
                fits = not r.error and r.shared <= limit
                pruned = "(pruned)" in c.config  # never launched on this target: recorded only
                under = c.estimate is not None and not r.error and c.estimate < r.shared
                bad += not pruned and (not fits or (c.default and r.spill > 0) or under)
                w.writerow({"kernel": c.kernel, "variant": c.variant, "config": c.config, "target": c.target,
                            "triton": triton.__version__, "source": c.source,
                            "shared_bytes": r.shared, "registers": r.registers, "spill_bytes": r.spill,
                            "estimate": "" if c.estimate is None else c.estimate, "default": int(c.default),
                            "fits": int(fits), "error": r.error})
            fh.flush()
            print(f"  {min(i + args.chunk, len(todo))}/{len(todo)} ({time.monotonic() - t0:.0f} s)", flush=True)
    print(f"compile_report: wrote {args.out}; {bad} rows break a rule (no fit, default spills, estimate "
          f"below compiled, or no compile)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
