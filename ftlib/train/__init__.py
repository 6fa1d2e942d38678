"""What every training script shares, below the script and above the pieces it drives.

The loop stays in the script (``examples/sft.py``, the ``ftlib sft`` command); these are the parts
that are the same in every script and must not drift between copies:

- ``plan``: ``plan_steps`` / ``StepPlan``, optimizer steps per epoch and in all from the loader;
- ``resume``: ``resume_train_state``, the whole train state back from the newest good checkpoint
  (one-process or sharded) with one rule for changed settings (refused, named ``old -> new``,
  unless overridden) and exact re-planning of the data position on another world size;
  ``run_extra`` records what it compares in every checkpoint;
- ``manifest``: ``write_run_manifest``, ``run.json`` with every resume and its overrides;
- ``export``: ``save_merged`` (adapters merged, HF layout, tokenizer files beside it) and
  ``copy_tokenizer_files``;
- ``seed``: ``seed_everything``;
- ``early_stop``: ``EarlyStop``, patience on the held-out loss, its state saved in checkpoints;
- ``cli``: the flag groups every script shares (``add_model_flags``, ``add_data_flags``, ...),
  ``--config FILE`` (``parse_with_config``), the output flags checked once (``check_output_flags``),
  the CPU thread default (``cpu_threads``), and the settings that parse but cannot train refused
  before training (``pick_precision``, ``split_heldout``, ``train_loader``, ``check_targets``,
  ``eval_intervals``);
- ``loggers``: ``open_loggers``, deprecated (the trackers are ``ftlib.metrics.MetricsLogger(report_to=...)``'s).

Layer: above ``checkpoint`` (one ``load_checkpoint`` resumes one-process and sharded runs) and
``distributed``, below ``ftlib.cli`` and ``examples/``.
"""

from .cli import (
    add_data_flags,
    add_eval_flags,
    add_loop_flags,
    add_model_flags,
    add_output_flags,
    check_output_flags,
    check_targets,
    cpu_threads,
    eval_intervals,
    load_config_file,
    number,
    parse_with_config,
    pick_precision,
    split_heldout,
    train_loader,
    whole,
)
from .early_stop import EarlyStop
from .export import TOKENIZER_FILES, copy_tokenizer_files, save_merged
from .loggers import open_loggers
from .manifest import RUN_MANIFEST, git_commit, write_run_manifest
from .plan import StepPlan, plan_steps
from .resume import (
    Resumed,
    ResumeError,
    compare_settings,
    replan_loader_state,
    resume_train_state,
    run_extra,
    run_settings,
)
from .seed import seed_everything

__all__ = [
    "EarlyStop",
    "RUN_MANIFEST",
    "ResumeError",
    "Resumed",
    "StepPlan",
    "TOKENIZER_FILES",
    "add_data_flags",
    "add_eval_flags",
    "add_loop_flags",
    "add_model_flags",
    "add_output_flags",
    "check_output_flags",
    "check_targets",
    "compare_settings",
    "copy_tokenizer_files",
    "cpu_threads",
    "eval_intervals",
    "git_commit",
    "load_config_file",
    "number",
    "open_loggers",
    "parse_with_config",
    "pick_precision",
    "plan_steps",
    "replan_loader_state",
    "resume_train_state",
    "run_extra",
    "run_settings",
    "save_merged",
    "seed_everything",
    "split_heldout",
    "train_loader",
    "whole",
    "write_run_manifest",
]
