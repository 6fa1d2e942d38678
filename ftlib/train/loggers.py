"""Deprecated: the experiment trackers are ``ftlib.metrics.MetricsLogger(report_to=...)``'s now.

    logger = MetricsLogger(out / "metrics.jsonl", report_to=["tensorboard", "wandb"], run_config=vars(args),
                           run_name=out.name, start_step=step)   # one object, called once per step

``open_loggers`` is kept one release for existing scripts: it warns and returns a ``MetricsLogger``
without a JSONL file, bar or printed lines, whose ``log(rec)`` / ``close()`` are what it had.
"""

from __future__ import annotations

import os
import warnings

from ..metrics import MetricsLogger

__all__ = ["open_loggers"]


def open_loggers(names, *, out: str | os.PathLike, config: dict | None = None, start_step: int = 0,
                 run_name: str | None = None) -> MetricsLogger:
    """Deprecated: ``MetricsLogger(..., report_to=names, log_dir=out, run_config=config, run_name=run_name)``."""
    warnings.warn("ftlib.train.open_loggers is deprecated; pass report_to=[...] (and run_config=, run_name=) to "
                  "ftlib.metrics.MetricsLogger, which then writes every record to the trackers itself",
                  DeprecationWarning, stacklevel=2)
    return MetricsLogger(None, start_step=start_step, progress=False, print_every=None, report_to=names,
                         log_dir=out, run_config=config, run_name=run_name)
