"""Triton kernels of the fused LoRA matmul: forward, backward, DoRA scaling, NF4 base, dropout.

The launchers, autotune configurations, autograd wiring and the public function are in
``lora_triton.py``; the math and the dropout stream are in ``lora_ref.py`` (the reference).
Notation: x [M, K] (tokens x in), W [N, K], A [R, K], B [N, R], s the scaling, c = m / n the
DoRA row scale, D the dropout mask, h = x * D, u = h A^T [M, R], g = dL/dy [M, N].

``M_BUCKET`` (every kernel but the mask's) is not read: it is M rounded up to a power of two, an
argument only so that the autotuner's key can hold it (one tuning per bucket of token counts).

Kernels (one program per output tile; every output element is written by one program, partial
sums over token splits are reduced in a fixed order: the op is deterministic, no atomics):

- ``_down_kernel``     u = (x * D) A^T, fp32 [M, R]: a skinny first pass over x (one read of x,
                       the mask generated once); with few tokens split along K (partials summed). With DoRA and dropout it also writes h, which
                       the forward GEMM reads and which is freed right after the forward.
- ``_fwd_kernel``      y = x W^T (+ h W^T for DoRA with dropout) accumulated in fp32 over K, and
                       the epilogue  + s u B^T,  * c (DoRA),  + b;  optionally writes
                       z = h W^T + s u B^T (DoRA: dL/dc = sum_tokens g * z needs it).
- ``_bwd_v_kernel``    v = (g * c) B, fp32 [M, R] (skinny pass over g; c folded into B's rows; split
                       along N with few tokens).
- ``_bwd_db_kernel``   dB = s c * (g^T u) and dc = colsum(g * z), per column tile, summing over a
                       split of the tokens (partials [S, N, R], reduced afterwards).
- ``_bwd_dx_kernel``   dX = (g * c) W accumulated over N, epilogue  + D * (s v A); with DoRA and
                       dropout two accumulators, g W + D * ((g * (c - 1)) W + s v A).
- ``_bwd_da_kernel``   dA = s v^T (x * D) per column tile over a split of the tokens (mask
                       regenerated from (seed, offset): nothing [M, K] is stored for backward).
- ``_mask_kernel``     writes D itself (for the tests: the kernels' mask equals the reference's).

NF4 base: ``_w_tile`` loads a [rows, BLOCK_K] tile of W. For an NF4 W it loads the packed codes
(two 4-bit codes a byte, first in the high nibble, row-major over the flattened [N, K] weight,
``nf4_ref``'s layout), looks each code up in the 16-value NF4 table (constants in registers: a
tree of 15 selects, no memory gather) and multiplies by the
block's absmax (blocks of ``blocksize`` consecutive flattened elements); with double
quantization the absmax itself is ``DYN[q] * absmax2[block // 256] + offset``. All in fp32 in
registers, then rounded to the compute dtype for the tensor cores: W never exists in 16 bits.
When K is a multiple of the blocksize, the codes of a tile row load as BLOCK_K / 2 bytes unpacked in
registers, and a tile row lies in one block (one absmax a row: the forward's 64-wide K steps) or
spans whole blocks (the dX tiles, 128-256 wide: one absmax per block, broadcast by a reshape).

Expected performance (bf16, H100 SXM: 989 TFLOP/s dense, 3.35 TB/s; H200: 4.8 TB/s). Llama-3-8B
q_proj, M = 8192 tokens, K = N = 4096, r = 16:

- Forward GEMM tile BM x BN x BK = 128 x 256 x 64: 2 * 128 * 256 * 64 = 4.2 MFLOP per K step on
  16 KiB of x and 32 KiB of W (85 FLOP/B from L2); over the whole GEMM 275 GFLOP on ~160 MiB of
  unique HBM traffic: compute bound, ~0.3-0.4 ms. The LoRA epilogue adds 2 * BM * BN * R (one
  quarter of one K step at r = 16: 0.4 % for K = 4096) and reads u (8 KiB) and B (16 KiB).
- The down pass is memory bound: 64 MiB of x, 14 us at 4.8 TB/s; backward adds three skinny
  passes (g twice, x once), ~190 MiB.
- What fusion saves against the unfused composition (base GEMM, dropout, lora_A, lora_B, scale,
  add, and autograd's mirror image): the dropout mask (stored as [M, K] bytes) and h written and
  read (3 B x M x K), the [M, N] LoRA output written, scaled and added (~6 x 2 B x M x N), and in
  backward the scaled gradient, dh, the dropout backward and the two-branch dX sum: ~600 MiB
  forward and ~740 MiB backward at this shape, 0.3-0.4 ms on H100 against ~0.8 ms of GEMMs. Hence
  >= 1.3x for forward+backward at r = 16 needs the Triton GEMM within ~5 % of cuBLAS; the saving
  grows on the narrow projections (k/v_proj N = 1024), where the [M, K] passes dominate.
- Dropout: one Philox4x32-10 call (~100 integer instructions) gives 8 mask elements, so one mask
  generation over [8192, 4096] costs ~28 us of integer throughput; it happens three times
  (down pass, dX epilogue, dA pass), which makes those skinny passes ALU- rather than memory-bound.
- DoRA costs an [N] row scale in the epilogue and z (one [M, N] write) when m is trained; with
  dropout, PEFT's form needs W x and W drop(x): a second accumulator, twice the MMA work, in
  forward and in dX (the unfused path runs two GEMMs there too).
- NF4: dequantizing a W element costs ~6 instructions (code load shared by two, shift/and, table
  gather, scale, convert) and is redone by each of the M / BM programs that read it: per K step
  of a 128 x 128 x 64 tile, ~380 issue cycles of ALU work against ~512 cycles of tensor-core work.
  On Hopper wgmma is asynchronous, so the dequantization of the next tile overlaps the MMA of the
  current one; BM = 256 tiles halve the ratio. NF4 within 1.2x of the bf16 base is reachable on
  Hopper only with that overlap; on Ampere (synchronous mma) expect 1.3-1.6x. The gain is memory:
  no transient 16-bit copy of W (112 MiB for 14336 x 4096) and 0.5 B per weight read at small M.
"""

