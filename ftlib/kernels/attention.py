"""Backend choice for the attention op.

``auto`` (default) picks, per call:

1. flash-attn (``flash_attn_func`` / ``flash_attn_varlen_func``) when it is installed, q is on
   CUDA, the dtype is float16/bfloat16 and the head dim is <= 256;
2. the Triton kernel (``attention_triton``) on CUDA otherwise (float16/bfloat16/float32, head
   dim <= 256);
3. on CPU, the CPU wing's flash kernel (``attention_cpu``, ``ftlib.cpu.attention``) for packed
   fp32 calls (varlen layout, head dim a multiple of 8, no padding mask / window / soft-cap) once
   its C++ builds;
4. PyTorch's fused SDPA kernels (``attention_sdpa``) elsewhere: CPU (every other call), and on
   CUDA float64 or head dims > 256.

``FTLIB_ATTN_BACKEND=flash|triton|sdpa|cpu|torch`` forces one (``torch`` is the reference
``attention_ref``, which materialises every score: the test oracle, slow; ``sdpa`` on CPU is ATen's
per-document flash kernels); forcing a backend that is not installed, cannot run on q's device, or
does not support the call's dtype / head dim / layout raises instead of silently falling back. The Triton backend runs on CPU tensors only under
``TRITON_INTERPRET=1`` (the test setup).

Calls with a ``key_padding_mask`` (padded batches with holes, KV-cache decoding) go to SDPA
(or to the reference when ``torch`` is forced): neither fused kernel takes a dense padding mask,
and packed batches use ``cu_seqlens`` instead. A forced backend must still be available, so a
misconfiguration is caught early.

``sliding_window`` and ``softcap`` (Mistral / Gemma; semantics in ``attention_ref``) go to
flash-attn as ``window_size=(W - 1, 0)`` and ``softcap``, to the Triton kernel's constexpr
variants, and to SDPA (a window in the mask; soft-capped calls on the reference math).
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch

from ftlib._backends import BACKENDS, backend_choice, cannot_run

from .attention_cpu import attention_cpu, attention_cpu_unsupported
from .attention_ref import attention_ref, check_cu_seqlens_dtype, check_window_softcap
from .attention_sdpa import attention_sdpa

__all__ = ["attention", "attention_backend"]

_VAR = "FTLIB_ATTN_BACKEND"
_BACKENDS = BACKENDS[_VAR]
_MAX_HEAD_DIM = 256
_HALF = (torch.float16, torch.bfloat16)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _unsupported(backend: str, is_cuda: bool, dtype: torch.dtype, head_dim: int, interpret: bool) -> str | None:
    """Why ``backend`` cannot run this call, or None when it can."""
    if backend == "flash":
        if not is_cuda:
            return "flash-attn needs CUDA tensors"
        if dtype not in _HALF:
            return f"flash-attn supports float16/bfloat16, got {dtype}"
    elif backend == "triton":
        if not (is_cuda or interpret):
            return "the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 for CPU testing)"
        if dtype not in _HALF + (torch.float32,):
            return f"the Triton kernel supports float16/bfloat16/float32, got {dtype}"
    if head_dim > _MAX_HEAD_DIM:
        return f"head dim {head_dim} > {_MAX_HEAD_DIM}"
    return None


def _choose(want: str, *, is_cuda: bool, dtype: torch.dtype, head_dim: int, masked: bool,
            have_flash: bool, have_triton: bool, interpret: bool,
            cpu_why: str | None = "the CPU kernel is not considered here") -> str:
    """The backend for one call; pure, so the whole decision table is testable without a GPU.
    ``cpu_why``: why the CPU wing's kernel cannot run the call (None when it can)."""
    if want not in _BACKENDS:
        raise ValueError(f"{_VAR}={want!r}: expected one of {'|'.join(_BACKENDS)}")
    if want == "flash" and not have_flash:
        raise RuntimeError("FTLIB_ATTN_BACKEND=flash but flash_attn is not installed (pip install flash-attn)")
    if want == "triton" and not have_triton:
        raise RuntimeError("FTLIB_ATTN_BACKEND=triton but triton is not installed (pip install triton)")
    if want in ("flash", "triton") and not (is_cuda or (want == "triton" and interpret)):
        raise RuntimeError(f"FTLIB_ATTN_BACKEND={want}: {_unsupported(want, is_cuda, dtype, head_dim, interpret)}")
    if want in ("torch", "sdpa"):
        return want
    if masked:
        return "sdpa"
    if want == "cpu":
        if cpu_why is not None:
            raise cannot_run(_VAR, "cpu", cpu_why)
        return "cpu"
    if want != "auto":
        why = _unsupported(want, is_cuda, dtype, head_dim, interpret)
        if why is not None:
            raise RuntimeError(f"FTLIB_ATTN_BACKEND={want} cannot run this call: {why}")
        return want
    if not is_cuda:
        return "cpu" if cpu_why is None else "sdpa"
    if have_flash and _unsupported("flash", is_cuda, dtype, head_dim, interpret) is None:
        return "flash"
    if have_triton and _unsupported("triton", is_cuda, dtype, head_dim, interpret) is None:
        return "triton"
    return "sdpa"


