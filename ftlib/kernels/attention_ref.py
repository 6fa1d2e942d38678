"""Pure-PyTorch reference attention: the CPU path, the test oracle and the fallback.

Math (per query row i, head h, key/value head g = h // (Hq / Hkv)):

    s_ij  = scale * <q_i, k_j>            for keys j the query may see
    lse_i = log sum_j exp(s_ij)
    o_i   = sum_j exp(s_ij - lse_i) v_j

A query may see key j when j is in the same document and, if ``causal``, when
``j <= i + (Tk - Tq)`` (bottom-right alignment, the flash-attn >= 2.1 convention,
so a decoding step with Tq=1 sees the whole cache). Rows that see no key at all
(fully padded) return zeros and ``lse = -inf`` instead of NaN.

Two options of the Mistral / Gemma families:

- ``sliding_window`` W: query i sees only keys ``j > i + (Tk - Tq) - W`` (the last W
  positions, its own included: Hugging Face's ``sliding_window``, flash-attn's
  ``window_size=(W - 1, 0)``);
- ``softcap`` c (Gemma-2's ``attn_logit_softcapping``): ``s_ij <- c * tanh(s_ij / c)`` on the
  scaled scores, before masking and the softmax.

Layouts (the ones ``ftlib.kernels.attention`` accepts):

- dense:  q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D], optional ``key_padding_mask``
  [B, Tk] (True/1 = real token);
- varlen: q [N, Hq, D], k/v [N, Hkv, D] with ``cu_seqlens`` int32 [n_docs + 1]
  (cumulative document starts over the N packed tokens); no query attends
  outside its document;
- varlen with separate key segments: q [Nq, Hq, D] with ``cu_seqlens``, k/v [Nk, Hkv, D] with
  ``cu_seqlens_k`` (as many segments): query segment s attends to key segment s only, causal
  bottom-right aligned per pair (``j <= i + (Tk_s - Tq_s)``: the two segments end at the same
  position), the window likewise; flash-attn's ``flash_attn_varlen_func(q, k, v, cu_seqlens_q,
  cu_seqlens_k, ...)``. Context parallelism uses it: local queries over the gathered keys.

Grouped-query attention is computed by viewing the Hq query heads as
[Hkv, Hq/Hkv] groups; K and V are never repeated in memory. Scores are computed
in float32 (float64 stays float64) and the output is cast back to q's dtype.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention_ref", "check_attention_inputs", "check_cu_seqlens", "check_cu_seqlens_dtype", "check_window_softcap",
           "segment_pairs"]


def check_cu_seqlens_dtype(cu_seqlens: torch.Tensor, who: str = "attention") -> None:
    """A ValueError unless ``cu_seqlens`` has an integer dtype (reads no value: no device sync, traceable)."""
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"{who}: cu_seqlens must be an integer tensor (int32 [n_docs + 1], the cumulative "
                         f"document lengths), got {cu_seqlens.dtype}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, n: int, who: str = "attention") -> list[int]:
    """The document boundaries of ``cu_seqlens`` as ints, after checking that it is an integer tensor
    (a float one, ``[0, 4.7, 10]``, was truncated to other boundaries) rising from 0 to n."""
    check_cu_seqlens_dtype(cu_seqlens, who)
    cu = [int(x) for x in cu_seqlens.tolist()] if cu_seqlens.dim() == 1 else []
    if not cu or cu[0] != 0 or cu[-1] != n or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{who}: cu_seqlens must rise from 0 to N={n} (1-D), got "
                         f"{cu_seqlens.flatten()[:8].tolist()}{'...' if cu_seqlens.numel() > 8 else ''}")
    return cu


def segment_pairs(cu_q: list[int], cu_seqlens_k: torch.Tensor, n_k: int,
                  who: str = "attention") -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((q start, q end), (k start, k end)) of every segment pair, after checking that ``cu_seqlens_k``
    rises from 0 to ``n_k`` with as many segments as the queries' ``cu_q``."""
    cu_k = check_cu_seqlens(cu_seqlens_k, n_k, f"{who} (cu_seqlens_k, over the {n_k} key rows)")
    if len(cu_k) != len(cu_q):
        raise ValueError(f"{who}: cu_seqlens_k has {len(cu_k) - 1} segments, cu_seqlens {len(cu_q) - 1}; "
                         f"each query segment needs its key segment")
    return [((a, b), (c, d)) for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]


def check_window_softcap(sliding_window, softcap) -> None:
    """A ValueError naming the argument when ``sliding_window`` is not a positive int or ``softcap`` not > 0."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window <= 0):
        raise ValueError(f"attention: sliding_window must be a positive integer or None, got {sliding_window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"attention: softcap must be a number > 0 or None, got {softcap!r}")


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dense: bool,
                           separate_k: bool = False) -> None:
    """A ValueError naming the shape at fault; ``separate_k`` (varlen with ``cu_seqlens_k``): k's N may differ."""
    want = 4 if dense else 3
    layout = "[B, T, H, D]" if dense else "[N, H, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            raise ValueError(f"attention: {name} must be {layout}, got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"attention: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: head dims differ: q {q.shape[-1]}, k {k.shape[-1]}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"attention: Hq={hq} must be a positive multiple of Hkv={hkv}")
    if dense and q.shape[0] != k.shape[0]:
        raise ValueError(f"attention: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}")
    if not dense and not separate_k and q.shape[0] != k.shape[0]:
        raise ValueError(f"attention: varlen q and k must have the same N, got {q.shape[0]} and {k.shape[0]}")