import triton
import triton.language as tl

# The kernels are wrapped by triton.autotune in lora_triton.py; the public names are there.
__all__: list[str] = []


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------

@triton.jit
def _philox(c0, c1, c2, c3, k0, k1):
    # Philox4x32-10 on uint32 tensors (Random123's round function and key schedule).
    for _ in tl.static_range(10):
        _c0 = c0
        _c2 = c2
        c0 = tl.umulhi(0xCD9E8D57, _c2) ^ c1 ^ k0
        c2 = tl.umulhi(0xD2511F53, _c0) ^ c3 ^ k1
        c1 = _c2 * 0xCD9E8D57
        c3 = _c0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _keep_scale(rows, k0, key0, key1, ctr2, ctr3, threshold, drop_scale,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # (BLOCK_M, BLOCK_K) fp32 tile of D for rows `rows` and columns k0 .. k0 + BLOCK_K (k0 % 8 == 0):
    # one Philox call per (row, group of 8 columns), its 4 words split into 8 16-bit uniforms.
    zero = tl.zeros([BLOCK_M, BLOCK_K // 8], dtype=tl.uint32)
    grp = (k0 // 8 + tl.arange(0, BLOCK_K // 8)).to(tl.uint32)
    c0 = zero + grp[None, :]
    c1 = zero + rows.to(tl.uint32)[:, None]
    c2 = zero + ctr2.to(tl.uint32)
    c3 = zero + ctr3.to(tl.uint32)
    r0, r1, r2, r3 = _philox(c0, c1, c2, c3, key0.to(tl.uint32), key1.to(tl.uint32))
    # column 8 j + t takes the 16-bit half t % 2 of word t // 2: interleave levels pick t's bits
    w01 = tl.interleave(r0 & 0xFFFF, r2 & 0xFFFF)  # t = 0, 4
    w23 = tl.interleave(r1 & 0xFFFF, r3 & 0xFFFF)  # t = 2, 6
    w45 = tl.interleave(r0 >> 16, r2 >> 16)  # t = 1, 5
    w67 = tl.interleave(r1 >> 16, r3 >> 16)  # t = 3, 7
    u16 = tl.interleave(tl.interleave(w01, w23), tl.interleave(w45, w67))  # (BLOCK_M, BLOCK_K)
    return tl.where(u16 >= threshold.to(tl.uint32), drop_scale, 0.0)


# The 16 NF4 values (``nf4_ref.NF4_CODE``, bitsandbytes' table) as compile-time constants: the
# lookup is a tree of selects in registers, not a gather from memory (a gathered fp32 tile per
# pipeline stage would cost 4 bytes of shared memory per weight element). Globals a kernel reads
# must be `tl.constexpr(...)` instances (Triton 3.6 and 3.9 alike; a `: tl.constexpr` annotation is not enough).
_NF4_0 = tl.constexpr(-1.0)
_NF4_1 = tl.constexpr(-0.6961928009986877)
_NF4_2 = tl.constexpr(-0.5250730514526367)
_NF4_3 = tl.constexpr(-0.39491748809814453)
_NF4_4 = tl.constexpr(-0.28444138169288635)
_NF4_5 = tl.constexpr(-0.18477343022823334)
_NF4_6 = tl.constexpr(-0.09105003625154495)
_NF4_7 = tl.constexpr(0.0)
_NF4_8 = tl.constexpr(0.07958029955625534)
_NF4_9 = tl.constexpr(0.16093020141124725)
_NF4_10 = tl.constexpr(0.24611230194568634)
_NF4_11 = tl.constexpr(0.33791524171829224)
_NF4_12 = tl.constexpr(0.44070982933044434)
_NF4_13 = tl.constexpr(0.5626170039176941)
_NF4_14 = tl.constexpr(0.7229568362236023)
_NF4_15 = tl.constexpr(1.0)


@triton.jit
def _nf4_value(code):
    # fp32 NF4[code] for int32 codes in [0, 16): 15 selects over the code's bits (a binary tree)
    b0 = (code & 1) != 0
    b1 = (code & 2) != 0
    b2 = (code & 4) != 0
    lo = tl.where(b2, tl.where(b1, tl.where(b0, _NF4_7, _NF4_6), tl.where(b0, _NF4_5, _NF4_4)),
                  tl.where(b1, tl.where(b0, _NF4_3, _NF4_2), tl.where(b0, _NF4_1, _NF4_0)))
    hi = tl.where(b2, tl.where(b1, tl.where(b0, _NF4_15, _NF4_14), tl.where(b0, _NF4_13, _NF4_12)),
                  tl.where(b1, tl.where(b0, _NF4_11, _NF4_10), tl.where(b0, _NF4_9, _NF4_8)))
    return tl.where(code >= 8, hi, lo)


@triton.jit
def _absmax(ABSMAX, ABSMAX2, ABSMAX_CODE, DQ_OFFSET, blk, mask, DOUBLE_QUANT: tl.constexpr):
    # fp32 absmax of NF4 blocks `blk` (any shape); double quantization: DYN[q] * absmax2 + offset.
    # One return after if/else: Triton builds every return of a helper and requires one type.
    if DOUBLE_QUANT:
        q = tl.load(ABSMAX + blk, mask=mask, other=0).to(tl.int32)
        a2 = tl.load(ABSMAX2 + blk // 256, mask=mask, other=0.0)
        a = tl.load(ABSMAX_CODE + q) * a2 + tl.load(DQ_OFFSET)
    else:
        a = tl.load(ABSMAX + blk, mask=mask, other=0.0)
    return a


@triton.jit
def _w_tile(W, CODES, ABSMAX, ABSMAX2, ABSMAX_CODE, DQ_OFFSET, n_idx, k0, K, stride_wn,
            NF4: tl.constexpr, DOUBLE_QUANT: tl.constexpr, NF4_BLOCK: tl.constexpr,
            NF4_K_ALIGNED: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    # (BLOCK_ROWS, BLOCK_K) tile W[n_idx, k0 : k0 + BLOCK_K] in DTYPE; n_idx are valid rows, columns
    # >= K read as 0. A dense W is loaded; an NF4 W is dequantized in registers (fp32, then DTYPE).
    # The branches are constexpr if/elif/else with one return: only the taken one is built (a
    # branch after an early return would be built too, e.g. PER_ROW = 0 when the tile is narrower
    # than a block).
    ks = k0 + tl.arange(0, BLOCK_K)
    n64 = n_idx.to(tl.int64)
    if not NF4:
        w = tl.load(W + n64[:, None] * stride_wn + ks[None, :], mask=ks[None, :] < K, other=0.0).to(DTYPE)
    elif NF4_K_ALIGNED and (NF4_BLOCK % BLOCK_K == 0 or BLOCK_K % NF4_BLOCK == 0):
        # K % blocksize == 0: each row's segment is whole bytes and whole blocks (or part of one block);
        # the codes load as BLOCK_K / 2 bytes a row, unpacked in registers
        start = n64 * K + k0  # (rows,) flat index of each row's first element, a multiple of min(tile, block)
        pair = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        byte = tl.load(CODES + start[:, None] // 2 + tl.arange(0, BLOCK_K // 2)[None, :],
                       mask=(pair < K)[None, :], other=0x77).to(tl.int32)  # 0x77: NF4 zeros past K
        code = tl.interleave(byte >> 4, byte & 0xF)  # (rows, BLOCK_K), first element in the high nibble
        vals = _nf4_value(code)
        if NF4_BLOCK % BLOCK_K == 0:  # one block per row segment: one absmax a row
            scale = _absmax(ABSMAX, ABSMAX2, ABSMAX_CODE, DQ_OFFSET, start // NF4_BLOCK, start >= 0, DOUBLE_QUANT)
            w = (vals * scale[:, None]).to(DTYPE)
        else:  # BLOCK_K / blocksize blocks per row segment (the wide dX tiles)
            PER_ROW: tl.constexpr = BLOCK_K // NF4_BLOCK
            blk = start[:, None] // NF4_BLOCK + tl.arange(0, PER_ROW)[None, :]  # (rows, PER_ROW)
            bmask = (k0 + NF4_BLOCK * tl.arange(0, PER_ROW) < K)[None, :]
            scale = _absmax(ABSMAX, ABSMAX2, ABSMAX_CODE, DQ_OFFSET, blk, bmask, DOUBLE_QUANT)
            vals = tl.reshape(vals, [BLOCK_ROWS, PER_ROW, NF4_BLOCK]) * scale[:, :, None]
            w = tl.reshape(vals, [BLOCK_ROWS, BLOCK_K]).to(DTYPE)
    else:
        # K not a multiple of the blocksize (rare: hidden sizes are multiples of 64): blocks and
        # bytes straddle rows, so codes and absmax are gathered per element. The launcher's
        # shared-memory estimate counts these gathers (the pipeliner stages them per K step).
        kmask = (ks < K)[None, :]
        flat = n64[:, None] * K + ks[None, :]  # (rows, BLOCK_K) int64 index into the flattened weight
        byte = tl.load(CODES + flat // 2, mask=kmask, other=0).to(tl.int32)
        code = (byte >> ((1 - flat % 2) * 4).to(tl.int32)) & 0xF
        scale = _absmax(ABSMAX, ABSMAX2, ABSMAX_CODE, DQ_OFFSET, flat // NF4_BLOCK, kmask, DOUBLE_QUANT)
        w = tl.where(kmask, _nf4_value(code) * scale, 0.0).to(DTYPE)
    return w


@triton.jit
def _grouped_pid(pid, num_m, num_n, GROUP_M: tl.constexpr):
    # Row-major tile order within groups of GROUP_M tile rows: consecutive programs share W tiles
    # (and the same x tiles) in L2.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size
    pid_n = (pid % per_group) // size
    return pid_m, pid_n


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M", "M_BUCKET", "k_per_split", "key0", "key1", "ctr2", "ctr3", "threshold"])
def _down_kernel(
    X, A, U, H, M, K, R, M_BUCKET, k_per_split, stride_xm, stride_am, stride_us, stride_um, stride_hm,
    key0, key1, ctr2, ctr3, threshold, drop_scale,
    DROPOUT: tl.constexpr, WRITE_H: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # partial u over the K range of split program_id(1) (k_per_split a multiple of BLOCK_K; one
    # split when M fills the GPU, several for few tokens, summed afterwards in a fixed order)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ld = rows % M  # rows past M load a valid row; their results are not stored
    r_idx = tl.arange(0, BLOCK_R)
    dtype = X.dtype.element_ty
    x_ptr = X + rows_ld.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + ks[None, :], mask=ks[None, :] < k_hi, other=0.0)  # (BM, BK)
        if DROPOUT:
            x = (x.to(tl.float32) * _keep_scale(rows_ld, k0, key0, key1, ctr2, ctr3, threshold, drop_scale,
                                                BLOCK_M, BLOCK_K)).to(dtype)
            if WRITE_H:
                tl.store(H + rows.to(tl.int64)[:, None] * stride_hm + ks[None, :], x,
                         mask=(rows[:, None] < M) & (ks[None, :] < k_hi))
        a = tl.load(A + r_idx[:, None] * stride_am + ks[None, :], mask=(r_idx[:, None] < R) & (ks[None, :] < k_hi),
                    other=0.0).to(dtype)  # (BR, BK)
        acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
    tl.store(U + split * stride_us + rows.to(tl.int64)[:, None] * stride_um + r_idx[None, :], acc,
             mask=(rows[:, None] < M) & (r_idx[None, :] < R))


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _fwd_kernel(
    X, H, W, CODES, ABSMAX, ABSMAX2, ABSMAX_CODE, DQ_OFFSET,
    U, B, BIAS, MS, Y, Z,
    M, N, K, R, M_BUCKET, scaling,
    stride_xm, stride_hm, stride_wn, stride_um, stride_bn, stride_ym, stride_zm,
    HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, DORA: tl.constexpr, DROP_DORA: tl.constexpr,
    WRITE_Z: tl.constexpr, NF4: tl.constexpr, DOUBLE_QUANT: tl.constexpr, NF4_BLOCK: tl.constexpr,
    NF4_K_ALIGNED: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _grouped_pid(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ld = rows % M
    cols_ld = cols % N
    dtype = X.dtype.element_ty
    x_ptr = X + rows_ld.to(tl.int64)[:, None] * stride_xm
    h_ptr = H + rows_ld.to(tl.int64)[:, None] * stride_hm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_h = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # DoRA with dropout only (else never used)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + ks[None, :], mask=ks[None, :] < K, other=0.0)  # (BM, BK)
        w = _w_tile(W, CODES, ABSMAX, ABSMAX2, ABSMAX_CODE, DQ_OFFSET, cols_ld, k0, K, stride_wn,
                    NF4, DOUBLE_QUANT, NF4_BLOCK, NF4_K_ALIGNED, BLOCK_N, BLOCK_K, dtype)  # (BN, BK)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if DROP_DORA:
            hx = tl.load(h_ptr + ks[None, :], mask=ks[None, :] < K, other=0.0)
            acc_h = tl.dot(hx, tl.trans(w), acc_h, input_precision=PRECISION)

    # epilogue: + s u B^T over rank chunks (u fp32 [M, R], B [N, R]), accumulated into the main
    # accumulator (and, for DoRA with dropout, into acc_h too): no third full tile in registers.
    # Not software-pipelined (num_stages=1): R / BLOCK_R is 1-4 iterations against K / BLOCK_K in the
    # hundreds, and pipelined with the kernel's stages its operands took stages x (BM + BN) x 64 x 2 B
    # of shared memory (176 KiB at 128 x 128, 4 stages: over sm_89's 99 KiB for ranks > 16).
    if HAS_LORA:
        r_idx = tl.arange(0, BLOCK_R)
        for r0 in tl.range(0, R, BLOCK_R, num_stages=1):
            rr = r0 + r_idx
            u = tl.load(U + rows_ld.to(tl.int64)[:, None] * stride_um + rr[None, :], mask=rr[None, :] < R,
                        other=0.0)
            b = tl.load(B + cols_ld.to(tl.int64)[:, None] * stride_bn + rr[None, :], mask=rr[None, :] < R,
                        other=0.0)
            us = (u * scaling).to(dtype)
            bt = tl.trans(b.to(dtype))
            acc = tl.dot(us, bt, acc, input_precision=PRECISION)
            if DROP_DORA:
                acc_h = tl.dot(us, bt, acc_h, input_precision=PRECISION)
    # now acc = x W^T + L and acc_h = h W^T + L, L = s u B^T
    if DORA:
        c = tl.load(MS + cols_ld)[None, :]
        if DROP_DORA:
            z = acc_h  # h W^T + L
            y = acc + (c - 1.0) * acc_h  # x W^T + (c - 1) h W^T + c L
        else:
            z = acc
            y = c * acc
    else:
        z = acc
        y = acc
    if HAS_BIAS:
        y += tl.load(BIAS + cols_ld).to(tl.float32)[None, :]
    out_mask = (rows[:, None] < M) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)[:, None]
    tl.store(Y + rows64 * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=out_mask)
    if WRITE_Z:
        tl.store(Z + rows64 * stride_zm + cols[None, :], z.to(Z.dtype.element_ty), mask=out_mask)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M", "M_BUCKET", "n_per_split"])
def _bwd_v_kernel(
    G, B, MS, V, M, N, R, M_BUCKET, n_per_split, stride_gm, stride_bn, stride_vs, stride_vm,
    DORA: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # partial v over the N range of split program_id(1) (as the down pass splits K)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    n_lo = split * n_per_split
    n_hi = tl.minimum(N, n_lo + n_per_split)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ld = rows % M
    r_idx = tl.arange(0, BLOCK_R)
    dtype = G.dtype.element_ty
    g_ptr = G + rows_ld.to(tl.int64)[:, None] * stride_gm
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        nmask = ns < n_hi
        g = tl.load(g_ptr + ns[None, :], mask=nmask[None, :], other=0.0)  # (BM, BN)
        b = tl.load(B + ns.to(tl.int64)[:, None] * stride_bn + r_idx[None, :],
                    mask=nmask[:, None] & (r_idx[None, :] < R), other=0.0).to(tl.float32)  # (BN, BR)
        if DORA:
            b = b * tl.load(MS + ns, mask=nmask, other=0.0)[:, None]  # (g * c) B = g (c * B)
        acc = tl.dot(g, b.to(dtype), acc, input_precision=PRECISION)
    tl.store(V + split * stride_vs + rows.to(tl.int64)[:, None] * stride_vm + r_idx[None, :], acc,
             mask=(rows[:, None] < M) & (r_idx[None, :] < R))


@triton.jit(do_not_specialize=["M", "M_BUCKET", "rows_per_split"])
def _bwd_db_kernel(
    G, U, Z, DB, DC, M, N, R, M_BUCKET, rows_per_split,
    stride_gm, stride_um, stride_zm, stride_dbs, stride_dbn, stride_dcs,
    DORA_DC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # partial g^T u [N, R] (and colsum(g * z) [N]) over the tokens of split program_id(1)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ld = cols % N
    r_idx = tl.arange(0, BLOCK_R)
    dtype = G.dtype.element_ty
    m_lo = split * rows_per_split
    m_hi = tl.minimum(M, m_lo + rows_per_split)
    acc = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    acc_c = tl.zeros([BLOCK_N], dtype=tl.float32)
    for m0 in range(m_lo, m_hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < m_hi
        rows64 = rows.to(tl.int64)[:, None]
        g = tl.load(G + rows64 * stride_gm + cols_ld[None, :], mask=rmask[:, None], other=0.0)  # (BM, BN)
        u = tl.load(U + rows64 * stride_um + r_idx[None, :], mask=rmask[:, None] & (r_idx[None, :] < R),
                    other=0.0)  # (BM, BR) fp32
        acc = tl.dot(tl.trans(g), u.to(dtype), acc, input_precision=PRECISION)
        if DORA_DC:
            z = tl.load(Z + rows64 * stride_zm + cols_ld[None, :], mask=rmask[:, None], other=0.0)
            acc_c += tl.sum(g.to(tl.float32) * z.to(tl.float32), axis=0)
    cmask = cols < N
    tl.store(DB + split * stride_dbs + cols.to(tl.int64)[:, None] * stride_dbn + r_idx[None, :], acc,
             mask=cmask[:, None] & (r_idx[None, :] < R))
    if DORA_DC:
        tl.store(DC + split * stride_dcs + cols, acc_c, mask=cmask)


@triton.jit(do_not_specialize=["M", "M_BUCKET", "key0", "key1", "ctr2", "ctr3", "threshold"])
def _bwd_dx_kernel(
    G, W, CODES, ABSMAX, ABSMAX2, ABSMAX_CODE, DQ_OFFSET, V, A, MS, DX,
    M, N, K, R, M_BUCKET, scaling, stride_gm, stride_wn, stride_vm, stride_am, stride_dxm,
    key0, key1, ctr2, ctr3, threshold, drop_scale,
    DORA: tl.constexpr, DROPOUT: tl.constexpr, NF4: tl.constexpr, DOUBLE_QUANT: tl.constexpr,
    NF4_BLOCK: tl.constexpr, NF4_K_ALIGNED: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # dX tile (BLOCK_M, BLOCK_K), reduction over N in steps of BLOCK_N
    pid_m, pid_k = _grouped_pid(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_K), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ld = rows % M
    k0 = pid_k * BLOCK_K
    ks = k0 + tl.arange(0, BLOCK_K)
    dtype = G.dtype.element_ty
    g_ptr = G + rows_ld.to(tl.int64)[:, None] * stride_gm
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    acc_d = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        nmask = ns < N
        g = tl.load(g_ptr + ns[None, :], mask=nmask[None, :], other=0.0)  # (BM, BN), 0 past N
        # rows past N load a valid row of W (ns % N) and meet g = 0
        w = _w_tile(W, CODES, ABSMAX, ABSMAX2, ABSMAX_CODE, DQ_OFFSET, ns % N, k0, K, stride_wn,
                    NF4, DOUBLE_QUANT, NF4_BLOCK, NF4_K_ALIGNED, BLOCK_N, BLOCK_K, dtype)  # (BN, BK)
        if DORA:
            c = tl.load(MS + ns, mask=nmask, other=0.0)[None, :]
            if DROPOUT:
                acc = tl.dot(g, w, acc, input_precision=PRECISION)
                acc_d = tl.dot((g.to(tl.float32) * (c - 1.0)).to(dtype), w, acc_d, input_precision=PRECISION)
            else:
                acc = tl.dot((g.to(tl.float32) * c).to(dtype), w, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(g, w, acc, input_precision=PRECISION)

    # epilogue: + D * (s v A [+ (g (c - 1)) W]) over rank chunks (v fp32 [M, R], A [R, K]). Without
    # dropout s v A goes into acc; with DoRA and dropout into acc_d (both then take the mask); with
    # dropout alone into a second tile `lora` (the launcher counts two tiles for these configs).
    # Not software-pipelined, for the forward's reason (shared memory at ranks > 16).
    ks_ld = ks % K
    r_idx = tl.arange(0, BLOCK_R)
    lora = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for r0 in tl.range(0, R, BLOCK_R, num_stages=1):
        rr = r0 + r_idx
        v = tl.load(V + rows_ld.to(tl.int64)[:, None] * stride_vm + rr[None, :], mask=rr[None, :] < R, other=0.0)
        a = tl.load(A + rr.to(tl.int64)[:, None] * stride_am + ks_ld[None, :], mask=rr[:, None] < R, other=0.0)
        vs = (v * scaling).to(dtype)
        if not DROPOUT:
            acc = tl.dot(vs, a.to(dtype), acc, input_precision=PRECISION)
        elif DORA:
            acc_d = tl.dot(vs, a.to(dtype), acc_d, input_precision=PRECISION)
        else:
            lora = tl.dot(vs, a.to(dtype), lora, input_precision=PRECISION)
    if DROPOUT:
        if DORA:
            lora = acc_d
        dx = acc + _keep_scale(rows_ld, k0, key0, key1, ctr2, ctr3, threshold, drop_scale, BLOCK_M, BLOCK_K) * lora
    else:
        dx = acc
    tl.store(DX + rows.to(tl.int64)[:, None] * stride_dxm + ks[None, :], dx.to(DX.dtype.element_ty),
             mask=(rows[:, None] < M) & (ks[None, :] < K))


@triton.jit(do_not_specialize=["M", "M_BUCKET", "rows_per_split", "key0", "key1", "ctr2", "ctr3", "threshold"])
def _bwd_da_kernel(
    X, V, DA, M, K, R, M_BUCKET, rows_per_split, stride_xm, stride_vm, stride_das, stride_dar,
    key0, key1, ctr2, ctr3, threshold, drop_scale,
    DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # partial v^T (x * D) [R, BLOCK_K] over the tokens of split program_id(1)
    pid_k = tl.program_id(0)
    split = tl.program_id(1)
    k0 = pid_k * BLOCK_K
    ks = k0 + tl.arange(0, BLOCK_K)
    ks_ld = ks % K
    r_idx = tl.arange(0, BLOCK_R)
    dtype = X.dtype.element_ty
    m_lo = split * rows_per_split
    m_hi = tl.minimum(M, m_lo + rows_per_split)
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for m0 in range(m_lo, m_hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < m_hi
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + rows64 * stride_xm + ks_ld[None, :], mask=rmask[:, None], other=0.0)  # (BM, BK)
        if DROPOUT:
            x = (x.to(tl.float32) * _keep_scale(rows, k0, key0, key1, ctr2, ctr3, threshold, drop_scale,
                                                BLOCK_M, BLOCK_K)).to(dtype)
        v = tl.load(V + rows64 * stride_vm + r_idx[None, :], mask=rmask[:, None] & (r_idx[None, :] < R),
                    other=0.0)  # (BM, BR) fp32
        acc = tl.dot(tl.trans(v.to(dtype)), x, acc, input_precision=PRECISION)
    tl.store(DA + split * stride_das + r_idx.to(tl.int64)[:, None] * stride_dar + ks[None, :], acc,
             mask=(r_idx[:, None] < R) & (ks[None, :] < K))


@triton.jit
def _mask_kernel(OUT, M, K, stride_om, key0, key1, ctr2, ctr3, threshold, drop_scale,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = tl.program_id(1) * BLOCK_K
    ks = k0 + tl.arange(0, BLOCK_K)
    d = _keep_scale(rows, k0, key0, key1, ctr2, ctr3, threshold, drop_scale, BLOCK_M, BLOCK_K)
    tl.store(OUT + rows.to(tl.int64)[:, None] * stride_om + ks[None, :], d,
             mask=(rows[:, None] < M) & (ks[None, :] < K))
