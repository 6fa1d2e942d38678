"""The backend switches: one ``FTLIB_<FAMILY>_BACKEND`` variable per op family, read here and nowhere else.

Every switch has one vocabulary: ``auto`` (the default: each call takes the fastest backend that can
run it) or the name of one backend, which is then forced. An unknown value is a ``ValueError`` naming
the variable and the allowed values; a forced backend that cannot run a call (``cpu`` when the C++
build failed or the tensors are not fp32 on CPU, ``triton`` without CUDA, ``flash`` without
flash-attn) is a ``RuntimeError`` naming why, never a silent fallback. Under ``auto`` a C++ build
that fails warns once with the compiler's message (``ftlib._cbuild``) and the PyTorch path runs.

=======================  =====================================  ==========================================
variable                 values (default ``auto``)              where it is decided
=======================  =====================================  ==========================================
FTLIB_ATTN_BACKEND       auto | flash | triton | sdpa | cpu |   ``ftlib.kernels.attention``: flash-attn,
                         torch                                  the Triton kernel, PyTorch's SDPA (per
                                                                document; ATen's CPU flash kernels), the
                                                                CPU wing's packed fp32 flash kernel
                                                                (``ftlib.cpu.attention``), the float64-
                                                                exact reference
FTLIB_LORA_BACKEND       auto | triton | cpu | torch            ``ftlib.kernels.lora``: the fused Triton
                                                                LoRA matmul, the CPU wing's LoRA layer
                                                                (dropout mask and masked products in C++,
                                                                the base GEMM on the linear family), the
                                                                PyTorch ops
FTLIB_LINEAR_BACKEND     auto | cpu | torch                     ``ftlib.kernels.linear``: fp32 products
                                                                with a frozen weight on oneDNN
                                                                (``ftlib.cpu.linear``), or ``F.linear``
FTLIB_RMSNORM_BACKEND    auto | cpu | torch                     ``ftlib.kernels.rmsnorm``
FTLIB_ROPE_BACKEND       auto | cpu | torch                     ``ftlib.kernels.rope``
FTLIB_SWIGLU_BACKEND     auto | cpu | torch                     ``ftlib.kernels.swiglu``
FTLIB_XENT_BACKEND       auto | cpu | torch                     ``ftlib.kernels.xent_block`` (the chunked
                                                                loss's softmax step)
FTLIB_AUGMENT_BACKEND    auto | triton | torch                  ``ftlib.kernels.augment``
FTLIB_NF4_BACKEND        auto | bnb | torch                     ``ftlib.lora.nf4`` (bitsandbytes' NF4
                                                                dequantization on CUDA)
FTLIB_PACK_BACKEND       auto | cpp | numpy                     ``ftlib.data.packing`` (best-fit
                                                                decreasing packing, a data-path kernel)
=======================  =====================================  ==========================================

``cpu`` always names the CPU wing's kernels (``ftlib.cpu``: C++ built on first use, or oneDNN for the
linear family), ``torch`` the PyTorch ops (the reference). Under ``torch.compile`` ``auto`` takes the
PyTorch ops (inductor fuses them itself) except for attention and LoRA, whose CPU ops are opaque
custom ops. Other ``FTLIB_*`` variables are not switches: ``FTLIB_CACHE_DIR`` (built libraries),
``FTLIB_ATTN_AUTOTUNE`` / ``FTLIB_LORA_AUTOTUNE`` (Triton autotuning on/off), ``FTLIB_PEAK_TFLOPS``
(the MFU denominator).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

__all__ = ["BACKENDS", "backend_choice", "cannot_run", "cpu_or_torch"]

# variable -> the values it accepts ("auto" first: the default)
BACKENDS: dict[str, tuple[str, ...]] = {
    "FTLIB_ATTN_BACKEND": ("auto", "flash", "triton", "sdpa", "cpu", "torch"),
    "FTLIB_LORA_BACKEND": ("auto", "triton", "cpu", "torch"),
    "FTLIB_LINEAR_BACKEND": ("auto", "cpu", "torch"),
    "FTLIB_RMSNORM_BACKEND": ("auto", "cpu", "torch"),
    "FTLIB_ROPE_BACKEND": ("auto", "cpu", "torch"),
    "FTLIB_SWIGLU_BACKEND": ("auto", "cpu", "torch"),
    "FTLIB_XENT_BACKEND": ("auto", "cpu", "torch"),
    "FTLIB_AUGMENT_BACKEND": ("auto", "triton", "torch"),
    "FTLIB_NF4_BACKEND": ("auto", "bnb", "torch"),
    "FTLIB_PACK_BACKEND": ("auto", "cpp", "numpy"),
}


def backend_choice(variable: str) -> str:
    """The value of the switch ``variable`` (stripped, lower case; ``auto`` when unset or empty), checked
    against ``BACKENDS``: a one-line ValueError naming the variable and its allowed values otherwise."""
    allowed = BACKENDS[variable]
    want = os.environ.get(variable, "").strip().lower() or "auto"
    if want not in allowed:
        raise ValueError(f"{variable}={os.environ[variable]!r}: expected one of {'|'.join(allowed)}")
    return want


def cannot_run(variable: str, backend: str, why: str) -> RuntimeError:
    """The error for a forced backend that cannot run a call: ``<variable>=<backend> cannot run this
    call: why`` (raise it)."""
    return RuntimeError(f"{variable}={backend} cannot run this call: {why}")


def cpu_or_torch(variable: str, cpu_unsupported: Callable[[], str | None]) -> str:
    """``cpu`` or ``torch`` for a family whose backends are the CPU wing's kernel and the PyTorch ops.

    ``cpu_unsupported()`` says why the kernel cannot take this call (None when it can). ``auto``: ``cpu``
    when it can, outside ``torch.compile`` (inductor fuses the PyTorch ops itself); forced ``cpu``: a
    RuntimeError naming why it cannot.
    """
    want = backend_choice(variable)
    if want == "torch":
        return "torch"
    if want == "cpu":
        why = cpu_unsupported()
        if why is not None:
            raise cannot_run(variable, "cpu", why)
        return "cpu"
    if torch.compiler.is_compiling():
        return "torch"
    return "cpu" if cpu_unsupported() is None else "torch"
