"""Triton kernels for fused attention: FlashAttention-2 forward and backward, GQA, varlen.

The launchers, autotune configurations, autograd wiring and the public function are in
``attention_triton.py``; this file holds the ``@triton.jit`` kernels alone.

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

Separate key segments (``SEPARATE_K``, varlen only): program b reads query segment b from
``CU_SEQLENS`` and key segment b from ``CU_SEQLENS_K``; Tq and Tk are then that pair's lengths and
the bottom-right diagonal ``diag = Tk - Tq`` puts the two segments' last rows at the same position
(flash-attn's varlen convention with cu_seqlens_q != cu_seqlens_k). Every tile rule below is
written in ``diag``, so key tiles wholly above the diagonal or outside the window are skipped per
pair exactly as for dense Tq != Tk. Without it ``CU_SEQLENS_K`` is not read (Tk = Tq).

Two constexpr variants (Mistral / Gemma): ``HAS_WINDOW`` also hides keys j <= i + (Tk - Tq) - W
(``window`` W, the last W positions stay visible); key tiles wholly outside every row's window are
never visited (the loops start at the first tile a row of the program can see), and every visited
tile runs the masked loop. ``SOFTCAP``: scores become c tanh(x / c) with x = scale <q, k>
(``cap_a`` = scale / c, ``cap_b`` = c log2(e) in base 2), and the backward multiplies dS by the
cap's slope 1 - tanh^2(x / c). tanh is written as 2 sigmoid(2x) - 1 (one exp per score).

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
  (bitwise reproducible for a given tile configuration; the autotuner may pick
  another one in another process unless FTLIB_ATTN_AUTOTUNE=0), which atomic
  fp32 adds into dQ are not, and GQA would make those atomics contend G times
  more.

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


import triton
import triton.language as tl

# The kernels are wrapped by triton.autotune in attention_triton.py; the public name is there.
__all__: list[str] = []

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
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, stride_kt, stride_vt, offs_m, offs_n, offs_d,
               len_k, diag, qk_scale, lo, hi, window, cap_a, cap_b,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
               HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(k_ptr + cols[:, None] * stride_kt + offs_d[None, :], cols, len_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)  # (BN, BD)
        if SOFTCAP:
            s = _tanh(tl.dot(q, tl.trans(k), input_precision=PRECISION) * cap_a) * cap_b  # (BM, BN), log2 units
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BM, BN), log2 units
        if MASKED:
            keep = cols[None, :] < len_k
            if HAS_WINDOW and CAUSAL:  # 0 <= i + diag - j < window, as one unsigned compare
                keep = keep & ((offs_m[:, None] + diag - cols[None, :]).to(tl.uint32) < window)
            elif CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
            elif HAS_WINDOW:
                keep = keep & (cols[None, :] > offs_m[:, None] + diag - window)
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


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window"])
def _fwd_kernel(
    Q, K, V, O, LSE, CU_SEQLENS, CU_SEQLENS_K, qk_scale,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, group, window, cap_a, cap_b,
    IS_VARLEN: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, SEPARATE_K: tl.constexpr = False,
):
    # Late causal tiles do the most work: launch them first to shorten the tail.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)  # document (varlen) or batch row (dense)
    h = tl.program_id(2)
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
        if SEPARATE_K:  # key segment b of its own, ending where query segment b ends (bottom-right)
            start_k = tl.load(CU_SEQLENS_K + b)
            len_k = tl.load(CU_SEQLENS_K + b + 1) - start_k
        else:
            start_k = start
            len_k = len_q
        start64 = start.to(tl.int64)
        startk64 = start_k.to(tl.int64)
        q_ptr += start64 * stride_qt
        k_ptr += startk64 * stride_kt
        v_ptr += startk64 * stride_vt
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
    if HAS_WINDOW:  # from the first key tile the tile's first row can see, all masked
        lo = tl.maximum(m0 + diag - window + 1, 0) // BLOCK_N * BLOCK_N
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, stride_kt, stride_vt, offs_m, offs_n,
                                   offs_d, len_k, diag, qk_scale, lo, hi, window, cap_a, cap_b,
                                   True, CAUSAL, PRECISION, BLOCK_N, BLOCK_D, HEAD_DIM, HAS_WINDOW, SOFTCAP)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, stride_kt, stride_vt, offs_m, offs_n,
                                   offs_d, len_k, diag, qk_scale, 0, full, window, cap_a, cap_b,
                                   False, CAUSAL, PRECISION, BLOCK_N, BLOCK_D, HEAD_DIM, HAS_WINDOW, SOFTCAP)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, stride_kt, stride_vt, offs_m, offs_n,
                                   offs_d, len_k, diag, qk_scale, full, hi, window, cap_a, cap_b,
                                   True, CAUSAL, PRECISION, BLOCK_N, BLOCK_D, HEAD_DIM, HAS_WINDOW, SOFTCAP)

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
    seqlen_q,
    IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)  # document (varlen) or batch row (dense)
    h = tl.program_id(2)
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
                    offs_n, offs_mb, offs_d, len_q, diag, qk_scale, lo, hi, window, cap_a, cap_b,
                    MASKED: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                    CAUSAL: tl.constexpr = True, HAS_WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False):
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
        if SOFTCAP:
            t_t = _tanh(qk_t * cap_a)
            p_t = tl.math.exp2(t_t * cap_b - lse2[None, :])
        else:
            p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
        if MASKED:
            if CAUSAL:
                p_t = tl.where(rows[None, :] + diag >= offs_n[:, None], p_t, 0.0)
            if HAS_WINDOW:
                p_t = tl.where(offs_n[:, None] > rows[None, :] + diag - window, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BN, BM)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window"])
def _bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, CU_SEQLENS, CU_SEQLENS_K, qk_scale, sm_scale,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
    stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, group, window, cap_a, cap_b,
    IS_VARLEN: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, SEPARATE_K: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    hk = tl.program_id(2)
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
        if SEPARATE_K:  # key segment b of its own, ending where query segment b ends (bottom-right)
            start_k = tl.load(CU_SEQLENS_K + b)
            len_k = tl.load(CU_SEQLENS_K + b + 1) - start_k
        else:
            start_k = start
            len_k = len_q
        start64 = start.to(tl.int64)
        startk64 = start_k.to(tl.int64)
        k_ptr += startk64 * stride_kt
        v_ptr += startk64 * stride_vt
        dk_ptr += startk64 * stride_dkt
        dv_ptr += startk64 * stride_dvt
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
        lo = 0
        mid = 0
    # With a window, rows i >= n0 + BLOCK_N - 1 - diag + window see none of this tile: [lo, w_hi), masked.
    w_hi = tl.minimum(len_q, tl.maximum(n0 + BLOCK_N - 1 - diag + window, 0))
    for g in range(0, group):  # the query heads sharing kv head hk, summed in a fixed order
        h = hk * group + g
        q_ptr = q_base + h * stride_qh
        do_ptr = do_base + h * stride_doh
        lse_ptr = lse_base + h * stride_lh
        delta_ptr = delta_base + h * stride_lh
        if HAS_WINDOW:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qt,
                                     stride_dot, offs_n, offs_mb, offs_d, len_q, diag, qk_scale, lo,
                                     w_hi, window, cap_a, cap_b, True, PRECISION, BLOCK_M, BLOCK_D, HEAD_DIM,
                                     CAUSAL, HAS_WINDOW, SOFTCAP)
        else:
            if CAUSAL:
                dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qt,
                                         stride_dot, offs_n, offs_mb, offs_d, len_q, diag, qk_scale, lo,
                                         mid_end, window, cap_a, cap_b, True, PRECISION, BLOCK_M, BLOCK_D,
                                         HEAD_DIM, CAUSAL, HAS_WINDOW, SOFTCAP)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qt,
                                     stride_dot, offs_n, offs_mb, offs_d, len_q, diag, qk_scale, mid,
                                     len_q, window, cap_a, cap_b, False, PRECISION, BLOCK_M, BLOCK_D, HEAD_DIM,
                                     CAUSAL, HAS_WINDOW, SOFTCAP)

    out_mask = (offs_n[:, None] < len_k) & (offs_d[None, :] < HEAD_DIM)
    tl.store(dk_ptr + offs_n[:, None] * stride_dkt + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
             mask=out_mask)
    tl.store(dv_ptr + offs_n[:, None] * stride_dvt + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=out_mask)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, stride_kt, stride_vt, offs_m, offs_n, offs_d,
                  len_k, diag, qk_scale, lo, hi, window, cap_a, cap_b,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(k_ptr + cols[:, None] * stride_kt + offs_d[None, :], cols, len_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)  # (BN, BD)
        v = _load_tile(v_ptr + cols[:, None] * stride_vt + offs_d[None, :], cols, len_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BM, BN)
        if SOFTCAP:
            t = _tanh(qk * cap_a)
            p = tl.math.exp2(t * cap_b - lse2[:, None])
        else:
            p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            keep = cols[None, :] < len_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
            if HAS_WINDOW:
                keep = keep & (cols[None, :] > offs_m[:, None] + diag - window)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BM, BN)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window"])
def _bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, CU_SEQLENS, CU_SEQLENS_K, qk_scale, sm_scale,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
    stride_dqb, stride_dqt, stride_dqh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, group, window, cap_a, cap_b,
    IS_VARLEN: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, SEPARATE_K: tl.constexpr = False,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)  # document (varlen) or batch row (dense)
    h = tl.program_id(2)
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
        if SEPARATE_K:  # key segment b of its own, ending where query segment b ends (bottom-right)
            start_k = tl.load(CU_SEQLENS_K + b)
            len_k = tl.load(CU_SEQLENS_K + b + 1) - start_k
        else:
            start_k = start
            len_k = len_q
        start64 = start.to(tl.int64)
        startk64 = start_k.to(tl.int64)
        q_ptr += start64 * stride_qt
        k_ptr += startk64 * stride_kt
        v_ptr += startk64 * stride_vt
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
    if HAS_WINDOW:
        lo = tl.maximum(m0 + diag - window + 1, 0) // BLOCK_N * BLOCK_N
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, stride_kt, stride_vt, offs_m, offs_n, offs_d,
                           len_k, diag, qk_scale, lo, hi, window, cap_a, cap_b, True, CAUSAL, PRECISION, BLOCK_N,
                           BLOCK_D, HEAD_DIM, HAS_WINDOW, SOFTCAP)
    else:
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, stride_kt, stride_vt, offs_m, offs_n, offs_d,
                           len_k, diag, qk_scale, 0, full, window, cap_a, cap_b, False, CAUSAL, PRECISION, BLOCK_N,
                           BLOCK_D, HEAD_DIM, HAS_WINDOW, SOFTCAP)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, stride_kt, stride_vt, offs_m, offs_n, offs_d,
                           len_k, diag, qk_scale, full, hi, window, cap_a, cap_b, True, CAUSAL, PRECISION, BLOCK_N,
                           BLOCK_D, HEAD_DIM, HAS_WINDOW, SOFTCAP)
    o_mask = (offs_m[:, None] < len_q) & (offs_d[None, :] < HEAD_DIM)
    tl.store(dq_ptr + offs_m[:, None] * stride_dqt + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=o_mask)
