"""Flash attention over packed documents on CPU: fp32 forward and backward in one call each.

Math (Dao 2023, "FlashAttention-2"), per document and query head h (key/value head h // G for
G = Hq / Hkv grouped query heads), scale s, causal mask j <= i:

    S = s Q K^T,   lse = logsumexp_rows(S),   O = exp(S - lse) V
    P = exp(S - lse),  Delta = rowsum(dO * O),  dV = P^T dO,  dS = P * (dO V^T - Delta),
    dQ = s dS K,   dK = s dS^T Q

``csrc/flash_attn.cpp`` streams 64-key blocks against tiles of 64 positions x G query heads
(each key block is packed once for the G heads sharing it), with every product a register-blocked
AVX2 micro-kernel, tiles above the causal diagonal skipped and one task list over all documents
(see the file's header). It replaces one ATen CPU flash-attention call per document and head
group (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), whose
per-call and per-block costs dominate on the short documents of a packed row. ``lse`` has ATen's
definition and layout ([Hq, N], natural log, scores scaled), so either backward reads either
forward's output.

``attention_cpu_backend`` picks it for fp32 CPU tensors with a head dim that is a multiple of 8
on an AVX2 + FMA core once ``csrc/flash_attn.cpp`` builds; ``FTLIB_CPU_ATTN_BACKEND=aten`` (or no
compiler) keeps ATen's kernel. Callers go through ``ftlib.kernels.attention`` (the ``sdpa``
backend's varlen path); the reference is ``attention_ref``.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from ftlib._cbuild import kernel_threads, load_library
from ftlib._cbuild import tensor_ptr as _ptr

from .attention_ref import check_cu_seqlens

__all__ = ["attention_cpu_backend", "flash_attn_cpu_backward", "flash_attn_cpu_forward"]


@functools.cache
def _library():
    """The built ``csrc/flash_attn.cpp`` with its signatures declared, or None (no compiler, no AVX2 + FMA)."""
    lib = load_library("flash_attn.cpp", openmp=True)
    if lib is None or not lib.ft_flash_attn_supported():
        return None
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.ft_flash_attn_openmp.argtypes = []
    lib.ft_flash_attn_fwd.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, i64, i32, f32, i32]
    lib.ft_flash_attn_bwd.argtypes = [p, p, p, p, p, p, p, p, p, p, i64, i64, i64, i64, i64, i32, f32, i32]
    return lib


def _threads(n: int) -> int:
    """Threads for a call over n elements (``ftlib._cbuild.kernel_threads``)."""
    return kernel_threads(bool(_library().ft_flash_attn_openmp()), n)


def attention_cpu_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """``cpp`` (``csrc/flash_attn.cpp``) or ``aten`` (ATen's CPU flash kernels) for varlen q [N, Hq, D],
    k and v [N, Hkv, D] on CPU."""
    want = os.environ.get("FTLIB_CPU_ATTN_BACKEND", "auto").strip().lower()
    if want not in ("auto", "aten"):
        raise ValueError(f"FTLIB_CPU_ATTN_BACKEND={want!r}: expected auto or aten")
    if want == "aten":
        return "aten"
    if (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 3 for t in (q, k, v))
            and q.shape[-1] % 8 == 0 and q.shape[-1] == k.shape[-1] == v.shape[-1]
            and k.shape[1] == v.shape[1] and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0
            and _library() is not None):
        return "cpp"
    return "aten"


def _checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
             **same_as_q: torch.Tensor) -> torch.Tensor:
    """cu_seqlens as int64 after checking what the kernel reads blindly (shapes, dtype, document
    bounds); a ValueError names the argument."""
    if attention_cpu_backend(q, k, v) != "cpp":
        raise ValueError("flash_attn_cpu: needs fp32 CPU q [N, Hq, D], k and v [N, Hkv, D] with D a multiple of 8 "
                         f"and Hq a multiple of Hkv, and the built csrc/flash_attn.cpp; got q {tuple(q.shape)} "
                         f"{q.dtype} {q.device}, k {tuple(k.shape)}, v {tuple(v.shape)} (see attention_cpu_backend)")
    if not (k.shape == v.shape and k.shape[0] == q.shape[0]):
        raise ValueError(f"flash_attn_cpu: k {tuple(k.shape)} and v {tuple(v.shape)} must be [N={q.shape[0]}, Hkv, D]")
    for name, t in same_as_q.items():
        if t.shape != q.shape or t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"flash_attn_cpu: {name} must be fp32 on CPU shaped like q {tuple(q.shape)}, "
                             f"got {tuple(t.shape)} {t.dtype} {t.device}")
    check_cu_seqlens(cu_seqlens, q.shape[0], "flash_attn_cpu")
    return cu_seqlens.to(device="cpu", dtype=torch.int64).contiguous()


def flash_attn_cpu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [N, Hq, D], lse [Hq, N]) for fp32 q [N, Hq, D], k, v [N, Hkv, D] and documents ``cu_seqlens``
    (rising from 0 to N); requires ``attention_cpu_backend(q, k, v) == "cpp"`` (a ValueError otherwise)."""
    cu = _checked(q, k, v, cu_seqlens)
    n, hq, d = q.shape
    hkv = k.shape[1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = q.new_empty((hq, n))
    _library().ft_flash_attn_fwd(_ptr(q), _ptr(k), _ptr(v), _ptr(o), _ptr(lse), _ptr(cu), cu.numel() - 1, n, hq,
                                 hkv, d, int(causal), float(scale), _threads(q.numel()))
    return o, lse


def flash_attn_cpu_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                            lse: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) shaped like q, k, v from the output gradient ``do`` and the forward's o and lse."""
    cu = _checked(q, k, v, cu_seqlens, do=do, o=o)
    n, hq, d = q.shape
    hkv = k.shape[1]
    if lse.shape != (hq, n):
        raise ValueError(f"flash_attn_cpu: lse must be [Hq, N]={(hq, n)} (the forward's), got {tuple(lse.shape)}")
    do, q, k, v, o = (t.contiguous() for t in (do, q, k, v, o))
    lse = lse.to(device="cpu", dtype=torch.float32).contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _library().ft_flash_attn_bwd(_ptr(do), _ptr(q), _ptr(k), _ptr(v), _ptr(o), _ptr(lse), _ptr(dq), _ptr(dk),
                                 _ptr(dv), _ptr(cu), cu.numel() - 1, n, hq, hkv, d, int(causal), float(scale),
                                 _threads(q.numel()))
    return dq, dk, dv
