"""Build a ``csrc/*.cpp`` file into a plain shared library on first use and load it with ctypes.

Used by the data path (``ftlib.data``: packing, the byte-level BPE) and by LoRA's dropout products
on CPU (``ftlib.lora.dropout``).

One library per source file and source hash, under ``$FTLIB_CACHE_DIR/csrc/<hash>/``
(default ``~/.cache/ftlib``), compiled with the system C++ compiler (``$CXX``, else ``c++``,
``g++`` or ``clang++``) as ``-O3 -std=c++17 -shared -fPIC``. A source checkout reads
``<repo>/csrc``; an installed wheel carries the same files as ``ftlib/_csrc``. The library is
written under a temporary name and renamed, so processes building at the same time never load a
half-written file. No compiler, or a failed build, gives ``None``: each caller has a Python path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess

__all__ = ["cache_root", "csrc_path", "load_library", "tensor_ptr"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_LOADED: dict[str, ctypes.CDLL | None] = {}


def cache_root() -> str:
    """``$FTLIB_CACHE_DIR``, else ``~/.cache/ftlib``: where built libraries and derived tables live."""
    return os.environ.get("FTLIB_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "ftlib"))


def csrc_path(name: str) -> str:
    """Path of ``csrc/<name>`` (source checkout) or ``ftlib/_csrc/<name>`` (installed wheel)."""
    repo = os.path.join(os.path.dirname(_HERE), "csrc", name)
    wheel = os.path.join(_HERE, "_csrc", name)
    return repo if os.path.exists(repo) or not os.path.exists(wheel) else wheel


def load_library(name: str) -> ctypes.CDLL | None:
    """The compiled ``csrc/<name>`` (built once per source hash), or None when it cannot be built."""
    if name in _LOADED:
        return _LOADED[name]
    lib = None
    src_path = csrc_path(name)
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx and os.path.exists(src_path):
        src = open(src_path, "rb").read()
        out_dir = os.path.join(cache_root(), "csrc", hashlib.sha256(src).hexdigest()[:16])
        so = os.path.join(out_dir, f"libftlib_{os.path.splitext(name)[0]}.so")
        if not os.path.exists(so):
            os.makedirs(out_dir, exist_ok=True)
            tmp = f"{so}.tmp-{os.getpid()}"
            r = subprocess.run([cxx, "-O3", "-std=c++17", "-shared", "-fPIC", src_path, "-o", tmp],
                               capture_output=True, text=True)
            if r.returncode == 0:
                os.replace(tmp, so)
        if os.path.exists(so):
            lib = ctypes.CDLL(so)
    _LOADED[name] = lib
    return lib


def tensor_ptr(t) -> ctypes.c_void_p:
    """A tensor's data pointer as a ``c_void_p`` argument of a library function."""
    return ctypes.c_void_p(t.data_ptr())
