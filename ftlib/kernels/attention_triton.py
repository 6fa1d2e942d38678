"""Triton fused attention: FlashAttention-2 forward and backward, GQA, packed varlen.

Math (per query row i, query head h, kv head g = h // G with G = Hq / Hkv;
scores kept in base 2 so the kernel uses exp2; c = softmax_scale * log2(e)):

    forward   s_ij = c <q_i, k_j>          over key tiles j, never the T x T matrix
              m_i  <- max(m_i, max_j s_ij)                   (running row max)
              l_i  <- l_i 2^(m_old - m_i) + sum_j 2^(s_ij - m_i)
              acc  <- acc 2^(m_old - m_i) + sum_j 2^(s_ij - m_i) v_j
              o_i  = acc / l_i,   lse_i = ln 2 (m_i + log2 l_i)   (natural log, saved fp32)
    backward  p_ij = exp(scale <q_i, k_j> - lse_i)           (recomputed from lse)
              D_i  = sum_d dO_id O_id                         (_bwd_preprocess)
              dV_j = sum_i p_ij dO_i
              dS_ij = p_ij (dO_i . v_j - D_i)
              dK_j = scale sum_i dS_ij q_i,   dQ_i = scale sum_j dS_ij k_j

Masking: key j is visible to query i when both lie in the same document and, if
causal, j <= i + (Tk - Tq) (bottom-right alignment, as ``attention_ref``). Rows
that see no key return zeros and lse = -inf, and get zero gradient.

Scheme (Dao, "FlashAttention-2", arXiv:2307.08691; Triton tutorial 06):

- ``_fwd_kernel``: one program per (query tile, document or batch row, query
  head); it reads K/V of its kv head h // G, so GQA never repeats K/V in memory.
  Key tiles that need no mask run in a loop without masking; only the diagonal
  and the ragged tail run the masked loop.
- ``_bwd_preprocess``: D = rowsum(dO * O) in fp32, layout of lse.
- ``_bwd_dkdv_kernel``: one program per (key tile, document, kv head). It loops
  over the G query heads of its group and over the query tiles that can see the
  key tile, accumulating dK and dV in fp32 registers: the GQA sum over query
  heads happens in registers in a fixed order, with no atomics.
- ``_bwd_dq_kernel``: one program per (query tile, document, query head), a
  loop over key tiles like the forward. A separate dQ pass recomputes QK^T and
  dO V^T (7 tile matmuls in the backward instead of 5), but every gradient
  element is written once by one program: the backward is deterministic
  (bitwise reproducible run to run), which atomic fp32 adds into dQ are not,
  and GQA would make those atomics contend G times more.

Layouts: varlen q [N, Hq, D], k/v [N, Hkv, D] with ``cu_seqlens`` int32
[n_docs + 1]; the grid spans ceil(max_seqlen / BLOCK) tiles per document and
tiles past a document's end exit at once. Dense [B, T, H, D] is the same kernel
with a batch stride and uniform lengths (Tq and Tk may differ). Strides go to the
kernel explicitly; only the head dim must be unit-stride (copied otherwise).

Expected performance (fp16/bf16, D = 128, forward tile BLOCK_M=128, BLOCK_N=64):

- FLOPs per tile: QK^T and PV are 2 * 2 * BM * BN * D = 4.2 MFLOP; bytes read per
  tile: one K and one V tile, 2 * BN * D * 2 B = 32 KiB (Q stays in registers),
  so 4 * BM * BN * D / (4 * BN * D) = BM = 128 FLOP/B. The ridge point is
  989e12 / 3.35e12 = 295 FLOP/B from HBM on H100 SXM and 312e12 / 2.0e12 = 156 on
  A100, but programs with consecutive program_id(0) are query tiles of the same
  head and read the same K/V, which therefore come from L2 (about 3x the HBM
  bandwidth): the forward is compute bound on both.
- Softmax: BM * BN = 8192 exp2 per tile on the 16/clk/SM special-function unit is
  512 clocks against about 1024 clocks of tensor-core work on H100 (4096
  dense FLOP/clk/SM), so the exponentials are a large fraction of matmul time
  unless overlapped; num_stages >= 3 lets Triton's pipeliner prefetch the next
  K/V tile during the softmax. Expect 55-70 % of dense peak for long causal
  sequences on H100 (FA2-class), less for D = 64 (half the FLOPs per exp).
- Occupancy: the fp32 accumulator BM x D = 16K values over 8 warps is 64
  registers per thread, the score tile 32 more, Q 32 more: about 180-200
  registers, one 8-warp CTA per SM (two Hopper warpgroups of 64 rows each).
  Shared memory: Q 32 KiB + stages * (K + V) = 3 * 32 KiB = 128 KiB, within
  H100's 227 KiB and A100's 163 KiB per block. Grid: B * Hq * T / 128 CTAs,
  1024 for one 4k-token row with 32 heads, 7.8 waves on 132 SMs.
- Backward: dK/dV tile does 4 matmuls (8 BM BN D FLOPs) reading Q and dO tiles
  (4 BM D bytes): 2 BN FLOP/B; the dQ tile does 3 matmuls reading K and V: 1.5
  BM FLOP/B. dK, dV (2 x BN x D fp32) stay in registers, so dK/dV prefers a
  short BLOCK_M (32-64) and a long BLOCK_N. Counted with the usual 2.5x forward
  FLOPs, the backward reaches at most 5/7 of the hardware rate.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

__all__ = ["attention_triton"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------------------------
# Autotune configurations.
#
# Forward / dQ (a query tile owns an fp32 accumulator BLOCK_M x D):
#   * BLOCK_M=128, BLOCK_N=64, 8 warps, 3 stages: the Hopper and Ampere choice for D <= 128. 128
#     query rows give 128 FLOP/B on K/V traffic (see the module docstring); 8 warps make two
#     64-row warpgroups for wgmma on Hopper; 3 stages overlap the next K/V load with the softmax.
#   * BLOCK_M=128, BLOCK_N=32, 4 warps, 2 stages: A100 / consumer Ampere (sm_86: 100 KiB shared
#     memory) with D = 128, where 3 stages of 64-key tiles do not fit.
#   * BLOCK_M=64, BLOCK_N=64, 4 warps, 4 stages: short documents (packed batches), where a tall
#     query tile would be mostly past the document end, and D = 64 on Ampere.
#   * BLOCK_M=128, BLOCK_N=128, 8 warps, 2 stages: Hopper, D = 64: halves the loop trip count.
#   * BLOCK_M=64, BLOCK_N=32, 4 warps, 2 stages: D = 256 (the accumulator alone is 64 KiB).
# dK/dV (a key tile owns two fp32 accumulators BLOCK_N x D, and loops over query tiles):
#   * BLOCK_M=32/64 (query rows streamed), BLOCK_N=128/64 (keys owned): the FA2 Triton choice,
#     long key tiles amortise the dK/dV registers, short query tiles keep the 4 live tiles small.
#   * BLOCK_M=32, BLOCK_N=64, 8 warps: D = 256, where dK + dV are 2 x 64 x 256 fp32.
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
        _cfg(128, 128, 8, 2), _cfg(64, 32, 4, 2),
    ]
    _DKDV_CONFIGS = [
        _cfg(32, 128, 8, 2), _cfg(64, 128, 8, 2), _cfg(64, 64, 4, 3), _cfg(32, 64, 4, 2), _cfg(32, 64, 8, 2),
    ]
    _DQ_CONFIGS = [_cfg(128, 32, 8, 2), _cfg(128, 64, 8, 2), _cfg(64, 64, 4, 3), _cfg(64, 32, 4, 2)]


# FTLIB_ATTN_AUTOTUNE=0 skips timing: the first configuration of each list that fits is used.
# Correctness runs (the gpu-marked tests) set it to save compile time; results do not change
# beyond rounding order.
_AUTOTUNE = os.environ.get("FTLIB_ATTN_AUTOTUNE", "1") != "0"
_MAX_ACC_PER_THREAD = 128  # fp32 accumulator values per thread before registers spill (255 max)


def _smem_budget() -> int:
    props = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
    return int(props["max_shared_mem"])


def _prune(kind):
    """Keep configurations whose tiles fit the device's shared memory and the register file."""

    def prune(configs, named_args, **kwargs):
        d = kwargs["BLOCK_D"]
        esize = 4 if kwargs["PRECISION"] == "ieee" else 2
        budget = _smem_budget()
        kept = []
        for c in configs:
            bm, bn, st = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], max(c.num_stages, 1)
            threads = 32 * c.num_warps
            if kind == "dkdv":  # K, V resident, Q and dO streamed per stage; dK, dV accumulators
                smem = 2 * bn * d * esize + st * 2 * bm * d * esize
                acc = 2 * bn * d // threads
            else:  # Q (and dO) resident, K and V streamed per stage; one BM x D accumulator
                smem = 2 * bm * d * esize + st * 2 * bn * d * esize
                acc = bm * d // threads
            if smem <= budget and acc <= _MAX_ACC_PER_THREAD:
                kept.append(c)
        if not kept:
            kept = [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]
        return kept if _AUTOTUNE else kept[:1]

    return prune