def attention_backend(q: torch.Tensor, key_padding_mask: torch.Tensor | None = None, k: torch.Tensor | None = None,
                      v: torch.Tensor | None = None, *, sliding_window: int | None = None,
                      softcap: float | None = None, separate_k: bool = False) -> str:
    """Name of the backend (``flash``, ``triton``, ``sdpa``, ``cpu`` or ``torch``) ``attention`` uses for
    this call (k and v default to q's shape: pass them for grouped-query heads; ``separate_k``: the call
    has key segments of its own, ``cu_seqlens_k``)."""
    want = backend_choice(_VAR)
    if want == "auto" and (q.is_cuda or torch.compiler.is_compiling()):
        # CUDA: never the CPU kernel. Under torch.compile ``auto`` traces the PyTorch ops (as the other
        # CPU families do), and the kernel's library check (ctypes) is not traceable.
        cpu_why = "CUDA tensors" if q.is_cuda else "inside torch.compile (auto traces the PyTorch ops)"
    else:
        cpu_why = attention_cpu_unsupported(
            q, q if k is None else k, q if v is None else v, key_padding_mask=key_padding_mask,
            sliding_window=sliding_window, softcap=softcap)
    if separate_k and cpu_why is None:
        cpu_why = "the C++ kernel has no separate key segments (cu_seqlens_k)"
    return _choose(
        want, is_cuda=q.is_cuda, dtype=q.dtype, head_dim=q.shape[-1], masked=key_padding_mask is not None,
        have_flash=(q.is_cuda or want == "flash") and _installed("flash_attn"),
        have_triton=(q.is_cuda or want == "triton") and _installed("triton"), interpret=_interpret(),
        cpu_why=cpu_why,
    )


def _flash(q, k, v, causal, cu_seqlens, max_seqlen, softmax_scale, sliding_window=None, softcap=None,
           cu_seqlens_k=None, max_seqlen_k=None):
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    extras = {}
    if sliding_window is not None:
        extras["window_size"] = (sliding_window - 1, 0)
    if softcap is not None:
        extras["softcap"] = float(softcap)
    if q.dim() == 4:  # (B, T, H, D): flash-attn's own layout; causal is bottom-right aligned too
        if cu_seqlens is not None or cu_seqlens_k is not None:
            raise ValueError("attention: cu_seqlens / cu_seqlens_k are for the varlen layout [N, H, D]; q is dense "
                             "[B, T, H, D]")
        return flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, **extras)
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    check_cu_seqlens_dtype(cu_seqlens)  # the values stay on the GPU: no sync, as in flash-attn
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    if cu_seqlens_k is None:  # keys in the queries' segments
        cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
    else:  # a segment pair each, causal bottom-right aligned per pair (flash-attn >= 2.1)
        check_cu_seqlens_dtype(cu_seqlens_k)
        cu_seqlens_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
        if cu_seqlens_k.numel() != cu_seqlens.numel():
            raise ValueError(f"attention: cu_seqlens_k has {cu_seqlens_k.numel() - 1} segments, cu_seqlens "
                             f"{cu_seqlens.numel() - 1}; each query segment needs its key segment")
        if max_seqlen_k is None:
            max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) if cu_seqlens_k.numel() > 1 else 0
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens_k, int(max_seqlen), int(max_seqlen_k),
        dropout_p=0.0, softmax_scale=scale, causal=causal, **extras,
    )


def attention(q, k, v, *, causal=True, cu_seqlens=None, max_seqlen=None, softmax_scale=None, key_padding_mask=None,
              sliding_window=None, softcap=None, cu_seqlens_k=None, max_seqlen_k=None):
    """Attention over dense [B, T, H, D] or packed varlen [N, H, D] inputs (GQA allowed).

    ``cu_seqlens_k`` / ``max_seqlen_k`` (varlen): keys k, v [Nk, Hkv, D] in segments of their own,
    query segment s over key segment s, causal bottom-right aligned per pair (flash-attn's
    ``flash_attn_varlen_func`` with cu_seqlens_q != cu_seqlens_k); default: the queries'.

    Same semantics on every backend: see ``attention_ref`` for layouts, bottom-right causal
    alignment, fully masked rows, ``sliding_window`` and ``softcap``; ``attention_backend`` for
    which backend runs.
    """
    check_window_softcap(sliding_window, softcap)
    backend = attention_backend(q, key_padding_mask, k, v, sliding_window=sliding_window, softcap=softcap,
                                separate_k=cu_seqlens_k is not None)
    extras = dict(sliding_window=sliding_window, softcap=softcap)
    if backend == "cpu":
        return attention_cpu(q, k, v, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                             softmax_scale=softmax_scale)
    if cu_seqlens_k is not None:
        extras.update(cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    if backend == "flash":
        return _flash(q, k, v, causal, cu_seqlens, max_seqlen, softmax_scale, **extras)
    if backend == "triton":
        from .attention_triton import attention_triton

        return attention_triton(
            q, k, v, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=softmax_scale,
            **extras,
        )
    if backend == "sdpa":
        return attention_sdpa(
            q, k, v, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
            softmax_scale=softmax_scale, key_padding_mask=key_padding_mask, **extras,
        )
    return attention_ref(
        q, k, v, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        softmax_scale=softmax_scale, key_padding_mask=key_padding_mask, **extras,
    )
