"""Fused attention on GPU: launchers, autotuning and autograd around the Triton kernels.

``attention_triton(q, k, v, *, causal, cu_seqlens, max_seqlen, softmax_scale, return_lse)`` has
the semantics of ``attention_ref`` (dense [B, T, H, D] with bottom-right causal alignment, or
packed varlen [N, H, D] with ``cu_seqlens``; GQA with Hq a multiple of Hkv; rows that see no key
give zeros and lse = -inf) without a key_padding_mask. It is differentiable in q, k and v.

The math, the tiling scheme (FlashAttention-2, Dao 2023, arXiv:2307.08691), the masking rules
and the expected-performance reasoning (bytes and FLOPs per tile, occupancy) are in
``_attention_kernels.py`` beside the kernels. This file chooses tile configurations per GPU,
launches forward (O, lse) and backward (D = rowsum(dO * O), then dK/dV, then dQ: deterministic,
no atomics), and validates inputs.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import triton
from torch.autograd.function import once_differentiable

from . import _attention_kernels as _k
from .attention_ref import check_window_softcap

__all__ = ["KERNELS", "PREPROCESS_BLOCK_M", "attention_triton", "tile_configs"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
_MAX_GRID_YZ = 65535  # CUDA's limit on grid dims y (documents / batch rows) and z (heads)


# ----------------------------------------------------------------------------------------------
# Autotune configurations.
#
# Forward / dQ (a query tile owns an fp32 accumulator BLOCK_M x D):
#   * BLOCK_M=128, BLOCK_N=64, 8 warps, 3 stages: the Hopper and Ampere choice for D <= 128. 128
#     query rows give 128 FLOP/B on K/V traffic (see _attention_kernels.py); 8 warps make two
#     64-row warpgroups for wgmma on Hopper; 3 stages overlap the next K/V load with the softmax.
#   * BLOCK_M=128, BLOCK_N=32, 4 warps, 2 stages: A100 / consumer Ampere (sm_86: 100 KiB shared
#     memory) with D = 128, where 3 stages of 64-key tiles do not fit.
#   * BLOCK_M=64, BLOCK_N=64, 4 warps, 4 stages: short documents (packed batches), where a tall
#     query tile would be mostly past the document end, and D = 64 on Ampere.
#   * BLOCK_M=128, BLOCK_N=128, 8 warps, 2 stages: Hopper, D = 64: halves the loop trip count.
#   * BLOCK_M=64, BLOCK_N=32, 8 warps, 2 stages: D = 256 (the accumulator alone is 64 KiB; 4 warps
#     spill) and fp32 (exact dots on FMA units hold Q, K, V and P in registers).
# dK/dV (a key tile owns two fp32 accumulators BLOCK_N x D and holds K, V; loops over query tiles):
#   * BLOCK_M=32/64 (query rows streamed), BLOCK_N=128/64 (keys owned): the FA2 Triton choice,
#     long key tiles amortise the dK/dV registers, short query tiles keep the 4 live tiles small.
#     32 x 128 with 8 warps is D = 64's; D = 128 takes 32 x 64 with 8 warps (32 x 128 spills).
#   * BLOCK_M=32, BLOCK_N=32, 8 warps: D = 256 and fp32 on sm_90 (the only tiles that do not spill);
#     BLOCK_M=16 for fp32 on sm_80.
# Configurations whose shared memory (estimated below) exceeds the device's, or whose fp32
# accumulators exceed 128 values per thread (spills), are pruned before timing, so one list
# serves sm_80, sm_86, sm_89 and sm_90, and every head dim up to 256 keeps at least one entry.
# ----------------------------------------------------------------------------------------------

def _cfg(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


if _INTERPRET:
    # The interpreter runs each program in NumPy: autotuning would only multiply the run time,
    # and 16 x 16 tiles exercise the multi-tile paths on the small shapes the tests use.
    _FWD_CONFIGS = [_cfg(16, 16, 4, 1)]
    _DKDV_CONFIGS = [_cfg(16, 16, 4, 1)]
    _DQ_CONFIGS = [_cfg(16, 16, 4, 1)]
else:
    _FWD_CONFIGS = [
        _cfg(128, 64, 8, 3), _cfg(128, 32, 4, 2), _cfg(64, 64, 4, 4),
        _cfg(128, 128, 8, 2), _cfg(64, 32, 8, 2), _cfg(64, 32, 4, 2), _cfg(32, 32, 4, 2),
    ]
    # (dK/dV: the register words of each entry are counted in _estimate; configurations that
    # spill on sm_90 / sm_80 exceed it, see benchmarks/results/compile.csv)
    _DKDV_CONFIGS = [
        _cfg(32, 128, 8, 2), _cfg(64, 128, 8, 2), _cfg(64, 64, 4, 3), _cfg(32, 64, 4, 2), _cfg(32, 64, 8, 2),
        _cfg(32, 32, 8, 2), _cfg(16, 32, 8, 2),
    ]
    _DQ_CONFIGS = [_cfg(128, 32, 8, 2), _cfg(128, 64, 8, 2), _cfg(64, 64, 4, 3), _cfg(64, 32, 8, 2), _cfg(64, 32, 4, 2),
                   _cfg(32, 32, 4, 2)]


# FTLIB_ATTN_AUTOTUNE=0 skips timing: the first configuration of each list that fits is used.
# Correctness runs (the gpu-marked tests) set it to save compile time; results do not change
# beyond rounding order.
_AUTOTUNE = os.environ.get("FTLIB_ATTN_AUTOTUNE", "1") != "0"
_MAX_ACC_PER_THREAD = 128  # fp32 accumulator values per thread before registers spill (255 max)
# dK/dV with exact fp32 dots (FMA, no tensor cores) needs more registers per value held: the
# compile check (ftlib.kernels.compile_check) finds spills above 40 words on sm_80
_MAX_DKDV_FP32_WORDS = 40  # (48 spills 24 B on sm_80)
_MAX_FP32_WORDS = 64  # forward / dQ with fp32 dots: register words (accumulator, Q, K, V, P) a thread


def _smem_budget() -> int:
    props = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
    return int(props["max_shared_mem"])


def tile_configs(kind: str, meta: dict, smem_limit: int) -> list[tuple[triton.Config, int]]:
    """The configurations kernel ``kind`` (``fwd``, ``dkdv``, ``dq``) may run with constexprs ``meta`` on a
    device with ``smem_limit`` bytes of shared memory per block, in preference order, each with its
    shared-memory estimate in bytes. The first is the one taken without autotuning."""
    d = meta["BLOCK_D"]
    esize = 4 if meta["PRECISION"] == "ieee" else 2
    reg_limit = _MAX_ACC_PER_THREAD
    if esize == 4:
        reg_limit = _MAX_DKDV_FP32_WORDS if kind == "dkdv" else _MAX_FP32_WORDS
    kept = []
    for c in _CONFIGS[kind]:
        smem, words = _estimate(kind, c, d, esize)
        if smem <= smem_limit and words <= reg_limit:
            kept.append((c, smem))
    if not kept:
        c = min(_CONFIGS[kind], key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])
        kept = [(c, _estimate(kind, c, d, esize)[0])]
    return kept


_SCRATCH = 1024  # shared memory the compiler adds for reductions and layout conversions (256 B seen)


def _estimate(kind, c, d, esize) -> tuple[int, int]:
    """(shared memory bytes, fp32 accumulator values per thread; dK/dV: register words per thread)."""
    bm, bn, st = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], max(c.num_stages, 1)
    threads = 32 * c.num_warps
    # fp32 (FMA dots) with BLOCK_D = 16: the compiler stages the [BM, BN] scores / dS tile through
    # shared memory for a layout conversion (compiled on sm_90, Triton 3.6 and 3.9: fwd 128x64 57,344 B
    # against 41,984 estimated without it, dK/dV 32x128 37,120 vs 25,600, dQ 128x32 36,864 vs 25,600);
    # one fp32 [BM, BN] tile covers each
    convert = bm * bn * 4 if esize == 4 and d <= 16 else 0
    if kind == "dkdv":  # K, V resident, Q and dO streamed per stage; dK, dV accumulators
        # registers (32-bit words a thread): dK, dV fp32, K and V held, and one Q / dO tile each
        words = (2 * bn * d * 4 + 2 * bn * d * esize + 2 * bm * d * esize) // 4 // threads
        return 2 * bn * d * esize + st * 2 * bm * d * esize + _SCRATCH + convert, words
    # Q (and dO) resident, K and V streamed per stage; one BM x D accumulator
    if esize == 4:  # exact fp32 dots on FMA units: Q, K, V and P are held in registers beside it
        words = (2 * bm * d + 2 * bn * d + bm * bn) // threads
    else:
        words = bm * d // threads
    return 2 * bm * d * esize + st * 2 * bn * d * esize + _SCRATCH + convert, words


def _prune(kind):
    """Keep configurations whose tiles fit the device's shared memory and the register file."""

    def prune(configs, named_args, **kwargs):
        kept = [c for c, _ in tile_configs(kind, kwargs, _smem_budget())]
        return kept if _AUTOTUNE else kept[:1]

    return prune


