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

# Property tests: no per-example deadline (a loaded 2-core machine is slow, not wrong); in CI the
# examples are derandomized so a run is reproducible (a failure found locally is kept in the
# example database and replayed).
settings.register_profile("ftlib", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "ftlib")

# Under pytest-xdist each worker gets one thread: two workers on two cores, no oversubscription.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