def _dense(q, k, v, causal, scale, key_padding_mask, segments=None, window=None, softcap=None):
    # q (B, Tq, Hq, D); k, v (B, Tk, Hkv, D)
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(cdt).reshape(b, tq, hkv, g, d)
    kf, vf = k.to(cdt), v.to(cdt)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qf, kf) * scale  # (B, Hkv, G, Tq, Tk)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    allowed = torch.ones(tq, tk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.tril(allowed, diagonal=tk - tq)
    if window is not None:  # keys j > i + (Tk - Tq) - W only
        allowed = allowed & ~torch.tril(torch.ones_like(allowed), diagonal=tk - tq - window)
    allowed = allowed.view(1, 1, 1, tq, tk)
    if key_padding_mask is not None:
        if key_padding_mask.shape != (b, tk):
            raise ValueError(
                f"attention: key_padding_mask must be [B, Tk]={(b, tk)}, got {tuple(key_padding_mask.shape)}"
            )
        allowed = allowed & key_padding_mask.bool().view(b, 1, 1, 1, tk)
    if segments is not None:  # (Tq,) document id per token (Tq == Tk): block-diagonal mask
        allowed = allowed & (segments.view(tq, 1) == segments.view(1, tk)).view(1, 1, 1, tq, tk)
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, Tq)
    p = torch.exp(s - lse.unsqueeze(-1).masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0))
    p = p.masked_fill(~allowed, 0.0)
    o = torch.einsum("bhgqk,bkhd->bqhgd", p, vf).reshape(b, tq, hq, d)
    return o.to(q.dtype), lse.reshape(b, hq, tq)


def attention_ref(
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
    return_lse: bool = False,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
):
    """Reference attention; see the module docstring for layouts and semantics.

    ``cu_seqlens_k`` (varlen only; default: ``cu_seqlens``, keys and queries in the same segments):
    the key segments, one per query segment; ``max_seqlen_k`` is accepted for signature parity.

    Returns ``o`` shaped like ``q`` or, with ``return_lse``, ``(o, lse)`` where
    lse is float32/float64 [B, Hq, Tq] (dense) or [Hq, N] (varlen).
    """
    dense = q.dim() == 4
    check_attention_inputs(q, k, v, dense, separate_k=cu_seqlens_k is not None)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    check_window_softcap(sliding_window, softcap)
    extras = dict(window=sliding_window, softcap=softcap)
    if dense:
        if cu_seqlens is not None or cu_seqlens_k is not None:
            raise ValueError("attention: cu_seqlens is for the varlen layout [N, H, D]; q is dense [B, T, H, D]")
        o, lse = _dense(q, k, v, causal, scale, key_padding_mask, **extras)
        return (o, lse) if return_lse else o
    if key_padding_mask is not None:
        raise ValueError("attention: key_padding_mask applies to the dense layout only")
    n = q.shape[0]
    if cu_seqlens is None:
        cu = [0, n]
    else:
        cu = check_cu_seqlens(cu_seqlens, n)
    o = torch.empty_like(q)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.full((q.shape[1], n), float("-inf"), dtype=cdt, device=q.device)
    if cu_seqlens_k is not None:
        for (s, e), (ks, ke) in segment_pairs(cu, cu_seqlens_k, k.shape[0]):
            if e > s:
                od, ld = _dense(q[None, s:e], k[None, ks:ke], v[None, ks:ke], causal, scale, None, **extras)
                o[s:e] = od[0]
                lse[:, s:e] = ld[0]
        return (o, lse) if return_lse else o
    for s, e, seg in _groups(cu, q.device):
        od, ld = _dense(q[None, s:e], k[None, s:e], v[None, s:e], causal, scale, None, seg, **extras)
        o[s:e] = od[0]
        lse[:, s:e] = ld[0]
    return (o, lse) if return_lse else o


_GROUP_TOKENS = 512  # short documents are batched into one block-diagonal tile of up to this size


def _groups(cu: list[int], device):
    """Runs of consecutive documents of <= _GROUP_TOKENS tokens in all (a longer document alone).

    Yields (start, end, segments) with segments (end - start,) the document index of each token,
    or None for a single document. Packs of many short documents then cost a few dense tiles
    instead of one Python-level attention call per document; the result is the same because the
    mask keeps every query inside its own document.
    """
    i, n_docs = 0, len(cu) - 1
    while i < n_docs:
        j = i + 1
        while j < n_docs and cu[j + 1] - cu[i] <= _GROUP_TOKENS:
            j += 1
        s, e = cu[i], cu[j]
        if e > s:
            if j - i == 1:
                yield s, e, None
            else:
                lens = torch.tensor([cu[d + 1] - cu[d] for d in range(i, j)], device=device)
                yield s, e, torch.repeat_interleave(torch.arange(j - i, device=device), lens)
        i = j
