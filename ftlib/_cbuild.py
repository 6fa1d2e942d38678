"""Build a ``csrc/*.cpp`` file into a plain shared library on first use and load it with ctypes.

Used by the data path (``ftlib.data``: packing, sources in ``csrc/``) and by the CPU wing's compute
kernels (``ftlib.cpu``, sources in ``ftlib/cpu/csrc/``, named by absolute path).

One library per source file and hash of the source and the local headers it includes, under
``$FTLIB_CACHE_DIR/csrc/<hash>/``
(default ``~/.cache/ftlib``), compiled with the system C++ compiler (``$CXX``, split as a shell
would, so ``CXX="ccache g++"`` works; else ``c++``, ``g++`` or ``clang++``) as
``-O3 -std=c++17 -shared -fPIC``. A source checkout reads ``<repo>/csrc``; an installed wheel
carries the same files as ``ftlib/_csrc``. The library is written under a temporary name and
renamed, so processes building at the same time never load a half-written file, and its SHA-256 is
written beside it (``<lib>.so.sha256``) before the rename: a library that does not match it (cut
short, zero bytes, another kernel's library copied there) is rebuilt, never loaded.

Every caller has a Python path, taken when ``load_library`` gives None; ``build_error`` says why
it gave None (for the error a forced backend raises). No compiler at all gives
None quietly; any other build problem (``$CXX`` names no executable, the cache directory cannot be
written, the compiler fails) gives one ``CppBuildWarning`` per process naming the compiler, the
cache path and what to change, then None.

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
import shlex
import shutil
import subprocess
import warnings

__all__ = ["CppBuildWarning", "PARALLEL_MIN", "build_error", "cache_root", "csrc_path", "kernel_threads",
           "load_library", "loaded_openmp_runtime", "tensor_ptr"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_LOADED: dict[tuple[str, bool], ctypes.CDLL | None] = {}
_WARNED: set[str] = set()
_WHY: dict[tuple[str, bool], str] = {}


class CppBuildWarning(UserWarning):
    """A C++ library could not be built or loaded; the PyTorch (or NumPy) path runs instead."""


def _warn_once(msg: str) -> None:
    """One warning per process for all C++ libraries (they share the compiler and the cache)."""
    if not _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg + " The PyTorch path runs instead (same results, slower on CPU); further C++ build "
                      "problems in this process are not reported.", CppBuildWarning, stacklevel=3)


def _compiler() -> tuple[list[str] | None, str]:
    """(argv, as given) of the C++ compiler: ``$CXX`` split as a shell would (a launcher such as ccache
    first), else the first of c++ / g++ / clang++ on PATH; argv None when there is none at all."""
    env = os.environ.get("CXX", "").strip()
    if env:
        try:
            return shlex.split(env), env
        except ValueError:
            return [], env
    found = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    return ([found] if found else None), found or ""


def cache_root() -> str:
    """``$FTLIB_CACHE_DIR``, else ``~/.cache/ftlib``: where built libraries and derived tables live."""
    return os.environ.get("FTLIB_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "ftlib"))


def csrc_path(name: str) -> str:
    """Path of ``csrc/<name>`` (source checkout) or ``ftlib/_csrc/<name>`` (installed wheel); an absolute
    ``name`` is its own path (the CPU wing's sources live in its package, ``ftlib/cpu/csrc``)."""
    if os.path.isabs(name):
        return name
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


def _run(argv: list[str]) -> str | None:
    """None when the command succeeds, else the end of what it said (or why it could not start)."""
    try:
        r = subprocess.run(argv, capture_output=True)
    except OSError as e:
        return str(e)
    if r.returncode == 0:
        return None
    return (r.stderr or r.stdout).decode(errors="replace").strip()[-600:] or f"exit status {r.returncode}"


def _build(cxx: list[str], src_path: str, out: str, openmp_runtime: str | None) -> str | None:
    """Compile ``src_path`` into the shared library ``out``; with ``openmp_runtime``, against that runtime.
    None on success, else the compiler's complaint."""
    base = [*cxx, "-O3", "-std=c++17", "-fPIC"]
    if openmp_runtime is None:
        return _run([*base, "-shared", src_path, "-o", out])
    # compile with -fopenmp, link the given runtime by path (not the compiler's default -lgomp, which
    # could be a second copy with its own threads)
    obj = f"{out}.o"
    try:
        return _run([*base, "-fopenmp", "-c", src_path, "-o", obj]) or _run(
            [*cxx, "-shared", obj, openmp_runtime, f"-Wl,-rpath,{os.path.dirname(openmp_runtime)}", "-o", out])
    finally:
        if os.path.exists(obj):
            os.remove(obj)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _intact(so: str) -> bool:
    """Whether ``so`` is the library its build wrote (its SHA-256 file matches)."""
    try:
        with open(f"{so}.sha256") as f:
            return f.read().strip() == _sha256(so)
    except OSError:
        return False


def _build_into(cxx: list[str], src_path: str, so: str, runtime: str | None) -> str | None:
    """Build ``so`` (temporary name, checksum file, rename); None on success, else why not."""
    tmp = f"{so}.tmp-{os.getpid()}"
    try:
        why = _build(cxx, src_path, tmp, runtime)
        if why is None:
            with open(f"{so}.sha256.tmp-{os.getpid()}", "w") as f:
                f.write(_sha256(tmp) + "\n")
            os.replace(f"{so}.sha256.tmp-{os.getpid()}", f"{so}.sha256")
            os.replace(tmp, so)
        return why
    except OSError as e:
        return str(e)
    finally:
        for leftover in (tmp, f"{so}.sha256.tmp-{os.getpid()}"):
            if os.path.exists(leftover):
                os.remove(leftover)


def _source_with_headers(src_path: str) -> bytes:
    """The source's bytes followed by those of each header it includes from its own folder
    (``#include "x.h"``): what the build's hash covers, so a changed header rebuilds its users."""
    with open(src_path, "rb") as f:
        src = f.read()
    out = [src]
    for name in re.findall(rb'^\s*#\s*include\s+"([^"]+)"', src, flags=re.M):
        header = os.path.join(os.path.dirname(src_path), name.decode())
        if os.path.isfile(header):
            with open(header, "rb") as f:
                out.append(b"\0" + name + b"\0" + f.read())
    return b"".join(out)


def load_library(name: str, openmp: bool = False) -> ctypes.CDLL | None:
    """The compiled ``csrc/<name>`` (built once per source hash), or None when it cannot be built.

    ``openmp``: build against the OpenMP runtime already loaded (see the module docstring); falls
    back to a build without OpenMP when there is none or that build fails.
    """
    if (name, openmp) not in _LOADED:
        _LOADED[(name, openmp)] = _load(name, openmp)
    return _LOADED[(name, openmp)]


def build_error(name: str, openmp: bool = False) -> str | None:
    """Why ``load_library(name, openmp)`` gave None (the compiler's message, or what is missing); None
    when it gave a library or has not been called."""
    if _LOADED.get((name, openmp), True) is not None:
        return None
    return _WHY.get((name, openmp), "unknown")


def _load(name: str, openmp: bool) -> ctypes.CDLL | None:
    lib, why = _build_and_open(name, openmp)
    if lib is None:
        _WHY[(name, openmp)] = why
    return lib


def _build_and_open(name: str, openmp: bool) -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not); a build problem also warns once (``_warn_once``)."""
    src_path = csrc_path(name)
    label = os.path.relpath(name, os.path.dirname(_HERE)) if os.path.isabs(name) else f"csrc/{name}"
    cxx, shown = _compiler()
    if cxx is None:  # no compiler at all (documented: the Python path)
        return None, "no C++ compiler found (c++, g++ or clang++ on PATH, or $CXX)"
    if not os.path.exists(src_path):  # a build without the sources
        return None, f"{label} is missing from this installation"
    if not cxx or shutil.which(cxx[0]) is None:
        why = (f"ftlib: CXX={shown!r} names no executable C++ compiler, so {label} and the other C++ "
               f"CPU kernels are not built (cache: {os.path.join(cache_root(), 'csrc')}). Set CXX to an "
               "installed compiler (CXX=g++, CXX='ccache g++'), or unset it to use c++ / g++ / clang++ "
               "from PATH.")
        _warn_once(why)
        return None, why
    src = _source_with_headers(src_path)
    runtime = loaded_openmp_runtime() if openmp else None
    why = ""
    for rt in ([runtime, None] if runtime else [None]):
        key = hashlib.sha256(src + (b"\0openmp:" + rt.encode() if rt else b"")).hexdigest()[:16]
        out_dir = os.path.join(cache_root(), "csrc", key)
        so = os.path.join(out_dir, f"libftlib_{os.path.splitext(os.path.basename(name))[0]}.so")
        intact = _intact(so)
        try:
            os.makedirs(out_dir, exist_ok=True)
            if not (intact or os.access(out_dir, os.W_OK)):
                raise PermissionError(13, "not writable")
        except OSError as e:
            why = (f"ftlib: cannot write the C++ kernel cache {out_dir} ({e.strerror or e}), so {label} "
                   f"is not built (compiler {shown}). Set FTLIB_CACHE_DIR to a writable directory.")
            _warn_once(why)
            return None, why
        if not intact:  # missing, cut short, or not the library this build wrote: (re)build it
            why = _build_into(cxx, src_path, so, rt)
            if why is not None:
                continue  # the OpenMP build failing falls back to the plain one
        try:
            return ctypes.CDLL(so), ""
        except OSError as e:
            why = str(e)
    why = (f"ftlib: the C++ compiler {shown} could not build {label} into {os.path.join(cache_root(), 'csrc')}"
           f": {why}. Install a working C++17 compiler or set CXX to one.")
    _warn_once(why)
    return None, why


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