def _autotune(configs, kind):
    if _INTERPRET:
        return triton.autotune(configs=configs, key=[])
    return triton.autotune(
        configs=configs,
        key=["BLOCK_D", "CAUSAL", "IS_VARLEN"],
        prune_configs_by={"early_config_prune": _prune(kind)},
    )


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _load_tile(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    # (len(rows), BLOCK_D) tile; rows >= n_rows and dims >= HEAD_DIM read as 0.
    if CHECK_ROWS:
        if HEAD_DIM == BLOCK_D:
            t = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            t = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            t = tl.load(ptrs)
        else:
            t = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return t


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, stride_kt, stride_vt, offs_m, offs_n, offs_d,
               len_k, diag, qk_scale, lo, hi,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(k_ptr + cols[:, None] * stride_kt + offs_d[None, :], cols, len_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)  # (BN, BD)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BM, BN), log2 units
        if MASKED:
            keep = cols[None, :] < len_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
            s = tl.where(keep, s, float("-inf"))
        # m_i starts at -1e30 (finite), so a row whose keys are all masked keeps p = 0, alpha = 1.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_ptr + cols[:, None] * stride_vt + offs_d[None, :], cols, len_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@_autotune(_FWD_CONFIGS, "fwd")
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def _fwd_kernel(
    Q, K, V, O, LSE, CU_SEQLENS, qk_scale,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, n_heads, group,
    IS_VARLEN: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Late causal tiles do the most work: launch them first to shorten the tail.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    hk = h // group
    b64 = b.to(tl.int64)
    q_ptr = Q + b64 * stride_qb + h * stride_qh
    k_ptr = K + b64 * stride_kb + hk * stride_kh
    v_ptr = V + b64 * stride_vb + hk * stride_vh
    o_ptr = O + b64 * stride_ob + h * stride_oh
    lse_ptr = LSE + b64 * stride_lb + h * stride_lh
    if IS_VARLEN:
        start = tl.load(CU_SEQLENS + b)
        len_q = tl.load(CU_SEQLENS + b + 1) - start
        len_k = len_q
        start64 = start.to(tl.int64)
        q_ptr += start64 * stride_qt
        k_ptr += start64 * stride_kt
        v_ptr += start64 * stride_vt
        o_ptr += start64 * stride_ot
        lse_ptr += start64
    else:
        len_q = seqlen_q
        len_k = seqlen_k
    m0 = pid_m * BLOCK_M
    if m0 >= len_q:
        return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(q_ptr + offs_m[:, None] * stride_qt + offs_d[None, :], offs_m, len_q, offs_d,
                   HEAD_DIM, BLOCK_D, True)  # (BM, BD)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys [0, full) are visible to every row of the tile: no mask. Keys [full, hi) need one.
    diag = len_k - len_q
    if CAUSAL:
        full = tl.minimum(len_k, m0 + diag + 1)
        hi = tl.minimum(len_k, m0 + BLOCK_M + diag)
    else:
        full = len_k
        hi = len_k
    full = tl.maximum(full, 0) // BLOCK_N * BLOCK_N
    hi = tl.maximum(hi, 0)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, stride_kt, stride_vt, offs_m, offs_n,
                               offs_d, len_k, diag, qk_scale, 0, full,
                               False, CAUSAL, PRECISION, BLOCK_N, BLOCK_D, HEAD_DIM)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, stride_kt, stride_vt, offs_m, offs_n,
                               offs_d, len_k, diag, qk_scale, full, hi,
                               True, CAUSAL, PRECISION, BLOCK_N, BLOCK_D, HEAD_DIM)

    seen = l_i > 0.0  # rows with at least one visible key
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_mask = (offs_m[:, None] < len_q) & (offs_d[None, :] < HEAD_DIM)
    tl.store(o_ptr + offs_m[:, None] * stride_ot + offs_d[None, :], o.to(O.dtype.element_ty), mask=o_mask)
    tl.store(lse_ptr + offs_m, lse, mask=offs_m < len_q)


