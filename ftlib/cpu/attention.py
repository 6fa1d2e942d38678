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

It takes fp32 CPU tensors with a head dim that is a multiple of 8 on an AVX2 + FMA core once
``csrc/flash_attn.cpp`` builds (``flash_attn_cpu_unsupported`` says why not). Callers go through
``ftlib.kernels.attention`` (its ``cpu`` backend, ``FTLIB_ATTN_BACKEND``); the reference is
``ftlib.kernels.attention_ref``.
"""

from __future__ import annotations

import torch

from ftlib._cbuild import tensor_ptr as _ptr

from ._library import library, threads, why_not

__all__ = ["flash_attn_cpu_backward", "flash_attn_cpu_forward", "flash_attn_cpu_unsupported"]


def flash_attn_cpu_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernel cannot take varlen q [N, Hq, D], k and v [N, Hkv, D] (None when it can)."""
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (q, k, v)):
        return f"the C++ kernel takes fp32 CPU tensors, got q {q.dtype} on {q.device}"
    if not (all(t.dim() == 3 for t in (q, k, v)) and q.shape[-1] % 8 == 0 and q.shape[-1] == k.shape[-1] == v.shape[-1]
            and k.shape[1] == v.shape[1] and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0):
        return (f"needs varlen q [N, Hq, D], k and v [N, Hkv, D] with D a multiple of 8 and Hq a multiple of Hkv, "
                f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return why_not("flash_attn")


def _documents(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """cu_seqlens as int64 after checking what the kernel reads blindly: integer, 1-D, rising from 0 to n."""
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"flash_attn_cpu: cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64).contiguous()
    if cu.dim() != 1 or cu.numel() == 0 or int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"flash_attn_cpu: cu_seqlens must rise from 0 to N={n} (1-D), got "
                         f"{cu_seqlens.flatten()[:8].tolist()}{'...' if cu_seqlens.numel() > 8 else ''}")
    return cu


def _checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
             **same_as_q: torch.Tensor) -> torch.Tensor:
    """cu_seqlens as int64 after checking what the kernel reads blindly (shapes, dtype, document
    bounds); a ValueError names the argument."""
    why = flash_attn_cpu_unsupported(q, k, v)
    if why is not None:
        raise ValueError(f"flash_attn_cpu: {why}")
    if not (k.shape == v.shape and k.shape[0] == q.shape[0]):
        raise ValueError(f"flash_attn_cpu: k {tuple(k.shape)} and v {tuple(v.shape)} must be [N={q.shape[0]}, Hkv, D]")
    for name, t in same_as_q.items():
        if t.shape != q.shape or t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"flash_attn_cpu: {name} must be fp32 on CPU shaped like q {tuple(q.shape)}, "
                             f"got {tuple(t.shape)} {t.dtype} {t.device}")
    return _documents(cu_seqlens, q.shape[0])


def flash_attn_cpu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [N, Hq, D], lse [Hq, N]) for fp32 q [N, Hq, D], k, v [N, Hkv, D] and documents ``cu_seqlens``
    (rising from 0 to N); a ValueError where ``flash_attn_cpu_unsupported`` names a reason."""
    cu = _checked(q, k, v, cu_seqlens)
    n, hq, d = q.shape
    hkv = k.shape[1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = q.new_empty((hq, n))
    library("flash_attn").ft_flash_attn_fwd(_ptr(q), _ptr(k), _ptr(v), _ptr(o), _ptr(lse), _ptr(cu), cu.numel() - 1, n, hq,
                                 hkv, d, int(causal), float(scale), threads("flash_attn", q.numel()))
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
    library("flash_attn").ft_flash_attn_bwd(_ptr(do), _ptr(q), _ptr(k), _ptr(v), _ptr(o), _ptr(lse), _ptr(dq), _ptr(dk),
                                 _ptr(dv), _ptr(cu), cu.numel() - 1, n, hq, hkv, d, int(causal), float(scale),
                                 threads("flash_attn", q.numel()))
    return dq, dk, dv
