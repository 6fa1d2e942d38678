"""The attention family's ``cpu`` backend: packed fp32 documents on the CPU wing's flash kernel, as one custom op.

Same signature and semantics as ``attention_ref`` for the calls it takes: varlen q [N, Hq, D], k and v
[N, Hkv, D] with ``cu_seqlens`` (or one document), causal or not, fp32 on CPU with D a multiple of
8, no padding mask, sliding window or soft-cap (``attention_cpu_unsupported`` names what does not
fit; ``ftlib.kernels.attention`` sends the rest to ``attention_sdpa``). The math and the kernel are
``ftlib.cpu.attention``'s (FlashAttention-2 over every document in one call: 1.5-2x ATen's
per-document CPU flash kernels on a packed row). The forward and backward are custom ops
(``ftlib::cpu_flash_attn``), opaque to ``torch.compile`` as ``attention_sdpa``'s varlen op is.
"""

from __future__ import annotations

import math

import torch

from ftlib.cpu import flash_attn_cpu_backward, flash_attn_cpu_forward, flash_attn_cpu_unsupported

from .attention_ref import check_cu_seqlens_dtype

__all__ = ["attention_cpu", "attention_cpu_unsupported"]


def attention_cpu_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_padding_mask=None,
                              sliding_window=None, softcap=None) -> str | None:
    """Why the CPU wing's kernel cannot run this attention call (None when it can)."""
    if q.dim() != 3:
        return f"the C++ kernel takes the varlen layout [N, H, D], got q {tuple(q.shape)}"
    if key_padding_mask is not None or sliding_window is not None or softcap is not None:
        return "the C++ kernel has no key_padding_mask, sliding_window or softcap"
    return flash_attn_cpu_unsupported(q, k, v)


@torch.library.custom_op("ftlib::cpu_flash_attn", mutates_args=())
def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attn_cpu_forward(q, k, v, cu_seqlens, causal, scale)


@_fwd.register_fake
def _(q, k, v, cu_seqlens, causal, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]))


@torch.library.custom_op("ftlib::cpu_flash_attn_backward", mutates_args=())
def _bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
         cu_seqlens: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_attn_cpu_backward(do, q, k, v, o, lse, cu_seqlens, causal, scale)


@_bwd.register_fake
def _(do, q, k, v, o, lse, cu_seqlens, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, causal, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _bwd(do, q, k, v, o, lse, cu_seqlens, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                  cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                  softmax_scale: float | None = None) -> torch.Tensor:
    """Attention over varlen [N, H, D] fp32 CPU inputs on the C++ flash kernel; o shaped like q.

    ``max_seqlen`` is accepted for signature parity and not needed. A ValueError where
    ``attention_cpu_unsupported`` names a reason.
    """
    why = attention_cpu_unsupported(q, k, v)
    if why is not None:
        raise ValueError(f"attention_cpu: {why}")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    else:
        check_cu_seqlens_dtype(cu_seqlens)  # the values are checked inside the op
    return _fwd(q, k, v, cu_seqlens, bool(causal), scale)[0]