@triton.jit(do_not_specialize=["seqlen_q"])
def _bwd_preprocess(
    O, DO, DELTA, CU_SEQLENS,
    stride_ob, stride_ot, stride_oh, stride_dob, stride_dot, stride_doh, stride_lb, stride_lh,
    seqlen_q, n_heads,
    IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    b64 = b.to(tl.int64)
    o_ptr = O + b64 * stride_ob + h * stride_oh
    do_ptr = DO + b64 * stride_dob + h * stride_doh
    d_ptr = DELTA + b64 * stride_lb + h * stride_lh
    if IS_VARLEN:
        start = tl.load(CU_SEQLENS + b)
        len_q = tl.load(CU_SEQLENS + b + 1) - start
        start64 = start.to(tl.int64)
        o_ptr += start64 * stride_ot
        do_ptr += start64 * stride_dot
        d_ptr += start64
    else:
        len_q = seqlen_q
    m0 = pid_m * BLOCK_M
    if m0 >= len_q:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_tile(o_ptr + offs_m[:, None] * stride_ot + offs_d[None, :], offs_m, len_q, offs_d,
                   HEAD_DIM, BLOCK_D, True).to(tl.float32)
    do = _load_tile(do_ptr + offs_m[:, None] * stride_dot + offs_d[None, :], offs_m, len_q, offs_d,
                    HEAD_DIM, BLOCK_D, True).to(tl.float32)
    tl.store(d_ptr + offs_m, tl.sum(o * do, 1), mask=offs_m < len_q)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qt, stride_dot,
                    offs_n, offs_mb, offs_d, len_q, diag, qk_scale, lo, hi,
                    MASKED: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_mb
        # Rows past len_q read q = dO = 0 and lse = D = 0: their p is finite and every term they
        # add (p dO, dS q) is exactly zero, so no row mask is needed in the unmasked loop.
        q = _load_tile(q_ptr + rows[:, None] * stride_qt + offs_d[None, :], rows, len_q, offs_d,
                       HEAD_DIM, BLOCK_D, True)  # (BM, BD)
        do = _load_tile(do_ptr + rows[:, None] * stride_dot + offs_d[None, :], rows, len_q, offs_d,
                        HEAD_DIM, BLOCK_D, True)
        lse = tl.load(lse_ptr + rows, mask=rows < len_q, other=0.0)
        # A row that sees no key has lse = -inf; +inf makes its p exactly 0 instead of NaN.
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        delta = tl.load(delta_ptr + rows, mask=rows < len_q, other=0.0)
        qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (BN, BM)
        p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
        if MASKED:
            p_t = tl.where(rows[None, :] + diag >= offs_n[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BN, BM)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@_autotune(_DKDV_CONFIGS, "dkdv")
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def _bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, CU_SEQLENS, qk_scale, sm_scale,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
    stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, n_kv_heads, group,
    IS_VARLEN: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_kv_heads
    hk = pid_bh % n_kv_heads
    b64 = b.to(tl.int64)
    k_ptr = K + b64 * stride_kb + hk * stride_kh
    v_ptr = V + b64 * stride_vb + hk * stride_vh
    dk_ptr = DK + b64 * stride_dkb + hk * stride_dkh
    dv_ptr = DV + b64 * stride_dvb + hk * stride_dvh
    q_base = Q + b64 * stride_qb
    do_base = DO + b64 * stride_dob
    lse_base = LSE + b64 * stride_lb
    delta_base = DELTA + b64 * stride_lb
    if IS_VARLEN:
        start = tl.load(CU_SEQLENS + b)
        len_q = tl.load(CU_SEQLENS + b + 1) - start
        len_k = len_q
        start64 = start.to(tl.int64)
        k_ptr += start64 * stride_kt
        v_ptr += start64 * stride_vt
        dk_ptr += start64 * stride_dkt
        dv_ptr += start64 * stride_dvt
        q_base += start64 * stride_qt
        do_base += start64 * stride_dot
        lse_base += start64
        delta_base += start64
    else:
        len_q = seqlen_q
        len_k = seqlen_k
    n0 = pid_n * BLOCK_N
    if n0 >= len_k:
        return

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_mb = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_tile(k_ptr + offs_n[:, None] * stride_kt + offs_d[None, :], offs_n, len_k, offs_d,
                   HEAD_DIM, BLOCK_D, True)  # (BN, BD), resident for the whole program
    v = _load_tile(v_ptr + offs_n[:, None] * stride_vt + offs_d[None, :], offs_n, len_k, offs_d,
                   HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query rows [lo, mid) see part of this key tile (masked loop); rows [mid, len_q) see all of it.
    # Rows before lo see none of it. Key columns past len_k only feed their own (unstored) dK/dV.
    diag = len_k - len_q
    if CAUSAL:
        lo = tl.maximum(n0 - diag, 0) // BLOCK_M * BLOCK_M
        mid = (tl.maximum(n0 + BLOCK_N - 1 - diag, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        mid_end = tl.minimum(mid, len_q)
    else:
        mid = 0
    for g in range(0, group):  # the query heads sharing kv head hk, summed in a fixed order
        h = hk * group + g
        q_ptr = q_base + h * stride_qh
        do_ptr = do_base + h * stride_doh
        lse_ptr = lse_base + h * stride_lh
        delta_ptr = delta_base + h * stride_lh
        if CAUSAL:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qt,
                                     stride_dot, offs_n, offs_mb, offs_d, len_q, diag, qk_scale, lo,
                                     mid_end, True, PRECISION, BLOCK_M, BLOCK_D, HEAD_DIM)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qt,
                                 stride_dot, offs_n, offs_mb, offs_d, len_q, diag, qk_scale, mid,
                                 len_q, False, PRECISION, BLOCK_M, BLOCK_D, HEAD_DIM)

    out_mask = (offs_n[:, None] < len_k) & (offs_d[None, :] < HEAD_DIM)
    tl.store(dk_ptr + offs_n[:, None] * stride_dkt + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
             mask=out_mask)
    tl.store(dv_ptr + offs_n[:, None] * stride_dvt + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=out_mask)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, stride_kt, stride_vt, offs_m, offs_n, offs_d,
                  len_k, diag, qk_scale, lo, hi,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(k_ptr + cols[:, None] * stride_kt + offs_d[None, :], cols, len_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)  # (BN, BD)
        v = _load_tile(v_ptr + cols[:, None] * stride_vt + offs_d[None, :], cols, len_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BM, BN)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            keep = cols[None, :] < len_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BM, BN)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@_autotune(_DQ_CONFIGS, "dq")
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def _bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, CU_SEQLENS, qk_scale, sm_scale,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
    stride_dqb, stride_dqt, stride_dqh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, n_heads, group,
    IS_VARLEN: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    hk = h // group
    b64 = b.to(tl.int64)
    q_ptr = Q + b64 * stride_qb + h * stride_qh
    k_ptr = K + b64 * stride_kb + hk * stride_kh
    v_ptr = V + b64 * stride_vb + hk * stride_vh
    do_ptr = DO + b64 * stride_dob + h * stride_doh
    dq_ptr = DQ + b64 * stride_dqb + h * stride_dqh
    lse_ptr = LSE + b64 * stride_lb + h * stride_lh
    delta_ptr = DELTA + b64 * stride_lb + h * stride_lh
    if IS_VARLEN:
        start = tl.load(CU_SEQLENS + b)
        len_q = tl.load(CU_SEQLENS + b + 1) - start
        len_k = len_q
        start64 = start.to(tl.int64)
        q_ptr += start64 * stride_qt
        k_ptr += start64 * stride_kt
        v_ptr += start64 * stride_vt
        do_ptr += start64 * stride_dot
        dq_ptr += start64 * stride_dqt
        lse_ptr += start64
        delta_ptr += start64
    else:
        len_q = seqlen_q
        len_k = seqlen_k
    m0 = pid_m * BLOCK_M
    if m0 >= len_q:
        return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(q_ptr + offs_m[:, None] * stride_qt + offs_d[None, :], offs_m, len_q, offs_d,
                   HEAD_DIM, BLOCK_D, True)
    do = _load_tile(do_ptr + offs_m[:, None] * stride_dot + offs_d[None, :], offs_m, len_q, offs_d,
                    HEAD_DIM, BLOCK_D, True)
    lse = tl.load(lse_ptr + offs_m, mask=offs_m < len_q, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(delta_ptr + offs_m, mask=offs_m < len_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    diag = len_k - len_q
    if CAUSAL:
        full = tl.minimum(len_k, m0 + diag + 1)
        hi = tl.minimum(len_k, m0 + BLOCK_M + diag)
    else:
        full = len_k
        hi = len_k
    full = tl.maximum(full, 0) // BLOCK_N * BLOCK_N
    hi = tl.maximum(hi, 0)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, stride_kt, stride_vt, offs_m, offs_n, offs_d,
                       len_k, diag, qk_scale, 0, full, False, CAUSAL, PRECISION, BLOCK_N, BLOCK_D, HEAD_DIM)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, stride_kt, stride_vt, offs_m, offs_n, offs_d,
                       len_k, diag, qk_scale, full, hi, True, CAUSAL, PRECISION, BLOCK_N, BLOCK_D, HEAD_DIM)
    o_mask = (offs_m[:, None] < len_q) & (offs_d[None, :] < HEAD_DIM)
    tl.store(dq_ptr + offs_m[:, None] * stride_dqt + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=o_mask)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

_PRE_BLOCK_M = 16 if _INTERPRET else 64


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    # The kernels index the head dim with unit stride; every other stride is passed explicitly.
    return x if x.stride(-1) == 1 else x.contiguous()


def _bth(x: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    # (batch, token, head) strides; a varlen tensor [N, H, D] is one "batch row" per document
    # whose start comes from cu_seqlens, so its batch stride is 0.
    return (0, x.stride(0), x.stride(1)) if varlen else (x.stride(0), x.stride(1), x.stride(2))


class _Geometry:
    """Grid-level facts shared by the forward and backward launches."""

    def __init__(self, q, k, cu_seqlens, max_seqlen, causal, scale):
        self.varlen = q.dim() == 3
        self.causal = causal
        self.scale = scale
        self.hq, self.hkv, self.d = q.shape[-2], k.shape[-2], q.shape[-1]
        self.block_d = max(16, triton.next_power_of_2(self.d))
        self.precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays exact fp32
        if self.varlen:
            self.cu = cu_seqlens
            self.batch = cu_seqlens.numel() - 1
            self.seqlen_q = self.seqlen_k = max_seqlen
            self.lse_shape = (self.hq, q.shape[0])
        else:
            self.cu = torch.zeros(1, dtype=torch.int32, device=q.device)  # unused placeholder
            self.batch = q.shape[0]
            self.seqlen_q, self.seqlen_k = q.shape[1], k.shape[1]
            self.lse_shape = (self.batch, self.hq, self.seqlen_q)

    def lse_strides(self, lse):
        return (0, lse.stride(0)) if self.varlen else (lse.stride(0), lse.stride(1))

    def meta(self):
        return dict(IS_VARLEN=self.varlen, CAUSAL=self.causal, PRECISION=self.precision,
                    HEAD_DIM=self.d, BLOCK_D=self.block_d)

    @property
    def empty(self):
        return self.batch == 0 or self.seqlen_q == 0 or self.seqlen_k == 0


def _device_guard(x: torch.Tensor):
    return torch.cuda.device(x.device) if x.is_cuda else _NullContext()


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _forward(q, k, v, geo: _Geometry):
    # q (B, Tq, Hq, D) or (N, Hq, D); k, v (B, Tk, Hkv, D) or (N, Hkv, D)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full(geo.lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    if geo.empty:
        return o.zero_(), lse
    grid = lambda meta: (triton.cdiv(geo.seqlen_q, meta["BLOCK_M"]), geo.batch * geo.hq)
    with _device_guard(q):
        _fwd_kernel[grid](
            q, k, v, o, lse, geo.cu, geo.scale * _LOG2E,
            *_bth(q, geo.varlen), *_bth(k, geo.varlen), *_bth(v, geo.varlen), *_bth(o, geo.varlen),
            *geo.lse_strides(lse),
            geo.seqlen_q, geo.seqlen_k, geo.hq, geo.hq // geo.hkv,
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
        pre_grid = (triton.cdiv(geo.seqlen_q, _PRE_BLOCK_M), geo.batch * geo.hq)
        _bwd_preprocess[pre_grid](
            o, do, delta, geo.cu, *_bth(o, vl), *_bth(do, vl), *geo.lse_strides(delta),
            geo.seqlen_q, geo.hq,
            IS_VARLEN=vl, HEAD_DIM=geo.d, BLOCK_D=geo.block_d, BLOCK_M=_PRE_BLOCK_M,
        )
        kv_grid = lambda m: (triton.cdiv(geo.seqlen_k, m["BLOCK_N"]), geo.batch * geo.hkv)
        _bwd_dkdv_kernel[kv_grid](
            q, k, v, do, dk, dv, lse, delta, geo.cu, geo.scale * _LOG2E, geo.scale,
            *_bth(q, vl), *_bth(k, vl), *_bth(v, vl), *_bth(do, vl), *_bth(dk, vl), *_bth(dv, vl),
            *geo.lse_strides(lse),
            geo.seqlen_q, geo.seqlen_k, geo.hkv, group,
            **meta,
        )
        q_grid = lambda m: (triton.cdiv(geo.seqlen_q, m["BLOCK_M"]), geo.batch * geo.hq)
        _bwd_dq_kernel[q_grid](
            q, k, v, do, dq, lse, delta, geo.cu, geo.scale * _LOG2E, geo.scale,
            *_bth(q, vl), *_bth(k, vl), *_bth(v, vl), *_bth(do, vl), *_bth(dq, vl),
            *geo.lse_strides(lse),
            geo.seqlen_q, geo.seqlen_k, geo.hq, group,
            **meta,
        )
    return dq, dk, dv


class _AttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, geo):
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        o, lse = _forward(q, k, v, geo)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.geo = geo
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(_unit_last(do), q, k, v, o, lse, ctx.geo)
        return dq, dk, dv, None


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------

def _validate(q, k, v, cu_seqlens, max_seqlen):
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
    if q.shape[0] != k.shape[0]:
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
        if cu_seqlens is not None:
            raise ValueError("attention_triton: cu_seqlens is for the varlen layout [N, H, D]; q is dense")
        return None, None
    n = q.shape[0]
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"attention_triton: cu_seqlens must be 1-D int32 [n_docs + 1], got {cu_seqlens.dtype} "
            f"{tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device.type == "cpu":
        # Checked only where it costs no device sync; on the GPU cu_seqlens is trusted, as in
        # flash-attn (a host round trip per layer would stall the launch queue).
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != n or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(
                f"attention_triton: cu_seqlens must rise from 0 to N={n}, got {cu[:8]}{'...' if len(cu) > 8 else ''}"
            )
        longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
        if max_seqlen is not None and int(max_seqlen) < longest:
            raise ValueError(f"attention_triton: max_seqlen={max_seqlen} < longest document ({longest} tokens)")
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_seqlen is None:
        # One host sync; callers that know the longest document (the packer does) pass it.
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    max_seqlen = int(max_seqlen)
    if max_seqlen < 0:
        raise ValueError(f"attention_triton: max_seqlen must be >= 0, got {max_seqlen}")
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
    return_lse: bool = False,
):
    """Fused attention with the semantics of ``attention_ref`` (no key_padding_mask).

    q [B, Tq, Hq, D] with k, v [B, Tk, Hkv, D] (dense; causal is bottom-right aligned when
    Tq != Tk), or q [N, Hq, D] with k, v [N, Hkv, D] and ``cu_seqlens`` int32 [n_docs + 1]
    (varlen; no token attends outside its document). ``max_seqlen`` must be at least the longest
    document (the flash-attn convention: it sizes the grid and is trusted); when None it is
    computed from ``cu_seqlens`` with one host sync. Differentiable in q, k, v.

    Returns ``o`` like q or, with ``return_lse``, ``(o, lse)`` with lse float32 [B, Hq, Tq]
    (dense) or [Hq, N] (varlen), -inf on rows that see no key.
    """
    cu_seqlens, max_seqlen = _validate(q, k, v, cu_seqlens, max_seqlen)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    geo = _Geometry(q, k, cu_seqlens, max_seqlen, bool(causal), scale)
    o, lse = _AttentionFn.apply(q, k, v, geo)
    return (o, lse) if return_lse else o
