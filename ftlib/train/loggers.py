"""Experiment loggers behind one interface: TensorBoard and Weights & Biases, both optional.

    loggers = open_loggers(["tensorboard", "wandb"], out="runs/x", config=vars(args), start_step=0)
    loggers.log(rec)          # a metrics record: {"step", ...}; "kind": "eval" ones go under eval/
    loggers.close()

``metrics.jsonl`` (``ftlib.metrics.MetricsLogger``) stays the record of a run; these mirror its
numeric fields: ``train/<key>`` for step records, ``eval/<key>`` for evaluation records, at the
record's ``step``. Each backend is imported when asked for, and a missing package is an
``ImportError`` saying what to install. W&B runs offline with ``WANDB_MODE=offline`` (files under
``--out/wandb``), which is how it is tested; a resumed run keeps its W&B run id
(``--out/wandb_run_id``).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["LOGGERS", "Loggers", "open_loggers"]

LOGGERS = ("tensorboard", "wandb")


def _scalars(rec: dict):
    prefix = "eval/" if rec.get("kind") == "eval" else "train/"
    for k, v in rec.items():
        if k not in ("step", "kind") and isinstance(v, (int, float)) and not isinstance(v, bool):
            yield prefix + k, v


class _TensorBoard:
    def __init__(self, out: Path, start_step: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("--report-to tensorboard needs the tensorboard package: pip install tensorboard") from e
        self.w = SummaryWriter(str(out / "tb"), purge_step=start_step + 1 if start_step else None)

    def log(self, rec: dict) -> None:
        for k, v in _scalars(rec):
            self.w.add_scalar(k, v, rec["step"])

    def close(self) -> None:
        self.w.close()


class _Wandb:
    def __init__(self, out: Path, config: dict, name: str | None):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("--report-to wandb needs the wandb package: pip install wandb") from e
        id_file = out / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        self.run = wandb.init(dir=str(out), config=config, name=name, id=run_id, resume="allow" if run_id else None)
        if run_id is None:
            id_file.write_text(self.run.id + "\n")

    def log(self, rec: dict) -> None:
        self.run.log(dict(_scalars(rec)), step=rec["step"])

    def close(self) -> None:
        self.run.finish()


class Loggers:
    """The loggers a run asked for; ``log`` sends a record to each, ``close`` closes each."""

    def __init__(self, backends: list):
        self.backends = backends

    def log(self, rec: dict) -> None:
        for b in self.backends:
            b.log(rec)

    def close(self) -> None:
        for b in self.backends:
            b.close()
        self.backends = []


def open_loggers(names, *, out: str | os.PathLike, config: dict | None = None, start_step: int = 0,
                 run_name: str | None = None) -> Loggers:
    """The loggers named in ``names`` (each in :data:`LOGGERS`), writing under ``out``."""
    out = Path(out)
    backends = []
    for n in dict.fromkeys(names):
        if n == "tensorboard":
            backends.append(_TensorBoard(out, start_step))
        elif n == "wandb":
            backends.append(_Wandb(out, dict(config or {}), run_name))
        else:
            raise ValueError(f"unknown logger {n!r} (known: {', '.join(LOGGERS)})")
    return Loggers(backends)
