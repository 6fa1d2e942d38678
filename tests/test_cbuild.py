"""``ftlib._cbuild``: a kernel library built with OpenMP runs in the OpenMP runtime torch runs (one
thread pool, no second runtime), a failed OpenMP build falls back to one without it, and a build
problem (a wrong CXX, an unwritable cache, a damaged library) is one warning and the Python path, or
a rebuild."""

from __future__ import annotations

import ctypes
import json
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
from ftlib.cpu._library import source
rt = _cbuild.loaded_openmp_runtime()
lib = _cbuild.load_library(source("swiglu"), openmp=True)
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
    lib = _cbuild.load_library(str(ROOT / "ftlib" / "cpu" / "csrc" / "swiglu.cpp"), openmp=True)
    assert lib is not None and lib.ft_swiglu_openmp() == 0
    n = 1000
    g, u, h = torch.randn(n), torch.randn(n), torch.empty(n)
    lib.ft_swiglu_fwd.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int]
    lib.ft_swiglu_fwd(*(_cbuild.tensor_ptr(t) for t in (g, u, h)), n, 3)
    assert torch.allclose(h, torch.nn.functional.silu(g) * u, rtol=1e-5, atol=1e-6)
    # one library per (source, runtime): the plain build's directory only, no half-written file left
    built = sorted(p.name for p in (tmp_path / "cache" / "csrc").rglob("*") if p.is_file())
    assert built == ["libftlib_swiglu.so", "libftlib_swiglu.so.sha256"], built


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


# ---- build problems: one warning naming the compiler, the cache and the fix, then the Python path ----
_FORWARD = r"""
import json, warnings
import torch
import torch.nn.functional as F
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from ftlib.kernels.rmsnorm import rms_norm, rms_norm_backend
    from ftlib.kernels.swiglu import swiglu, swiglu_backend
    g, u, w = torch.randn(4, 64), torch.randn(4, 64), torch.rand(64)
    ok = torch.allclose(swiglu(g, u), F.silu(g) * u, atol=1e-6)
    ref = w * g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6)
    ok = ok and torch.allclose(rms_norm(g, w, 1e-6), ref, atol=1e-5)
    backends = [swiglu_backend(g, u), rms_norm_backend(g, w)]
print(json.dumps({"ok": bool(ok), "backends": backends,
                  "warnings": [f"{x.category.__name__}: {x.message}" for x in caught]}))
"""


def _forward(env: dict) -> dict:
    """A fresh process's first SwiGLU and RMSNorm (what a model's first forward calls) under ``env``."""
    r = subprocess.run([sys.executable, "-c", _FORWARD], env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"], out
    return out


def _build_warnings(out: dict) -> list[str]:
    return [m for m in out["warnings"] if m.startswith("CppBuildWarning")]


def _compiler_or_skip() -> str:
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    return cxx


def test_cxx_naming_no_compiler_warns_once_then_runs_the_pytorch_path(tmp_path):
    """CXX=/nonexistent/g++ (a typo, another machine's path) was a FileNotFoundError at the first forward:
    now one warning for all kernels, naming CXX's value, the cache and what to set, and the PyTorch path."""
    out = _forward({"CXX": "/nonexistent/g++", "FTLIB_CACHE_DIR": str(tmp_path)})
    assert out["backends"] == ["torch", "torch"]
    (w,) = _build_warnings(out)
    assert "/nonexistent/g++" in w and str(tmp_path) in w and "Set CXX" in w, w


_FORCED = r"""
import torch
from ftlib.kernels import swiglu
try:
    swiglu(torch.randn(4, 64), torch.randn(4, 64))
except RuntimeError as e:
    print(e)
"""


def test_forcing_the_cpu_kernel_when_the_build_fails_is_an_error_naming_why(tmp_path):
    """FTLIB_SWIGLU_BACKEND=cpu with a compiler that cannot run: a RuntimeError naming the variable and the
    build's own message (which names CXX), not a silent PyTorch path."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CXX": "/nonexistent/g++", "FTLIB_CACHE_DIR": str(tmp_path),
           "FTLIB_SWIGLU_BACKEND": "cpu"}
    r = subprocess.run([sys.executable, "-c", _FORCED], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    msg = r.stdout.strip()
    assert msg.startswith("FTLIB_SWIGLU_BACKEND=cpu cannot run this call: ") and "/nonexistent/g++" in msg, msg


def test_cxx_with_a_launcher_word_builds_the_kernels(tmp_path):
    """CXX="ccache g++" (a launcher, then the compiler) is split as a shell would: the kernels build."""
    cxx = _compiler_or_skip()
    launcher = shutil.which("ccache") or shutil.which("env")  # env: a launcher every system has
    out = _forward({"CXX": f"{launcher} {cxx}", "FTLIB_CACHE_DIR": str(tmp_path)})
    assert out["backends"] == ["cpu", "cpu"] and not _build_warnings(out), out


def test_cache_dir_that_is_a_file_warns_once_then_runs_the_pytorch_path(tmp_path):
    """FTLIB_CACHE_DIR naming a file (or a directory that cannot be written) was an OSError from
    os.makedirs at the first forward: now one warning naming the path and FTLIB_CACHE_DIR."""
    _compiler_or_skip()
    not_a_dir = tmp_path / "cache-file"
    not_a_dir.write_text("")
    out = _forward({"FTLIB_CACHE_DIR": str(not_a_dir)})
    assert out["backends"] == ["torch", "torch"]
    (w,) = _build_warnings(out)
    assert str(not_a_dir) in w and "FTLIB_CACHE_DIR" in w, w


@pytest.mark.parametrize("damage", ["zero bytes", "cut in half", "another kernel's library"])
def test_a_damaged_library_in_the_cache_is_rebuilt(tmp_path, damage):
    """A library in the cache that is not what its build wrote (zero bytes, cut short by a full disk,
    another kernel's library copied over it) was loaded as it was: ctypes' OSError or an undefined
    symbol at the first forward. Its checksum no longer matches, so the next process rebuilds it."""
    _compiler_or_skip()
    env = {"FTLIB_CACHE_DIR": str(tmp_path)}
    assert _forward(env)["backends"] == ["cpu", "cpu"]
    (sw,) = (tmp_path / "csrc").rglob("libftlib_swiglu.so")
    (rn,) = (tmp_path / "csrc").rglob("libftlib_rmsnorm.so")
    data = sw.read_bytes()
    if damage == "zero bytes":
        sw.write_bytes(b"")
    elif damage == "cut in half":
        sw.write_bytes(data[: len(data) // 2])
    else:
        shutil.copyfile(rn, sw)
    out = _forward(env)
    assert out["backends"] == ["cpu", "cpu"] and not _build_warnings(out), out
    assert sw.read_bytes() != b"" and len(sw.read_bytes()) >= len(data) // 2 + 1
