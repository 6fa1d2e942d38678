"""The command-line vocabulary every training script shares: flag groups, ``--config``, CPU threads.

A script builds its parser from these groups and adds only what is its own (LoRA, engine, DPO
flags), so a flag has one name, one meaning and one default in every script and in
``python -m ftlib.data build`` (whose record-format flags, ``ftlib.data.cli.add_format_flags``,
are the same ones :func:`add_data_flags` adds):

    p = FlagParser()                           # argparse, with one-line errors
    add_model_flags(p); add_data_flags(p); add_loop_flags(p); add_eval_flags(p); add_output_flags(p)
    args = parse_with_config(p, argv)          # --config FILE under the flags, then checks

``--config FILE`` reads flag values from YAML (with pyyaml installed) or JSON, keys spelled as the
flags without dashes (``lr``, ``grad_accum``, ``grad-accum`` too); flags given on the command
line override it. A run's ``run.json`` is such a file (its ``args``): ``--config runs/x/run.json
--out runs/y`` runs the same settings again. Errors a user can cause are one line on stderr
naming the flag and what to do (``parser.error``, exit 2), never a traceback.

CPU threads (:func:`cpu_threads`). Without ``--threads`` a CPU run uses the CPUs this process may
run on (its affinity mask, not the machine's count) less one per DataLoader worker, at most 8:
on a laptop with 8 cores and 2 workers, 6; on a 2-core machine, 1; on a 128-core server, 8.
torch's own default (every physical core) oversubscribes the cores the loader workers and the
tokenizer need, and intra-op parallelism stops paying for the small matrices of a LoRA step long
before 8 threads. Measured on a busy 2-core machine (load ~6), the demo's model (2 layers of
width 128, LoRA r 16, a 4 x 256 batch), forward + backward, medians of 6 alternated steps: 1 thread
402 ms/step (2,550 tokens/s), 2 threads 2,531 ms/step (405 tokens/s); a full run there logged 340
tokens/s at torch's default and ~6,500 with one thread. (The gain of 2 to 8 threads on an idle
many-core machine is still to be measured.) The value used is recorded in ``run.json``
(``args.threads``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

from ..data.cli import FlagError, FlagParser, add_format_flags
from .loggers import LOGGERS

__all__ = ["CONFIG_SKIP", "FlagError", "FlagParser", "add_data_flags", "add_eval_flags", "add_loop_flags", "add_model_flags",
           "add_output_flags", "check_output_flags", "cpu_threads", "load_config_file", "parse_with_config"]

# run.json keys that describe one invocation, not the run: never taken from a config file
CONFIG_SKIP = ("config", "resume", "override")


def add_model_flags(p: argparse.ArgumentParser, *, precisions: tuple[str, ...] = ("bf16", "fp16", "fp32"),
                    precision_help: str = "default: bf16 on CUDA, fp32 on CPU") -> None:
    """--model, --precision (``precisions``: the values the script takes), --threads, --compile, --seed."""
    g = p.add_argument_group("model")
    g.add_argument("--model", help="HF model folder or hub repo id (its tokenizer and chat template come with it)")
    g.add_argument("--precision", choices=list(precisions), default=None, help=precision_help)
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default on CPU: the usable cores less one per --num-workers, at most 8)")
    g.add_argument("--compile", action="store_true", help="torch.compile the training model (compiles on step 1)")
    g.add_argument("--seed", type=int, default=0)


def add_data_flags(p: argparse.ArgumentParser, *, kinds: tuple[str, ...] = ("chat", "instruction", "text")) -> None:
    """--data, --eval-data, --eval-split, --num-workers and the record-format flags (``kinds``: the
    --kind values the script reads)."""
    g = p.add_argument_group("data")
    g.add_argument("--data", nargs="+",
                   help="JSONL/Parquet/text files, folders, tar shards, or one cache built by python -m ftlib.data build; "
                        "PATH:WEIGHT for each makes a weighted mixture (a.jsonl:0.7 b/:0.3: each source its own "
                        "cache, sampled by weight every epoch; a config file: data: [a.jsonl:0.7, b/:0.3])")
    g.add_argument("--eval-data", nargs="+", help="held-out files/folders or cache (same kinds as --data)")
    g.add_argument("--eval-split", type=float, default=0.0,
                   help="without --eval-data: hold out this fraction of the training documents")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader workers")
    add_format_flags(p, kinds=kinds)


def add_loop_flags(p: argparse.ArgumentParser, *,
                   schedules: tuple[str, ...] = ("cosine", "linear", "constant", "plateau")) -> None:
    """Batch, steps, learning rate, schedule (``schedules``: the ones the script builds; the first is
    the default), clipping."""
    g = p.add_argument_group("optimization")
    g.add_argument("--batch-size", type=int, default=None, help="rows per micro-batch per rank")
    g.add_argument("--grad-accum", type=int, default=None, help="micro-batches per optimizer step")
    g.add_argument("--epochs", type=int, default=None, help="passes over the data (ignored with --max-steps)")
    g.add_argument("--max-steps", type=int, default=None,
                   help="optimizer steps to run; overrides --epochs (as in HF Trainer): more steps than the epochs "
                        "give go on into further epochs")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--warmup-ratio", type=float, default=0.03)
    g.add_argument("--schedule", choices=list(schedules), default=schedules[0])
    g.add_argument("--clip", type=float, default=1.0, help="global gradient-norm bound")


def add_eval_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-every", type=int, default=None, help="steps between held-out evals (default: --save-every)")
    g.add_argument("--early-stop", type=int, default=0, metavar="EVALS",
                   help="stop when the held-out loss has not improved for this many evals in a row (0: off)")
    g.add_argument("--early-stop-delta", type=float, default=0.0,
                   help="an eval improves when its loss is below the best by more than this")
    g.add_argument("--sample-every", type=int, default=0,
                   help="steps between sample generations, logged and written to metrics.jsonl (0: off)")
    g.add_argument("--sample-prompts", type=int, default=2, help="held-out prompts answered at each sample")


def add_output_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--out", help="output folder (cache, checkpoints, metrics, adapter, run.json); required")
    g.add_argument("--config", help="YAML or JSON file of flag values (a run's run.json works); flags override it")
    g.add_argument("--resume", action="store_true", help="continue from the latest good checkpoint in --out")
    g.add_argument("--override", default="",
                   help="with --resume: comma-separated settings whose new values the resumed run takes (e.g. lr,clip)")
    g.add_argument("--save-every", type=int, default=None,
                   help="steps between checkpoints (default: 10%% of the run; 0: only the final one)")
    g.add_argument("--keep", type=int, default=3, help="newest checkpoints kept (plus the best by eval loss)")
    g.add_argument("--log-every", type=int, default=10,
                   help="steps between printed lines when stderr is not a terminal (a terminal gets a progress bar)")
    g.add_argument("--report-to", default="",
                   help="comma-separated experiment loggers besides metrics.jsonl: tensorboard (--out/tb), "
                        "wandb (offline with WANDB_MODE=offline)")
    g.add_argument("--tensorboard", action="store_true", help="same as --report-to tensorboard")


def check_output_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Normalise the output group after parsing (in place): ``--report-to`` becomes a list with
    ``--tensorboard`` folded in, each logger known and importable; ``--override`` a list of setting
    names, and only with ``--resume``. A bad value is a one-line ``parser.error`` naming the flag."""
    rt = args.report_to
    args.report_to = [s.strip() for s in rt.split(",") if s.strip()] if isinstance(rt, str) else list(rt or [])
    if args.tensorboard and "tensorboard" not in args.report_to:
        args.report_to.append("tensorboard")
    args.tensorboard = False
    for name in args.report_to:
        if name not in LOGGERS:
            parser.error(f"--report-to {name}: not one of {', '.join(LOGGERS)}")
        if importlib.util.find_spec(name) is None:
            parser.error(f"--report-to {name} needs the {name} package: pip install {name} (or drop it)")
    args.override = [s.strip().replace("-", "_") for s in args.override.split(",") if s.strip()]
    if args.override and not args.resume:
        parser.error("--override applies to --resume")


