"""Fixtures for the distributed tests: one 2-rank torchrun run of every case, and the one-process references.

The torchrun run (tests/distributed/_dist_train_worker.py) happens once per test session, also
under pytest-xdist: the first worker that needs it runs it under a file lock in a directory the
workers share, the others wait for it and read the same results.
"""

import functools
import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the torchrun launcher
from _dist_common import build, parts, train  # noqa: E402
from _torchrun import run_torchrun  # noqa: E402

WORKER = Path(__file__).with_name("_dist_train_worker.py")

def _shared_dir(tmp_path_factory, name: str) -> Path:
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    return base.parent / f"{name}-{uid}" if uid else base / name

def run_once(tmp_path_factory, name: str, args: tuple[str, ...] = (), timeout: float = 900.0, nproc: int = 2) -> Path:
    """Run the worker (``args`` after the output folder) once per session; return its output folder."""
    from filelock import FileLock

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    out = _shared_dir(tmp_path_factory, name)
    with FileLock(str(out) + ".lock"):
        if not (out / "ok").exists():
            out.mkdir(parents=True, exist_ok=True)
            run_torchrun(WORKER, out, timeout=timeout, args=args, nproc=nproc)
    return out

@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory) -> Path:
    return run_once(tmp_path_factory, "ftlib-two-ranks")

@functools.cache
def reference(case: str):
    """(module, records, clipper) of the one-process run of ``case`` on the same global batches."""
    module = build(case)
    opt, sched, clip, loader = parts(case, module, rank=0, world=1)
    return module, train(module, opt, sched, clip, loader), clip
