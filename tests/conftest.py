"""Shared test setup.

Without CUDA, Triton kernels run in the interpreter: TRITON_INTERPRET must be set
before any kernel is decorated, so it is set here, before ftlib is imported.
"""

import os

import pytest
import torch
from hypothesis import settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Property tests: no per-example deadline (a loaded 2-core machine is slow, not wrong), and the
# examples are derandomized so that every run (CI's included) tries the same cases: a test is
# green or red, never flaky. `FTLIB_HYPOTHESIS=explore` draws fresh examples to hunt for new
# counterexamples; pin each one found with @example.
settings.register_profile("ftlib", deadline=None, derandomize=True)
settings.register_profile("explore", deadline=None)
settings.load_profile("explore" if os.environ.get("FTLIB_HYPOTHESIS") == "explore" else "ftlib")

# Under pytest-xdist each worker gets one thread: two workers on two cores, no oversubscription.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
