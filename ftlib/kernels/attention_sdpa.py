"""Attention through PyTorch's ``scaled_dot_product_attention``: the fast path off CUDA, the fallback on it.

Same signature and semantics as ``attention_ref`` (the float64 test oracle; see its docstring
for the math, the layouts and bottom-right causal alignment), computed by fused kernels
instead of materialised score matrices:

- varlen ``[N, H, D]`` with ``cu_seqlens``: one SDPA call per document (packed fp32 calls on CPU
  go to the CPU wing's kernel instead, ``attention_cpu``, unless ``FTLIB_ATTN_BACKEND=sdpa``): on CPU the forward and
  backward are ATen's CPU flash-attention kernels (``_scaled_dot_product_flash_attention_for_cpu``
  and its ``_backward``): tiles of the scores live in cache only, backward keeps just the output
  and the per-row log-sum-exp (Dao 2023, FlashAttention-2), and grouped-query heads are read in
  place (no repeated K/V). Elsewhere (CUDA without flash-attn or Triton, or a torch without those
  ops) the forward runs ``F.scaled_dot_product_attention`` per document and the backward
  recomputes each document's probabilities P and applies the softmax-attention gradient
  (dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = s dS K, dK = s dS^T Q) one document at a
  time, so only one document's [H, L, L] scores exist at once.
  The per-document loop runs inside a custom op (``ftlib::sdpa_varlen``), opaque to
  ``torch.compile``: a decoder block with packed attention compiles without a graph break, and
  the document layout can change every step without a recompile.
- dense ``[B, T, H, D]``: one SDPA call with ``is_causal`` (Tq == Tk, no padding mask) or an
  explicit boolean mask (bottom-right causal AND ``key_padding_mask``). A query row that may see
  no key returns zeros, as in the reference: it is given every key (so no NaN appears in forward
  or backward) and its output is then zeroed, which also zeroes its gradient.

Measured on a 2-core CPU (fp32, Hq/Hkv = 8/4, head dim 64, one packed row of 2048 tokens, forward
+ backward; see ``benchmarks/NOTES.md``): per-document calls beat one call with a block-diagonal
mask by 4-20x (the CPU kernel does not skip fully masked tiles), and the reference by 3-8x.
``flex_attention`` with a document mask has no backward on CPU (torch 2.13), so it is not used.

Separate key segments (``cu_seqlens_k``; see ``attention_ref``): one SDPA call per segment pair,
its bottom-right causal / window mask explicit (``_dense`` with Tq != Tk), autograd through SDPA.

``sliding_window`` (see ``attention_ref``) joins the explicit boolean mask: dense calls take it in
their mask, varlen calls run one masked SDPA call per document (autograd through SDPA; the C++
kernel has no window). ``softcap`` changes the scores inside the softmax, which no SDPA kernel
does, so soft-capped calls run ``attention_ref``'s math (scores materialised per document group).
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

from .attention_ref import (
    attention_ref,
    check_attention_inputs,
    check_cu_seqlens,
    check_cu_seqlens_dtype,
    check_window_softcap,
    segment_pairs,
)

__all__ = ["attention_sdpa"]

_GQA_KW = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa= exists


def _cpu_flash_available() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")


def _sdpa(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """F.scaled_dot_product_attention on (B, H, T, D) with grouped K/V heads."""
    if _GQA_KW:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


# id(cu_seqlens) -> (weak reference, version counter, N, segments). Every layer of a forward (and its
# backward) passes the same cu_seqlens tensor: on CUDA its boundaries are read to the host once per
# batch, not once per layer and direction (a device sync each).
_SEGMENTS: dict[int, tuple] = {}


def _segments(cu_seqlens: torch.Tensor, n: int) -> list[tuple[int, int]]:
    try:
        tag = (cu_seqlens._version, n)
    except RuntimeError:  # an inference tensor has no version counter: not cached
        tag = None
    hit = _SEGMENTS.get(id(cu_seqlens))
    if tag is not None and hit is not None and hit[0]() is cu_seqlens and hit[1] == tag:
        return hit[2]
    cu = check_cu_seqlens(cu_seqlens, n)
    segs = [(s, e) for s, e in zip(cu, cu[1:]) if e > s]
    if tag is not None:
        if len(_SEGMENTS) >= 16:  # a handful of live layouts at most (micro-batches, chosen / rejected)
            _SEGMENTS.clear()
        _SEGMENTS[id(cu_seqlens)] = (weakref.ref(cu_seqlens), tag, segs)
    return segs


def _heads_first(t: torch.Tensor, s: int, e: int) -> torch.Tensor:
    return t[s:e].transpose(0, 1).unsqueeze(0)  # (1, H, L, D): a view of the varlen (L, H, D) rows


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("ftlib::sdpa_varlen", mutates_args=())
def _varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """o (N, Hq, D), lse (Hq, N) in fp32 (fp64 for fp64) — lse is zero on the recompute path."""
    o = torch.empty_like(q)  # every row belongs to one segment: all of o is written
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=_acc_dtype(q.dtype), device=q.device)
    flash = q.device.type == "cpu" and _cpu_flash_available()
    for s, e in _segments(cu_seqlens, q.shape[0]):
        qs, ks, vs = (_heads_first(t, s, e) for t in (q, k, v))
        if flash:
            out, l_s = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, ks, vs, 0.0, causal,
                                                                                      scale=scale)
            lse[:, s:e] = l_s[0]
        else:
            out = _sdpa(qs, ks, vs, is_causal=causal, scale=scale)
        o[s:e] = out[0].transpose(0, 1)
    return o, lse


@_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, causal, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=_acc_dtype(q.dtype))


@torch.library.custom_op("ftlib::sdpa_varlen_backward", mutates_args=())
def _varlen_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                lse: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    flash = q.device.type == "cpu" and _cpu_flash_available()
    for s, e in _segments(cu_seqlens, q.shape[0]):
        qs, ks, vs, dos = (_heads_first(t, s, e) for t in (q, k, v, do))
        if flash:
            os_ = _heads_first(o, s, e)
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dos, qs, ks, vs, os_, lse[None, :, s:e], 0.0, causal, scale=scale)
        else:
            gq, gk, gv = _doc_backward(dos[0], qs[0], ks[0], vs[0], _heads_first(o, s, e)[0], causal, scale)
        dq[s:e], dk[s:e], dv[s:e] = gq[0].transpose(0, 1), gk[0].transpose(0, 1), gv[0].transpose(0, 1)
    return dq, dk, dv


def _doc_backward(do, q, k, v, o, causal, scale):
    """Softmax-attention gradients of one document, (H, L, D) each, P recomputed (see the docstring)."""
    hq, n, d = q.shape
    hkv = k.shape[0]
    acc = _acc_dtype(q.dtype)
    qf, dof, of = (t.to(acc).reshape(hkv, hq // hkv, n, d) for t in (q, do, o))  # (Hkv, G, L, D)
    kf, vf = k.to(acc), v.to(acc)  # (Hkv, L, D)
    s = torch.einsum("hgqd,hkd->hgqk", qf, kf) * scale
    if causal:
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    p = torch.softmax(s, dim=-1)
    dv = torch.einsum("hgqk,hgqd->hkd", p, dof)
    ds = p * (torch.einsum("hgqd,hkd->hgqk", dof, vf) - (dof * of).sum(-1, keepdim=True))
    dq = torch.einsum("hgqk,hkd->hgqd", ds, kf).reshape(hq, n, d) * scale
    dk = torch.einsum("hgqk,hgqd->hkd", ds, qf) * scale
    return (dq.to(q.dtype)[None], dk.to(k.dtype)[None], dv.to(v.dtype)[None])


@_varlen_bwd.register_fake
def _(do, q, k, v, o, lse, cu_seqlens, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, causal, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _varlen_bwd(do, q, k, v, o, lse, cu_seqlens, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def _dense(q, k, v, causal, scale, key_padding_mask, window=None):
    b, tq, hq, d = q.shape
    tk = k.shape[1]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D) views
    if window is not None and window >= tk:
        window = None  # no key is that far back
    if key_padding_mask is None and window is None and (not causal or tq == tk):
        return _sdpa(qt, kt, vt, is_causal=causal, scale=scale).transpose(1, 2)
    allowed = torch.ones(tq, tk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.tril(allowed, diagonal=tk - tq)  # bottom-right: query i sees keys j <= i + Tk - Tq
    if window is not None:  # and keys j > i + Tk - Tq - W only
        allowed = allowed & ~torch.tril(torch.ones_like(allowed), diagonal=tk - tq - window)
    allowed = allowed.view(1, 1, tq, tk)
    if key_padding_mask is not None:
        if key_padding_mask.shape != (b, tk):
            raise ValueError(
                f"attention: key_padding_mask must be [B, Tk]={(b, tk)}, got {tuple(key_padding_mask.shape)}")
        allowed = allowed & key_padding_mask.bool().view(b, 1, 1, tk)
    seen = allowed.any(-1, keepdim=True)  # (B or 1, 1, Tq, 1): rows with at least one key
    o = _sdpa(qt, kt, vt, attn_mask=allowed | ~seen, scale=scale)
    return o.masked_fill(~seen, 0.0).transpose(1, 2)


def attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    softmax_scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """Attention over dense [B, T, H, D] or varlen [N, H, D] inputs via SDPA; o shaped like q.

    ``max_seqlen`` / ``max_seqlen_k`` are accepted for signature parity and not needed (documents
    come from ``cu_seqlens`` / ``cu_seqlens_k``).
    """
    dense = q.dim() == 4
    check_attention_inputs(q, k, v, dense, separate_k=cu_seqlens_k is not None)
    check_window_softcap(sliding_window, softcap)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if softcap is not None:
        return attention_ref(q, k, v, causal=causal, cu_seqlens=cu_seqlens, softmax_scale=scale,
                             key_padding_mask=key_padding_mask, sliding_window=sliding_window, softcap=softcap,
                             cu_seqlens_k=cu_seqlens_k)
    if dense:
        if cu_seqlens is not None or cu_seqlens_k is not None:
            raise ValueError("attention: cu_seqlens is for the varlen layout [N, H, D]; q is dense [B, T, H, D]")
        return _dense(q, k, v, causal, scale, key_padding_mask, sliding_window)
    if key_padding_mask is not None:
        raise ValueError("attention: key_padding_mask applies to the dense layout only")
    if cu_seqlens_k is not None:
        cu = [0, q.shape[0]] if cu_seqlens is None else check_cu_seqlens(cu_seqlens, q.shape[0])
        parts = [_dense(q[None, s:e], k[None, ks:ke], v[None, ks:ke], causal, scale, None, sliding_window)[0]
                 for (s, e), (ks, ke) in segment_pairs(cu, cu_seqlens_k, k.shape[0]) if e > s]
        return torch.cat(parts) if parts else torch.empty_like(q)
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    else:
        check_cu_seqlens_dtype(cu_seqlens)  # the values are checked inside the op (no graph break here)
    if sliding_window is not None:
        spans = _segments(cu_seqlens, q.shape[0])
        if any(e - s > sliding_window for s, e in spans):  # else the window hides nothing
            parts = [_dense(q[None, s:e], k[None, s:e], v[None, s:e], causal, scale, None, sliding_window)[0]
                     for s, e in spans]
            return torch.cat(parts) if parts else torch.empty_like(q)
    return _varlen_fwd(q, k, v, cu_seqlens, bool(causal), scale)[0]