def load_config_file(path: str | os.PathLike) -> dict:
    """Flag values from a YAML or JSON file (a ``run.json``: its ``args``), keys with ``_`` for ``-``."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise FlagError(f"--config {path}: {e.strerror or e}") from None
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise FlagError(f"--config {path}: reading YAML needs pyyaml (pip install pyyaml); or give the same "
                            "values as JSON") from None
        try:
            cfg = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise FlagError(f"--config {path}: invalid YAML: {str(e).splitlines()[0]}") from None
    else:
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            raise FlagError(f"--config {path}: invalid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise FlagError(f"--config {path}: expected a mapping of flag names to values, got {type(cfg).__name__}")
    if isinstance(cfg.get("args"), dict) and "command" in cfg:  # a run.json
        cfg = cfg["args"]
    return {str(k).replace("-", "_"): v for k, v in cfg.items()}


def parse_with_config(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with the values of ``--config FILE`` as the defaults (flags win).

    Keys that are no flag of ``parser``, and values outside a flag's choices, are refused naming them."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config:
        try:
            values = load_config_file(known.config)
        except FlagError as e:
            parser.error(str(e))
        actions = {a.dest: a for a in parser._actions if a.dest != "help"}
        unknown = sorted(k for k in values if k not in actions and k not in CONFIG_SKIP)
        if unknown:
            what = "is not a flag" if len(unknown) == 1 else "are not flags"
            parser.error(f"--config {known.config}: {', '.join(unknown)} {what} of {parser.prog}")
        values = {k: v for k, v in values.items() if k not in CONFIG_SKIP}
        for k, v in values.items():
            a = actions[k]
            if a.choices is not None and v is not None and v not in a.choices:
                parser.error(f"--config {known.config}: {k}={v!r} is not one of {', '.join(map(str, a.choices))}")
        parser.set_defaults(**values)
    return parser.parse_args(argv)


def cpu_threads(requested: int | None, *, num_workers: int = 0) -> int:
    """Torch intra-op threads for a CPU run: ``requested``, else the usable cores less one per loader
    worker, at least 1 and at most 8 (see the module docstring for why)."""
    if requested is not None:
        if requested < 1:
            raise FlagError(f"--threads must be >= 1, got {requested}")
        return requested
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        usable = os.cpu_count() or 1
    return max(1, min(8, usable - max(0, num_workers)))
