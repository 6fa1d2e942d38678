"""The fused LoRA matmul: one op for a frozen base layer plus its low-rank update.

    y = x W^T + b + s (drop(x) A^T) B^T                                      (LoRA, rsLoRA)
    y = x W^T + b + (c - 1) (drop(x) W^T) + c s (drop(x) A^T) B^T,  c = m / n   (DoRA)

with W dense or NF4 (``ftlib.lora.NF4Linear``, QLoRA), differentiable in x, A, B and m (the base
is frozen). The math, the dropout stream and the PyTorch reference are in ``lora_ref.py``; the
Triton kernels in ``lora_triton.py`` / ``_lora_kernels.py`` (bytes, FLOPs and where the time goes
are in the latter's docstring). ``LoRALinear.forward`` calls this op on CUDA.

Backend choice (``FTLIB_LORA_BACKEND=auto|triton|cpu|torch``, ``ftlib._backends``), read by
``lora_backend`` for the whole LoRA layer (``LoRALinear`` asks it once per call):

- ``auto`` (default): the Triton kernels when Triton is installed, x is on CUDA, the compute dtype
  is float16 / bfloat16 and the rank is <= 256; the CPU wing's layer for fp32 on CPU outside
  ``torch.compile`` (``ftlib.lora``'s CPU path: the frozen base on the linear family's oneDNN GEMM,
  the dropout mask and masked products in ``ftlib.cpu.lora_dropout`` where its C++ builds and the
  rank is a multiple of 8 up to 64, PyTorch ops for them otherwise); the PyTorch reference otherwise
  (CUDA float32, where cuBLAS's exact fp32 GEMM is the stronger choice, float64, larger ranks).
- ``triton`` forces the kernels: an error (not a fallback) when Triton is missing, x is not on
  CUDA (the CPU interpreter, TRITON_INTERPRET=1, counts for testing), the dtype is not
  float16 / bfloat16 / float32 or the rank exceeds 256.
- ``cpu`` forces the CPU wing's layer: an error when x is not fp32 on CPU, the C++ kernels did not
  build (the compiler's message) or the rank is not a multiple of 8 up to 64.
- ``torch`` forces the reference (and the LoRA layer's PyTorch path).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ftlib._backends import BACKENDS, backend_choice, cannot_run
from ftlib.cpu import lora_cpu_unsupported

from .lora_ref import lora_matmul_ref

__all__ = ["lora_backend", "lora_cpu_kernels", "lora_matmul"]

_VAR = "FTLIB_LORA_BACKEND"
_BACKENDS = BACKENDS[_VAR]
_AUTO_DTYPES = (torch.float16, torch.bfloat16)
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_RANK = 256  # lora_triton.MAX_RANK, repeated so this module does not import Triton


def _choose(want: str, *, is_cuda: bool, dtype: torch.dtype, rank: int, have_triton: bool,
            interpret: bool, cpu_why: str | None = "the CPU kernels are not considered here",
            compiling: bool = False, is_cpu: bool = False) -> str:
    """The backend for one call; pure, so the whole decision table is testable without a GPU.
    ``cpu_why``: why the CPU wing's layer cannot run the call (None when it can)."""
    if want not in _BACKENDS:
        raise ValueError(f"{_VAR}={want!r}: expected one of {'|'.join(_BACKENDS)}")
    if want == "torch":
        return "torch"
    if want == "cpu":
        if cpu_why is not None:
            raise cannot_run(_VAR, "cpu", cpu_why)
        return "cpu"
    if want == "triton":
        if not have_triton:
            raise RuntimeError("FTLIB_LORA_BACKEND=triton but triton is not installed (pip install triton)")
        if not (is_cuda or interpret):
            raise RuntimeError("FTLIB_LORA_BACKEND=triton: the Triton kernels need CUDA tensors "
                               "(or TRITON_INTERPRET=1 for CPU testing)")
        if dtype not in _TRITON_DTYPES:
            raise RuntimeError(f"FTLIB_LORA_BACKEND=triton cannot run this call: the kernels support "
                               f"float16/bfloat16/float32, got {dtype}")
        if rank > _MAX_RANK:
            raise RuntimeError(f"FTLIB_LORA_BACKEND=triton cannot run this call: rank {rank} > {_MAX_RANK}")
        return "triton"
    if is_cuda and have_triton and dtype in _AUTO_DTYPES and rank <= _MAX_RANK:
        return "triton"
    if is_cpu and dtype == torch.float32 and not compiling:
        return "cpu"  # auto: the C++ products where cpu_why allows, PyTorch ops for them otherwise
    return "torch"


