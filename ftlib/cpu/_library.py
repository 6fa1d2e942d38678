"""The CPU wing's one builder and loader: ``ftlib/cpu/csrc/<name>.cpp`` compiled on first use, signatures declared.

Each kernel library exports ``<prefix>_openmp()`` (1 when built with ``-fopenmp``, see
``ftlib._cbuild``) and ``<prefix>_supported(...)`` (AVX2 + FMA at run time) beside its kernels;
``SIGNATURES`` holds their ctypes argument types, so no op module declares a library of its own.
``library(name)`` is the built library or None, ``why_not(name)`` why it is None (the compiler's
message, a missing compiler, a CPU without AVX2 + FMA: the text of a forced backend's error),
``threads(name, n)`` the thread count of one call over n elements.
"""

from __future__ import annotations

import ctypes
import functools
import os

from ftlib._cbuild import build_error, kernel_threads, load_library

__all__ = ["SIGNATURES", "library", "source", "threads", "why_not"]

_P, _I64, _I32, _F32, _U32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_uint32
_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")

# source name -> (symbol prefix, arguments of <prefix>_supported, {kernel: argtypes})
SIGNATURES: dict[str, tuple[str, tuple[int, ...], dict[str, list]]] = {
    "flash_attn": ("ft_flash_attn", (), {
        "ft_flash_attn_fwd": [_P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I32, _F32, _I32],
        "ft_flash_attn_bwd": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I32, _F32,
                              _I32],
    }),
    "lora_dropout": ("ft_lora", (8,), {  # supported(r): AVX2 + FMA and r a multiple of 8 up to 64
        "ft_lora_dropout_mask": [_P, _I64, _I64, _U32, _U32, _U32, _U32, _U32, _I32],
        "ft_lora_masked_xa": [_P, _P, _P, _P, _I64, _I64, _I32, _F32, _I32],
        "ft_lora_masked_dx": [_P, _P, _P, _P, _I64, _I64, _I32, _I32, _I32],
        "ft_lora_masked_da": [_P, _P, _P, _P, _I64, _I64, _I32, _I32],
    }),
    "rmsnorm": ("ft_rmsnorm", (), {
        "ft_rmsnorm_fwd": [_P, _P, _P, _P, _I64, _I64, _F32, _I32],
        "ft_rmsnorm_bwd": [_P, _P, _P, _P, _P, _I64, _I64, _I32],
    }),
    "rope": ("ft_rope", (), {"ft_rope": [_P, _P, _P, _P, _I64, _I64, _I64, _I32, _I32]}),
    "swiglu": ("ft_swiglu", (), {
        "ft_swiglu_fwd": [_P, _P, _P, _I64, _I32],
        "ft_swiglu_bwd": [_P, _P, _P, _P, _P, _I64, _I32],
    }),
    "xent_block": ("ft_xent", (), {"ft_xent_block": [_P, _I64, _I64, _I64, _P, _P, _I32, _I32]}),
}


def source(name: str) -> str:
    """Path of the kernel's C++ source (``ftlib/cpu/csrc/<name>.cpp``, in the wheel too)."""
    return os.path.join(_CSRC, f"{name}.cpp")


@functools.cache
def _open(name: str) -> tuple[ctypes.CDLL | None, str]:
    prefix, probe, kernels = SIGNATURES[name]
    lib = load_library(source(name), openmp=True)
    if lib is None:
        return None, build_error(source(name), openmp=True) or "the C++ library could not be loaded"
    getattr(lib, f"{prefix}_openmp").argtypes = []
    getattr(lib, f"{prefix}_supported").argtypes = [_I32] * len(probe)
    for kernel, argtypes in kernels.items():
        getattr(lib, kernel).argtypes = argtypes
    if not getattr(lib, f"{prefix}_supported")(*probe):
        return None, "this CPU lacks AVX2 + FMA, which the C++ kernels need"
    return lib, ""


def library(name: str) -> ctypes.CDLL | None:
    """The built ``csrc/<name>.cpp`` with its signatures declared, or None (no compiler, a failed build
    (warned once), no AVX2 + FMA)."""
    return _open(name)[0]


def why_not(name: str) -> str | None:
    """Why ``library(name)`` is None, or None when it is built."""
    lib, why = _open(name)
    return None if lib is not None else why


def threads(name: str, n: int) -> int:
    """Threads for a call of ``name``'s kernels over n elements (``ftlib._cbuild.kernel_threads``)."""
    lib = library(name)
    return kernel_threads(bool(getattr(lib, f"{SIGNATURES[name][0]}_openmp")()), n)
