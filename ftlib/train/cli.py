"""The command-line vocabulary every training script shares: flag groups, ``--config``, CPU threads.

A script builds its parser from these groups and adds only what is its own (LoRA, engine, DPO
flags), so a flag has one name, one meaning and one default in every script and in
``python -m ftlib.data build`` (whose record-format flags, ``ftlib.data.cli.add_format_flags``,
are the same ones :func:`add_data_flags` adds):

    p = FlagParser()                           # ftlib.data.cli's argparse, with one-line errors
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

from ..data.cli import FlagError, RenamedFlag, add_format_flags, number, whole
from ..metrics import LOGGERS

__all__ = ["CONFIG_SKIP", "add_data_flags", "add_eval_flags", "add_loop_flags", "add_model_flags",
           "add_output_flags", "check_output_flags", "check_targets", "cpu_threads", "eval_intervals", "load_config_file",
           "number", "parse_with_config", "pick_precision", "split_heldout", "train_loader", "whole"]

# run.json keys that describe one invocation, not the run: never taken from a config file
CONFIG_SKIP = ("config", "resume", "override")
# comma-separated flags: a config file may give them as a list of names (a run.json holds report_to so)
COMMA_LISTS = ("report_to", "targets", "ignore_fields")


def add_model_flags(p: argparse.ArgumentParser, *, precisions: tuple[str, ...] = ("bf16", "fp16", "fp32"),
                    precision_help: str = "default: bf16 on CUDA, fp32 on CPU") -> None:
    """--model, --precision (``precisions``: the values the script takes), --threads, --compile, --seed."""
    g = p.add_argument_group("model")
    g.add_argument("--model", help="HF model folder or hub repo id (its tokenizer and chat template come with it)")
    g.add_argument("--precision", choices=list(precisions), default=None, help=precision_help)
    g.add_argument("--threads", type=whole(1), default=None,
                   help="torch CPU threads (default on CPU: the usable cores less one per --num-workers, at most 8)")
    g.add_argument("--compile", action="store_true", help="torch.compile the training model (compiles on step 1)")
    g.add_argument("--seed", type=whole(0), default=0)


def add_data_flags(p: argparse.ArgumentParser, *, kinds: tuple[str, ...] = ("chat", "instruction", "text")) -> None:
    """--data, --eval-data, --eval-split, --num-workers and the record-format flags (``kinds``: the
    --kind values the script reads)."""
    g = p.add_argument_group("data")
    g.add_argument("--data", nargs="+",
                   help="JSONL/Parquet/text files, folders, tar shards, or one cache built by python -m ftlib.data build; "
                        "PATH:WEIGHT for each makes a weighted mixture (a.jsonl:0.7 b/:0.3: each source its own "
                        "cache, sampled by weight every epoch; a config file: data: [a.jsonl:0.7, b/:0.3])")
    g.add_argument("--eval-data", nargs="+", help="held-out files/folders or cache (same kinds as --data)")
    g.add_argument("--eval-split", type=number(0, 1, below=True), default=0.0,
                   help="without --eval-data: hold out this fraction of the training documents")
    g.add_argument("--num-workers", type=whole(0), default=2, help="DataLoader workers")
    add_format_flags(p, kinds=kinds)


def add_loop_flags(p: argparse.ArgumentParser, *,
                   schedules: tuple[str, ...] = ("cosine", "linear", "constant", "plateau")) -> None:
    """Batch, steps, learning rate, schedule (``schedules``: the ones the script builds; the first is
    the default), clipping."""
    g = p.add_argument_group("optimization")
    g.add_argument("--batch-size", type=whole(1), default=None, help="rows per micro-batch per rank")
    g.add_argument("--grad-accum", type=whole(1), default=None, help="micro-batches per optimizer step")
    g.add_argument("--epochs", type=whole(1), default=None, help="passes over the data (ignored with --max-steps)")
    g.add_argument("--max-steps", type=whole(1), default=None,
                   help="optimizer steps to run; overrides --epochs (as in HF Trainer): more steps than the epochs "
                        "give go on into further epochs")
    g.add_argument("--lr", type=number(0, above=True), default=None, help="peak learning rate")
    g.add_argument("--weight-decay", type=number(0), default=0.0)
    g.add_argument("--warmup-ratio", type=number(0, 1), default=0.03)
    g.add_argument("--schedule", choices=list(schedules), default=schedules[0])
    g.add_argument("--clip", type=number(0, above=True), default=1.0, help="global gradient-norm bound")


def add_eval_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-every", type=whole(0), default=None,
                   help="steps between held-out evals (default: --save-every, or 10%% of the run with --save-every 0)")
    g.add_argument("--early-stop", type=whole(0), default=0, metavar="EVALS",
                   help="stop when the held-out loss has not improved for this many evals in a row (0: off)")
    g.add_argument("--early-stop-delta", type=number(0), default=0.0,
                   help="an eval improves when its loss is below the best by more than this")
    g.add_argument("--sample-every", type=whole(0), default=0,
                   help="steps between sample generations, logged and written to metrics.jsonl (0: off)")
    g.add_argument("--sample-prompts", type=whole(1), default=2, help="held-out prompts answered at each sample")


def add_output_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--out", help="output folder (cache, checkpoints, metrics, adapter, run.json); required")
    g.add_argument("--config", help="YAML or JSON file of flag values (a run's run.json works); flags override it")
    g.add_argument("--resume", action="store_true", help="continue from the latest good checkpoint in --out")
    g.add_argument("--override", default="",
                   help="with --resume: comma-separated settings whose new values the resumed run takes (e.g. lr,clip)")
    g.add_argument("--save-every", type=whole(0), default=None,
                   help="steps between checkpoints (default: 10%% of the run; 0: only the final one)")
    g.add_argument("--keep", type=whole(1), default=3, help="newest checkpoints kept (plus the best by eval loss)")
    g.add_argument("--log-every", type=whole(0), default=10,
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
        values = {k: _config_value(parser, actions[k], k, v, known.config) for k, v in values.items()
                  if k not in CONFIG_SKIP}
        parser.set_defaults(**values)
    return parser.parse_args(argv)


def _config_value(parser: argparse.ArgumentParser, action: argparse.Action, key: str, value, path: str):
    """A ``--config`` value as the flag's own parsing makes it (its ``type=``, ``nargs``, choices):
    JSON/YAML numbers and lists skip argparse, so they are written as the command line would give
    them and parsed by ``parser``; what the flag would refuse is a one-line ``parser.error``."""
    flag = action.option_strings[0] if action.option_strings else key
    where = f"--config {path}: {key}={value!r}"
    if isinstance(action, RenamedFlag):
        parser.error(f"{where}: {flag} was renamed {action.new}: write {action.new.lstrip('-')} instead")
    if value is None:
        return None
    if action.nargs == 0:  # a switch (store_true, --x/--no-x)
        if not isinstance(value, bool):
            parser.error(f"{where}: {flag} is a switch; give true or false")
        return value
    many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
    if many and isinstance(value, dict):  # --data {path: weight}: a mixture, read (and checked) by data_sources
        return value
    if isinstance(value, (list, tuple)) and not many:
        if key in COMMA_LISTS and all(isinstance(x, str) for x in value):
            value = ",".join(value)  # the flag's comma-separated form
        else:
            parser.error(f"{where}: {flag} takes one value, not a list")
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(x, (bool, dict, list)) for x in items):
        parser.error(f"{where}: not a value {flag} takes")
    if action.choices is not None:
        bad = [x for x in items if x not in action.choices]
        if bad:
            parser.error(f"{where} is not one of {', '.join(map(str, action.choices))}")
    try:
        parsed = [parser._get_value(action, x if isinstance(x, str) else str(x)) for x in items]
    except argparse.ArgumentError as e:
        parser.error(f"{where}: {flag} {e.message}")
    return parsed if many else parsed[0]


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


# ---- settings that parse but cannot train: refused before training, naming the flag -------------------


def pick_precision(requested: str | None, device, *, cuda_default: str = "bf16") -> str:
    """``--precision`` for ``device``: the one asked for, else ``cuda_default`` on CUDA and fp32 elsewhere.
    fp16 on a CPU is refused (``FlagError``): CPU kernels do not compute in half precision (attention
    fails with a dtype error, and nothing would be gained); bf16 and fp32 run there."""
    kind = getattr(device, "type", str(device))
    if requested == "fp16" and kind == "cpu":
        raise FlagError("--precision fp16 needs a CUDA GPU (CPU kernels do not compute in fp16): on the CPU use "
                        "--precision fp32 (its default) or bf16")
    return requested or (cuda_default if kind == "cuda" else "fp32")


def split_heldout(docs, fraction: float, *, seed: int = 0):
    """``ftlib.data.heldout_split`` for ``--eval-split``: ``FlagError`` when it leaves no training document."""
    from ..data import heldout_split

    n = len(docs.lengths)
    n_eval = max(1, int(round(fraction * n)))
    if n_eval >= n:
        raise FlagError(f"--eval-split {fraction:g} holds out {n_eval} of the {n} training documents, leaving none "
                        "to train on: lower it, or pass the held-out records as --eval-data")
    return heldout_split(docs, fraction, seed=seed)


def train_loader(docs, *, batch_size: int, seq_len: int, world_size: int | None = None, **kw):
    """A packed ``ftlib.data.TokenLoader`` of ``docs``; ``FlagError`` naming ``--batch-size`` when the data
    packs into fewer rows of ``seq_len`` than one global batch (no step could run)."""
    import numpy as np

    from .._dist import get_world_size
    from ..data import TokenLoader
    from ..data.packing import pack

    try:
        return TokenLoader(docs, batch_size=batch_size, seq_len=seq_len, world_size=world_size, packing=True, **kw)
    except ValueError:  # which one: the rows are packed again only on this path
        world = world_size or get_world_size()
        lengths = np.asarray(docs.lengths, dtype=np.int64)
        rows = pack(lengths, seq_len, kw.get("overflow", "split"), kw.get("pack_backend")).n_rows if len(lengths) else 0
        if rows >= batch_size * world:
            raise
    raise FlagError(f"--batch-size {batch_size}: the training data packs into {rows} rows of --seq-len {seq_len}, "
                    f"fewer than one batch of {batch_size} x {world} rank(s): lower --batch-size (at most "
                    f"{rows // world} here) or add data")


def _target_counts(docs):
    """Per document: the tokens that carry loss (loss mask 1, not the first token, which nothing predicts)."""
    import numpy as np

    if hasattr(docs, "indices") and hasattr(docs, "docs"):  # a held-out split's view
        return _target_counts(docs.docs)[docs.indices]
    if hasattr(docs, "parts") and hasattr(docs, "source_ids"):  # a mixture: its sources' documents in order
        return np.concatenate([_target_counts(part) for part in docs.parts])
    if hasattr(docs, "shard_arrays"):  # a token cache: summed on its arrays, no Python loop over documents
        out = []
        for off, _, mask in docs.shard_arrays():
            off = np.asarray(off, dtype=np.int64)
            starts, counts = off[:-1], np.zeros(len(off) - 1, np.int64)
            full = np.flatnonzero(off[1:] > starts)
            if len(full):
                counts[full] = np.add.reduceat(mask, starts[full], dtype=np.int64) - (mask[starts[full]] != 0)
            out.append(counts)
        return np.concatenate(out) if out else np.zeros(0, np.int64)
    return np.array([int((np.asarray(docs[i][1])[1:] != 0).sum()) for i in range(len(docs))], dtype=np.int64)


def check_targets(docs, *, seq_len: int, flag: str = "--data") -> None:
    """``FlagError`` when no document of ``docs`` holds a token that carries loss: every step would be
    skipped (0 target tokens) and an untrained adapter saved. Documents are cut to ``--seq-len`` when
    tokenized, so a very short one keeps no target."""
    if len(docs.lengths) and not _target_counts(docs).any():
        raise FlagError(f"--seq-len {seq_len}: no document of {flag}, cut to {seq_len} tokens, keeps a token that "
                        "carries loss (a row's first token is predicted by nothing): every step would train on "
                        "nothing; raise --seq-len")


def eval_intervals(total: int, *, save_every: int | None, eval_every: int | None, early_stop: int = 0,
                   evaluates: bool = True) -> tuple[int, int]:
    """(steps between checkpoints, steps between held-out evals) of a ``total``-step run.

    ``--save-every`` defaults to 10% of the run; ``--eval-every`` to ``--save-every``, or to 10% of the
    run when ``--save-every`` is 0 (no periodic checkpoints is no reason to evaluate only at the end).
    ``--early-stop N`` needs N + 1 evals during the run (the first sets the best): fewer is refused
    (``FlagError``) before training, naming the flags."""
    default = max(1, total // 10)
    save = save_every if save_every is not None else default
    every = eval_every if eval_every is not None else (save or default)
    if early_stop and evaluates:
        n = (total // every + (total % every > 0)) if every else 1  # the evals in the loop; the last at the end
        if n < early_stop + 1:
            why = "evaluates only at the end" if not every else f"evaluates {n} time(s) in {total} steps"
            most = -(-total // early_stop) - 1  # the largest interval that gives early_stop + 1 evals
            fix = f"give --eval-every {most} or less" if most >= 1 else f"lower --early-stop (the run has {total} steps)"
            raise FlagError(f"--early-stop {early_stop} needs {early_stop + 1} held-out evals during the run, but "
                            f"--eval-every {every} {why}: {fix}")
    return save, every