def _cpu_why(x: torch.Tensor, dtype: torch.dtype, rank: int) -> str | None:
    if x.device.type != "cpu" or not (x.dtype == dtype == torch.float32):
        return f"the CPU LoRA layer takes fp32 CPU inputs, got {dtype} on {x.device}"
    return lora_cpu_unsupported(rank)


def lora_backend(x: torch.Tensor, dtype: torch.dtype | None = None, rank: int = 16) -> str:
    """``triton``, ``cpu`` or ``torch``: the backend of the LoRA layer for input ``x`` (compute dtype
    ``dtype``); ``lora_matmul`` itself runs the Triton kernels or the reference."""
    want = backend_choice(_VAR)
    dtype = dtype or x.dtype
    return _choose(
        want, is_cuda=x.is_cuda, dtype=dtype, rank=rank,
        # the spec search only where Triton can be chosen (it walks sys.path: ~0.1 ms a LoRA call on CPU)
        have_triton=(x.is_cuda or want == "triton") and importlib.util.find_spec("triton") is not None,
        interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
        cpu_why=_cpu_why(x, dtype, rank) if want == "cpu" else None, compiling=torch.compiler.is_compiling(),
        is_cpu=x.device.type == "cpu",
    )


def lora_matmul(
    x: torch.Tensor,
    weight,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    *,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed: int = 0,
    offset: int = 0,
    magnitude: torch.Tensor | None = None,
    weight_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """A LoRA / DoRA linear layer in one op; x [..., in] -> [..., out] in x's dtype.

    Args:
        x: input [..., in], float16 / bfloat16 / float32 (float64 on the torch backend).
        weight (torch.Tensor | NF4Linear): the frozen base, a tensor [out, in] (cast to x's dtype if it differs) or an
            ``NF4Linear`` (dequantized tile by tile inside the kernel; its bias is not used:
            pass ``bias``).
        lora_A: [r, in] (any float dtype; gradients come back in it).
        lora_B: [out, r] (any float dtype; gradients come back in it).
        scaling: s (alpha / r, or alpha / sqrt(r) for rsLoRA).
        bias: [out] or None, frozen.
        dropout_p: LoRA dropout on the adapter's input, in [0, 1) (realised to 2^-16).
        seed: the dropout stream's seed, an integer in [0, 2^62); the same (seed, offset) pair
            gives the same mask on every backend (``ftlib.kernels.lora_ref.dropout_mask_ref``).
        offset: the dropout stream's offset, an integer in [0, 2^62).
        magnitude: DoRA's m [out] (trainable), or None for LoRA.
        weight_norm: DoRA's n = ||W + s B A||_row [out], treated as a constant; computed with
            ``ftlib.lora.dora_row_norm`` when None (``LoRALinear`` passes its cached one).

    The base weight and bias must not require grad (no gradient is computed for them).
    """
    rank = lora_A.shape[0] if isinstance(lora_A, torch.Tensor) and lora_A.dim() == 2 else 1
    kwargs = dict(bias=bias, dropout_p=dropout_p, seed=seed, offset=offset, magnitude=magnitude,
                  weight_norm=weight_norm)
    if lora_backend(x, rank=rank) == "triton":
        from .lora_triton import lora_matmul_triton

        return lora_matmul_triton(x, weight, lora_A, lora_B, scaling, **kwargs)
    return lora_matmul_ref(x, weight, lora_A, lora_B, scaling, **kwargs)


def lora_cpu_kernels(x: torch.Tensor, dtype: torch.dtype | None = None, rank: int | None = None) -> bool:
    """Whether the LoRA layer's C++ kernels (``ftlib.cpu.lora_dropout``: the dropout mask, the masked
    products, the one-node layer) run for input ``x``: the backend is ``cpu`` and they take ``rank``
    (any rank for the mask alone)."""
    return lora_backend(x, dtype, 8 if rank is None else rank) == "cpu" and lora_cpu_unsupported(rank) is None