def _untimed(kernel_call, quantiles):
    """The autotuner's ``do_bench`` with FTLIB_ATTN_AUTOTUNE=0: times nothing, runs nothing. The prune has left one
    configuration then, which Triton 3.9 takes without timing but Triton 3.6 still timed (``do_bench``:
    ~25 + 100 ms and an L2-flush buffer per kernel and key); the launch that follows compiles and runs it."""
    return [0.0] * len(quantiles)


def _autotune(configs, kind):
    if _INTERPRET:
        return triton.autotune(configs=configs, key=[])
    return triton.autotune(
        configs=configs,
        key=["BLOCK_D", "CAUSAL", "IS_VARLEN"],
        prune_configs_by={"early_config_prune": _prune(kind)},
        do_bench=None if _AUTOTUNE else _untimed,
    )


_CONFIGS = {"fwd": _FWD_CONFIGS, "dkdv": _DKDV_CONFIGS, "dq": _DQ_CONFIGS}
# kernel name -> the @triton.jit kernel (unwrapped), for the compile check
KERNELS = {"fwd": _k._fwd_kernel, "dkdv": _k._bwd_dkdv_kernel, "dq": _k._bwd_dq_kernel,
           "preprocess": _k._bwd_preprocess}
PREPROCESS_BLOCK_M = 16 if _INTERPRET else 64  # the D = rowsum(dO * O) pass's fixed tile

