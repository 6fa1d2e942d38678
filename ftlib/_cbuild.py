"""Build a ``csrc/*.cpp`` file into a plain shared library on first use and load it with ctypes.

Used by the data path (``ftlib.data``: packing) and by the CPU compute kernels
(LoRA's dropout products, ``ftlib.lora.dropout``; SwiGLU, ``ftlib.kernels.swiglu``).

One library per source file and hash of the source and the local headers it includes, under
``$FTLIB_CACHE_DIR/csrc/<hash>/``
(default ``~/.cache/ftlib``), compiled with the system C++ compiler (``$CXX``, else ``c++``,
``g++`` or ``clang++``) as ``-O3 -std=c++17 -shared -fPIC``. A source checkout reads
``<repo>/csrc``; an installed wheel carries the same files as ``ftlib/_csrc``. The library is
written under a temporary name and renamed, so processes building at the same time never load a
half-written file. No compiler, or a failed build, gives ``None``: each caller has a Python path.

``load_library(name, openmp=True)`` (the CPU compute kernels) compiles with ``-fopenmp`` and links
the OpenMP runtime this process already runs, the one torch's CPU ops use (found in
``/proc/self/maps``), by its path: the kernels' ``#pragma omp parallel`` regions then take the
threads of torch's own pool, which idle (spin-waiting) between torch's ops, instead of starting
threads of their own that compete with them. Where no such runtime is loaded (another OS, a torch
built without OpenMP) or the OpenMP build fails, the library is built without ``-fopenmp`` and
its kernels run on the calling thread.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess

__all__ = ["PARALLEL_MIN", "cache_root", "csrc_path", "kernel_threads", "load_library", "loaded_openmp_runtime", "tensor_ptr"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_LOADED: dict[tuple[str, bool], ctypes.CDLL | None] = {}


def cache_root() -> str:
    """``$FTLIB_CACHE_DIR``, else ``~/.cache/ftlib``: where built libraries and derived tables live."""
    return os.environ.get("FTLIB_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "ftlib"))


def csrc_path(name: str) -> str:
    """Path of ``csrc/<name>`` (source checkout) or ``ftlib/_csrc/<name>`` (installed wheel)."""
    repo = os.path.join(os.path.dirname(_HERE), "csrc", name)
    wheel = os.path.join(_HERE, "_csrc", name)
    return repo if os.path.exists(repo) or not os.path.exists(wheel) else wheel


def loaded_openmp_runtime() -> str | None:
    """Path of the GNU OpenMP runtime (``libgomp*``) mapped into this process, or None.

    After ``import torch`` on Linux this is the runtime torch's CPU ops run their threads in (a pip
    wheel ships its own copy under ``torch/lib``). None on systems without ``/proc``, before anything
    loaded one, or when more than one is mapped (which one torch uses is then unknown).
    """
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "libgomp" in line}
    except OSError:
        return None
    paths = {p for p in paths if os.path.basename(p).startswith("libgomp") and os.path.isfile(p)}
    return paths.pop() if len(paths) == 1 else None


def _build(cxx: str, src_path: str, out: str, openmp_runtime: str | None) -> bool:
    """Compile ``src_path`` into the shared library ``out``; with ``openmp_runtime``, against that runtime."""
    base = [cxx, "-O3", "-std=c++17", "-fPIC"]
    if openmp_runtime is None:
        return subprocess.run([*base, "-shared", src_path, "-o", out], capture_output=True).returncode == 0
    # compile with -fopenmp, link the given runtime by path (not the compiler's default -lgomp, which
    # could be a second copy with its own threads)
    obj = f"{out}.o"
    try:
        ok = subprocess.run([*base, "-fopenmp", "-c", src_path, "-o", obj], capture_output=True).returncode == 0
        return ok and subprocess.run([cxx, "-shared", obj, openmp_runtime,
                                      f"-Wl,-rpath,{os.path.dirname(openmp_runtime)}", "-o", out],
                                     capture_output=True).returncode == 0
    finally:
        if os.path.exists(obj):
            os.remove(obj)


def _source_with_headers(src_path: str) -> bytes:
    """The source's bytes followed by those of each header it includes from its own folder
    (``#include "x.h"``): what the build's hash covers, so a changed header rebuilds its users."""
    src = open(src_path, "rb").read()
    out = [src]
    for name in re.findall(rb'^\s*#\s*include\s+"([^"]+)"', src, flags=re.M):
        header = os.path.join(os.path.dirname(src_path), name.decode())
        if os.path.isfile(header):
            out.append(b"\0" + name + b"\0" + open(header, "rb").read())
    return b"".join(out)


def load_library(name: str, openmp: bool = False) -> ctypes.CDLL | None:
    """The compiled ``csrc/<name>`` (built once per source hash), or None when it cannot be built.

    ``openmp``: build against the OpenMP runtime already loaded (see the module docstring); falls
    back to a build without OpenMP when there is none or that build fails.
    """
    if (name, openmp) in _LOADED:
        return _LOADED[(name, openmp)]
    lib = None
    src_path = csrc_path(name)
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx and os.path.exists(src_path):
        src = _source_with_headers(src_path)
        runtime = loaded_openmp_runtime() if openmp else None
        for rt in ([runtime, None] if runtime else [None]):
            key = hashlib.sha256(src + (b"\0openmp:" + rt.encode() if rt else b"")).hexdigest()[:16]
            out_dir = os.path.join(cache_root(), "csrc", key)
            so = os.path.join(out_dir, f"libftlib_{os.path.splitext(name)[0]}.so")
            if not os.path.exists(so):
                os.makedirs(out_dir, exist_ok=True)
                tmp = f"{so}.tmp-{os.getpid()}"
                if _build(cxx, src_path, tmp, rt):
                    os.replace(tmp, so)
                elif os.path.exists(tmp):
                    os.remove(tmp)
            if os.path.exists(so):
                lib = ctypes.CDLL(so)
                break
    _LOADED[(name, openmp)] = lib
    return lib


# Below this many elements a kernel runs on one thread (a parallel region costs a few us).
PARALLEL_MIN = 1 << 16


def kernel_threads(openmp: bool, n: int) -> int:
    """Threads for a CPU kernel call over n elements: torch's intra-op count when its library was
    built against torch's OpenMP runtime (``openmp``, the library's own report) and n is at least
    ``PARALLEL_MIN``, else 1. Kernels split over std::threads of their own beside torch's pool
    competed with its spin-waiting workers (``bench_train.py``'s step at 2 threads: 0.976 ms a token
    that way, 0.925 on one thread, 0.945 with the PyTorch ops)."""
    import torch

    return torch.get_num_threads() if openmp and n >= PARALLEL_MIN else 1


def tensor_ptr(t) -> ctypes.c_void_p:
    """A tensor's data pointer as a ``c_void_p`` argument of a library function."""
    return ctypes.c_void_p(t.data_ptr())
