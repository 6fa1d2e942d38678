"""``ftlib._cbuild``: a kernel library built with OpenMP runs in the OpenMP runtime torch runs (one
thread pool, no second runtime), and a failed OpenMP build falls back to one without it."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftlib import _cbuild

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import ctypes, sys
import torch
from ftlib import _cbuild
rt = _cbuild.loaded_openmp_runtime()
lib = _cbuild.load_library("swiglu.cpp", openmp=True)
assert lib is not None and lib.ft_swiglu_openmp() == 1, "not built with OpenMP"
n = 1 << 17
g, u, h = torch.randn(n), torch.randn(n), torch.empty(n)
p = lambda t: ctypes.c_void_p(t.data_ptr())
lib.ft_swiglu_fwd.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int]
lib.ft_swiglu_fwd(p(g), p(u), p(h), n, 2)
assert torch.allclose(h, torch.nn.functional.silu(g) * u, rtol=1e-5, atol=1e-6)
maps = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
print(len(maps), rt in maps)
"""


def test_openmp_build_runs_in_torchs_runtime(tmp_path):
    """Built with -fopenmp against the runtime torch loaded, the library maps no second runtime, even
    after a parallel region (a second copy would bring a second thread pool competing with torch's)."""
    if _cbuild.loaded_openmp_runtime() is None:
        pytest.skip("no single GNU OpenMP runtime mapped in this process (not Linux, or torch without it)")
    if not (os.environ.get("CXX") or any(map(shutil.which, ("c++", "g++", "clang++")))):
        pytest.skip("no C++ compiler")
    env = dict(os.environ, FTLIB_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["1", "True"], r.stdout


def test_failed_openmp_build_falls_back_to_a_plain_build(tmp_path, monkeypatch):
    """A runtime that cannot be linked (here a file that is not a library) gives the build without
    OpenMP: the kernels work and report one thread's build."""
    if not (os.environ.get("CXX") or any(map(shutil.which, ("c++", "g++", "clang++")))):
        pytest.skip("no C++ compiler")
    bogus = tmp_path / "libgomp.so.1"
    bogus.write_bytes(b"not a shared library")
    monkeypatch.setenv("FTLIB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_cbuild, "_LOADED", {})
    monkeypatch.setattr(_cbuild, "loaded_openmp_runtime", lambda: str(bogus))
    lib = _cbuild.load_library("swiglu.cpp", openmp=True)
    assert lib is not None and lib.ft_swiglu_openmp() == 0
    n = 1000
    g, u, h = torch.randn(n), torch.randn(n), torch.empty(n)
    lib.ft_swiglu_fwd.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int]
    lib.ft_swiglu_fwd(*(_cbuild.tensor_ptr(t) for t in (g, u, h)), n, 3)
    assert torch.allclose(h, torch.nn.functional.silu(g) * u, rtol=1e-5, atol=1e-6)
    # one library per (source, runtime): the plain build's directory only, no half-written file left
    built = sorted(p.name for p in (tmp_path / "cache" / "csrc").rglob("*") if p.is_file())
    assert built == ["libftlib_swiglu.so"], built


def test_a_local_header_is_part_of_the_build_hash(tmp_path):
    """A kernel's hash covers the headers it includes from its folder: editing the shared header
    rebuilds every kernel that includes it (a stale library would keep the old code)."""
    (tmp_path / "k.cpp").write_text('#include <cstdint>\n#include "shared.h"\nint f() { return g(); }\n')
    (tmp_path / "shared.h").write_text("inline int g() { return 1; }\n")
    before = _cbuild._source_with_headers(str(tmp_path / "k.cpp"))
    assert b"return 1" in before
    (tmp_path / "shared.h").write_text("inline int g() { return 2; }\n")
    assert _cbuild._source_with_headers(str(tmp_path / "k.cpp")) != before
    assert _cbuild._source_with_headers(_cbuild.csrc_path("bfd_pack.cpp")) == open(_cbuild.csrc_path("bfd_pack.cpp"), "rb").read()


def test_kernel_threads_uses_torchs_count_only_for_openmp_builds_and_large_calls(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 5)
    assert _cbuild.kernel_threads(True, _cbuild.PARALLEL_MIN) == 5
    assert _cbuild.kernel_threads(True, _cbuild.PARALLEL_MIN - 1) == 1  # a parallel region costs more
    assert _cbuild.kernel_threads(False, 10 * _cbuild.PARALLEL_MIN) == 1  # own threads would compete