# The autotuned kernels (names kept from the kernel module so tests can swap their configs).
_fwd_kernel = _autotune(_FWD_CONFIGS, "fwd")(_k._fwd_kernel)
_bwd_dkdv_kernel = _autotune(_DKDV_CONFIGS, "dkdv")(_k._bwd_dkdv_kernel)
_bwd_dq_kernel = _autotune(_DQ_CONFIGS, "dq")(_k._bwd_dq_kernel)
_bwd_preprocess = _k._bwd_preprocess


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------



def _cdiv(a: int, b: int) -> int:
    # host-side ceil division in plain integers (triton.cdiv is a kernel-language function)
    return -(-a // b)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    # The kernels index the head dim with unit stride; every other stride is passed explicitly.
    return x if x.stride(-1) == 1 else x.contiguous()


_INT32_LIMIT = 2**31


def _check_int32_offsets(geo: _Geometry, tensors) -> None:
    """Raise when an offset the kernels compute in int32 could reach 2^31.

    The kernels add the document / batch-row start in int64, but the row within a document
    (``row * stride_t``) and the head (``h * stride_h``) are int32 products whenever the stride
    fits in int32 (Triton passes such ints as i32): past 2^31 they wrap and address memory out
    of bounds. ``tensors`` holds (name, shape, strides or None for contiguous, rows).
    """
    t_dim, h_dim = (0, 1) if geo.varlen else (1, 2)
    for name, shape, strides, rows in tensors:
        if strides is None:  # a contiguous tensor the launcher allocates
            strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        for what, count, stride in (("token", rows, strides[t_dim]), ("head", shape[h_dim], strides[h_dim])):
            if stride < _INT32_LIMIT and (count - 1) * stride >= _INT32_LIMIT:
                raise ValueError(
                    f"attention_triton: {name} {tuple(shape)} needs {what} offsets up to {(count - 1) * stride} "
                    f">= 2^31 inside one {'document' if geo.varlen else 'batch row'} (int32 kernel offsets); "
                    "use shorter documents or fewer tokens per row"
                )


def _check_lse_offsets(geo: _Geometry) -> None:
    # lse / delta (Hq, N) varlen or (B, Hq, Tq) dense: the head offset h * stride is int32 too
    head_stride = geo.lse_shape[-1]
    if (geo.hq - 1) * head_stride >= _INT32_LIMIT:
        raise ValueError(f"attention_triton: {geo.hq} heads x {head_stride} tokens of log-sum-exp reach 2^31 "
                         "(int32 kernel offsets); split the pack")


def _bth(x: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    # (batch, token, head) strides; a varlen tensor [N, H, D] is one "batch row" per document
    # whose start comes from cu_seqlens, so its batch stride is 0.
    return (0, x.stride(0), x.stride(1)) if varlen else (x.stride(0), x.stride(1), x.stride(2))


class _Geometry:
    """Grid-level facts shared by the forward and backward launches."""

    def __init__(self, q, k, cu_seqlens, max_seqlen, causal, scale, window=None, softcap=None,
                 cu_seqlens_k=None, max_seqlen_k=None):
        self.varlen = q.dim() == 3
        self.separate_k = cu_seqlens_k is not None
        self.causal = causal
        self.scale = scale
        self.window, self.softcap = window, softcap
        # runtime arguments of the window / soft-cap variants (ignored by the plain ones)
        self.extras = (int(window or 0), scale / softcap if softcap else 0.0, softcap * _LOG2E if softcap else 0.0)
        self.hq, self.hkv, self.d = q.shape[-2], k.shape[-2], q.shape[-1]
        self.block_d = max(16, 1 << max(self.d - 1, 0).bit_length())  # next power of two, plain int math
        self.precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays exact fp32
        if self.varlen:
            self.cu = cu_seqlens
            self.cu_k = cu_seqlens_k if self.separate_k else cu_seqlens  # not read unless separate_k
            self.batch = cu_seqlens.numel() - 1
            self.seqlen_q = max_seqlen
            self.seqlen_k = max_seqlen_k if self.separate_k else max_seqlen
            self.lse_shape = (self.hq, q.shape[0])
        else:
            self.cu = self.cu_k = torch.zeros(1, dtype=torch.int32, device=q.device)  # unused placeholder
            self.batch = q.shape[0]
            self.seqlen_q, self.seqlen_k = q.shape[1], k.shape[1]
            self.lse_shape = (self.batch, self.hq, self.seqlen_q)

    def lse_strides(self, lse):
        return (0, lse.stride(0)) if self.varlen else (lse.stride(0), lse.stride(1))

    def meta(self):
        return dict(IS_VARLEN=self.varlen, CAUSAL=self.causal, PRECISION=self.precision,
                    HEAD_DIM=self.d, BLOCK_D=self.block_d, HAS_WINDOW=self.window is not None,
                    SOFTCAP=self.softcap is not None, SEPARATE_K=self.separate_k)

    @property
    def empty(self):
        return self.batch == 0 or self.seqlen_q == 0 or self.seqlen_k == 0


def _device_guard(x: torch.Tensor):
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _forward(q, k, v, geo: _Geometry):
    # q (B, Tq, Hq, D) or (N, Hq, D); k, v (B, Tk, Hkv, D) or (N, Hkv, D)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full(geo.lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    if geo.empty:
        return o.zero_(), lse
    # (query tiles, documents, heads): tiles of one head run side by side and share K/V in L2;
    # documents and heads on their own axes keep each under CUDA's 65535 limit for y and z.
    grid = lambda meta: (_cdiv(geo.seqlen_q, meta["BLOCK_M"]), geo.batch, geo.hq)
    with _device_guard(q):
        _fwd_kernel[grid](
            q, k, v, o, lse, geo.cu, geo.cu_k, geo.scale * _LOG2E,
            *_bth(q, geo.varlen), *_bth(k, geo.varlen), *_bth(v, geo.varlen), *_bth(o, geo.varlen),
            *geo.lse_strides(lse),
            geo.seqlen_q, geo.seqlen_k, geo.hq // geo.hkv, *geo.extras,
            **geo.meta(),
        )
    return o, lse


def _backward(do, q, k, v, o, lse, geo: _Geometry):
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if geo.empty:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty_like(lse)  # (Hq, N) or (B, Hq, Tq), fp32
    vl, meta = geo.varlen, geo.meta()
    group = geo.hq // geo.hkv
    with _device_guard(q):
        pre_grid = (_cdiv(geo.seqlen_q, PREPROCESS_BLOCK_M), geo.batch, geo.hq)
        _bwd_preprocess[pre_grid](
            o, do, delta, geo.cu, *_bth(o, vl), *_bth(do, vl), *geo.lse_strides(delta),
            geo.seqlen_q,
            IS_VARLEN=vl, HEAD_DIM=geo.d, BLOCK_D=geo.block_d, BLOCK_M=PREPROCESS_BLOCK_M,
        )
        kv_grid = lambda m: (_cdiv(geo.seqlen_k, m["BLOCK_N"]), geo.batch, geo.hkv)
        _bwd_dkdv_kernel[kv_grid](
            q, k, v, do, dk, dv, lse, delta, geo.cu, geo.cu_k, geo.scale * _LOG2E, geo.scale,
            *_bth(q, vl), *_bth(k, vl), *_bth(v, vl), *_bth(do, vl), *_bth(dk, vl), *_bth(dv, vl),
            *geo.lse_strides(lse),
            geo.seqlen_q, geo.seqlen_k, group, *geo.extras,
            **meta,
        )
        q_grid = lambda m: (_cdiv(geo.seqlen_q, m["BLOCK_M"]), geo.batch, geo.hq)
        _bwd_dq_kernel[q_grid](
            q, k, v, do, dq, lse, delta, geo.cu, geo.cu_k, geo.scale * _LOG2E, geo.scale,
            *_bth(q, vl), *_bth(k, vl), *_bth(v, vl), *_bth(do, vl), *_bth(dq, vl),
            *geo.lse_strides(lse),
            geo.seqlen_q, geo.seqlen_k, group, *geo.extras,
            **meta,
        )
    return dq, dk, dv


class _AttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, geo):
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        sq, sk = geo.seqlen_q, geo.seqlen_k
        # inputs as passed, and the contiguous O, dQ, dK, dV the launchers allocate
        _check_int32_offsets(geo, [("q", q.shape, q.stride(), sq), ("k", k.shape, k.stride(), sk),
                                   ("v", v.shape, v.stride(), sk), ("q", q.shape, None, sq),
                                   ("k", k.shape, None, sk)])
        _check_lse_offsets(geo)
        o, lse = _forward(q, k, v, geo)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.geo = geo
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        do = _unit_last(do)
        _check_int32_offsets(ctx.geo, [("grad of the output", do.shape, do.stride(), ctx.geo.seqlen_q)])
        dq, dk, dv = _backward(do, q, k, v, o, lse, ctx.geo)
        return dq, dk, dv, None


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------

def _validate(q, k, v, cu_seqlens, max_seqlen, separate_k=False):
    dense = q.dim() == 4
    if q.dim() not in (3, 4):
        raise ValueError(f"attention_triton: q must be [B, T, H, D] or [N, H, D], got {tuple(q.shape)}")
    layout = "[B, T, H, D]" if dense else "[N, H, D]"
    for name, t in (("k", k), ("v", v)):
        if t.dim() != q.dim():
            raise ValueError(f"attention_triton: {name} must be {layout} like q, got {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"attention_triton: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention_triton: head dims differ: q {q.shape[-1]}, k {k.shape[-1]}")
    if q.shape[0] != k.shape[0] and not (separate_k and not dense):
        what = "batch sizes" if dense else "token counts N"
        raise ValueError(f"attention_triton: {what} differ: q {q.shape[0]}, k {k.shape[0]}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"attention_triton: Hq={hq} must be a positive multiple of Hkv={hkv}")
    if q.dtype not in _SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"attention_triton: q, k, v must share one dtype among float16, bfloat16, float32; got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"attention_triton: head dim {q.shape[-1]} > {MAX_HEAD_DIM} is not supported")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention_triton: q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    if not q.is_cuda and not _INTERPRET:
        raise RuntimeError(
            "attention_triton: needs CUDA tensors (set TRITON_INTERPRET=1 before importing ftlib to run "
            "the kernels on CPU for testing)"
        )
    if dense:
        if cu_seqlens is not None or separate_k:
            raise ValueError("attention_triton: cu_seqlens / cu_seqlens_k are for the varlen layout [N, H, D]; "
                             "q is dense")
        return None, None
    return _segments(q, cu_seqlens, max_seqlen, q.shape[0], "cu_seqlens", "max_seqlen")


def _segments(q, cu_seqlens, max_seqlen, n, name, max_name):
    """(cu_seqlens int32 on q's device, max_seqlen) of one side, checked where that costs no device sync."""
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"attention_triton: {name} must be 1-D int32 [n_docs + 1], got {cu_seqlens.dtype} "
            f"{tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device.type == "cpu":
        # Checked only where it costs no device sync; on the GPU cu_seqlens is trusted, as in
        # flash-attn (a host round trip per layer would stall the launch queue).
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != n or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(
                f"attention_triton: {name} must rise from 0 to N={n}, got {cu[:8]}{'...' if len(cu) > 8 else ''}"
            )
        longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
        if max_seqlen is not None and int(max_seqlen) < longest:
            raise ValueError(f"attention_triton: {max_name}={max_seqlen} < longest document ({longest} tokens)")
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_seqlen is None:
        # One host sync; callers that know the longest document (the packer does) pass it.
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    max_seqlen = int(max_seqlen)
    if max_seqlen < 0:
        raise ValueError(f"attention_triton: {max_name} must be >= 0, got {max_seqlen}")
    return cu_seqlens, max_seqlen


def attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
):
    """Fused attention with the semantics of ``attention_ref`` (no key_padding_mask).

    ``cu_seqlens_k`` / ``max_seqlen_k`` (varlen): k, v [Nk, Hkv, D] in segments of their own, one
    per query segment, causal bottom-right aligned per pair (``attention_ref``); default: the
    queries' segments (the same launch as before, ``SEPARATE_K`` off).

    ``sliding_window`` and ``softcap`` (see ``attention_ref``) select the kernels' constexpr
    variants: key tiles outside every row's window are skipped, soft-capped scores use tanh.

    q [B, Tq, Hq, D] with k, v [B, Tk, Hkv, D] (dense; causal is bottom-right aligned when
    Tq != Tk), or q [N, Hq, D] with k, v [N, Hkv, D] and ``cu_seqlens`` int32 [n_docs + 1]
    (varlen; no token attends outside its document). ``max_seqlen`` must be at least the longest
    document (the flash-attn convention: it sizes the grid and is trusted); when None it is
    computed from ``cu_seqlens`` with one host sync. Differentiable in q, k, v.

    Returns ``o`` like q or, with ``return_lse``, ``(o, lse)`` with lse float32 [B, Hq, Tq]
    (dense) or [Hq, N] (varlen), -inf on rows that see no key.
    """
    separate_k = cu_seqlens_k is not None
    cu_seqlens, max_seqlen = _validate(q, k, v, cu_seqlens, max_seqlen, separate_k)
    if separate_k:
        cu_seqlens_k, max_seqlen_k = _segments(q, cu_seqlens_k, max_seqlen_k, k.shape[0], "cu_seqlens_k",
                                               "max_seqlen_k")
        if cu_seqlens_k.numel() != cu_seqlens.numel():
            raise ValueError(f"attention_triton: cu_seqlens_k has {cu_seqlens_k.numel() - 1} segments, cu_seqlens "
                             f"{cu_seqlens.numel() - 1}; each query segment needs its key segment")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    check_window_softcap(sliding_window, softcap)
    geo = _Geometry(q, k, cu_seqlens, max_seqlen, bool(causal), scale, sliding_window,
                    None if softcap is None else float(softcap), cu_seqlens_k, max_seqlen_k)
    if geo.batch > _MAX_GRID_YZ:
        what = "documents in cu_seqlens" if geo.varlen else "batch rows"
        raise ValueError(f"attention_triton: {geo.batch} {what} > {_MAX_GRID_YZ} (CUDA grid limit); split the batch")
    o, lse = _AttentionFn.apply(q, k, v, geo)
    return (o, lse) if return_lse else o
