"""The run manifest ``run.json``: what a run was started with and every time it was resumed.

    write_run_manifest(out, vars(args), device=device, world_size=world, data_fingerprint=fp)
    ...                                                    # later, in a resumed process:
    write_run_manifest(out, vars(args), device=device, world_size=world, data_fingerprint=fp,
                       resume=resumed)                     # a ``Resumed`` from ``resume_train_state``

A fresh run writes the command line, every argument, the versions of ftlib / torch /
transformers / Python, the git commit of the ftlib source (``-dirty`` with local changes), the
device, world size, seed and the fingerprint of the tokenized data, and an empty ``resumes``
list. A resume keeps all of that and appends ``{"from", "at", "step", "world_size", "command",
"overrides"}``, where ``overrides`` maps each setting the resumed run changed on purpose to
``[old, new]``; ``args`` then holds the arguments in force from that point on (the overridden
values), so the manifest never shows settings the run no longer uses. Written atomically
(temporary file, fsync, rename).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .._atomic import atomic_write

__all__ = ["RUN_MANIFEST", "git_commit", "write_run_manifest"]

RUN_MANIFEST = "run.json"


def git_commit() -> str | None:
    """The commit of the ftlib source tree (``-dirty`` with uncommitted changes), or None outside git."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode != 0:
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _versions() -> dict:
    from .. import __version__

    try:  # the version without importing it (slow)
        tf_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        tf_version = None
    return {"ftlib": __version__, "torch": torch.__version__, "transformers": tf_version,
            "python": platform.python_version()}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def write_run_manifest(out: str | os.PathLike, args: dict[str, Any], *, device: torch.device, world_size: int,
                       data_fingerprint: str | None, resume=None, extra: dict[str, Any] | None = None) -> dict:
    """Write ``out/run.json`` for a fresh run, or record a resume (``resume``: a ``Resumed`` whose
    ``path`` is set) in the existing one; return the manifest written. ``extra``: further top-level
    entries (what the run resolved, e.g. the chat template's text and source), set on every write."""
    path = Path(out) / RUN_MANIFEST
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    resumed = resume is not None and resume.path is not None
    run = None
    if resumed and path.exists():
        try:
            run = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: unreadable run manifest ({e}); move it away to start a new one") from None
    if run is None:
        run = {"command": [sys.executable, *sys.argv], "args": dict(args), "versions": _versions(),
               "git_commit": git_commit(), "device": _device_name(device), "world_size": world_size,
               "seed": args.get("seed"), "data_fingerprint": data_fingerprint, "started": now, "resumes": []}
    run.update(extra or {})
    if resumed:
        run["args"] = dict(args)
        run.setdefault("resumes", []).append({
            "from": str(resume.path), "at": now, "step": resume.step, "world_size": world_size,
            "saved_world_size": resume.saved_world_size, "command": [sys.executable, *sys.argv],
            "overrides": {k: [old, new] for k, (old, new) in resume.overrides.items()}})
    text = json.dumps(run, indent=1, default=str) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: tmp.write_text(text))
    return run
