"""Fused LoRA matmul on GPU: launchers, autotuning and autograd around the Triton kernels.

``lora_matmul_triton(x, weight, lora_A, lora_B, scaling, *, bias, dropout_p, seed, offset,
magnitude, weight_norm)`` has the semantics of ``lora_matmul_ref`` (LoRA, rsLoRA through
``scaling``, DoRA with ``magnitude``; a dense or ``NF4Linear`` base; dropout from the (seed,
offset) Philox stream) and is differentiable in x, lora_A, lora_B and magnitude.

The math, the tiling and the performance reasoning are in ``_lora_kernels.py``. This file
chooses tile configurations per GPU, launches the forward (u = drop(x) A^T, then the GEMM with
the LoRA / DoRA / bias epilogue) and the backward (v = (g c) B; dB and dc; dX; dA), and validates.

Compute dtype: x's (float16, bfloat16 or float32; float32 runs exact fp32 dots). A dense W of
another dtype is cast for the call (a transient copy, as autocast makes); A and B are read in
their own dtype and rounded to the compute dtype in registers; u, v, dA, dB and dc are
accumulated and kept in fp32, and dA, dB are returned in the adapters' dtype. Saved for backward:
x, u [M, R] fp32 and, for DoRA with a trainable magnitude, z [M, N]; never the dropout mask.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
from torch.autograd.function import once_differentiable

from . import _lora_kernels as _k
from .dora_ref import dora_row_norm, row_sq_norm
from .lora_ref import check_lora_args, is_nf4, lora_matmul_ref, rng_words

__all__ = ["CONFIGS", "KERNELS", "MAX_RANK", "base_matmul_triton", "dropout_mask_triton", "estimate_resources",
           "lora_matmul_triton", "tile_configs"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_RANK = 256  # the skinny kernels keep a whole [tile, R] accumulator in registers


# ----------------------------------------------------------------------------------------------
# Autotune configurations.
#
# GEMMs (forward y tile BLOCK_M x BLOCK_N over K; dX tile BLOCK_M x BLOCK_K over N):
#   * 128 x 256 x 64, 8 warps, 3 stages: the Hopper / A100 main choice; two 64-row warpgroups for
#     wgmma, 3 x 48 KiB of operand stages fit H100's 227 KiB and A100's 163 KiB.
#   * 256 x 128 x 64, 8 warps, 3 stages: the NF4 choice: each dequantized W tile serves 256 rows,
#     halving the dequantization work per FLOP (see _lora_kernels.py).
#   * 128 x 128 x 64, 8 warps, 4 stages: DoRA with dropout and dX with dropout (two fp32 tiles:
#     2 x 64 values per thread), and NF4 (the dequantized tile is built in fp32 registers: the wider
#     tiles spill on sm_80); also fine for everything on A100.
#   * 128 x 128 x 32, 8 warps, 4 stages: fp32 (exact dots on FMA units hold their operands in
#     registers; with 4 warps they spill on sm_80).
#   * 128 x 128 x 32, 4 warps, 4 stages: consumer Ampere / Ada (sm_86/89, ~100 KiB shared memory).
#   * 64 x 128 x 64 and 64 x 64 x 64: few tokens (the grid would not fill the GPU), and fp32.
#   * 64 x 64 x 32, 2 stages: NF4 with K not a multiple of the blocksize (per-element gathers)
#     and fp32 on small shared memory.
# Skinny passes (down: u over K; v over N; dB, dA over a token split): memory-bound streams with
# an accumulator [tile, R] (R padded to a power of two >= 16) held in registers.
# Known spills of defaults (benchmarks/results/compile.csv, left for now): rank 256's down pass
# everywhere (see estimate_resources); on sm_89 (101 KiB) the skinny dB / dA tiles spill 8-16 B.
# Configurations whose shared memory (estimated below) exceeds the device's, or whose tiles held in
# registers exceed 128 words per thread, are pruned before timing, so one list serves sm_80,
# sm_86, sm_89 and sm_90 and every rank up to 256. The first that fits is the one taken without
# autotuning; ftlib.kernels.compile_check compiles them for sm_90 / sm_80 / sm_89 and checks that
# it spills nothing and that the estimate covers the compiled shared memory.
# ----------------------------------------------------------------------------------------------

def _cfg(warps, stages, **blocks):
    return triton.Config(blocks, num_warps=warps, num_stages=stages)


if _INTERPRET:
    # The interpreter runs each program in NumPy: 16-wide tiles exercise the multi-tile paths
    # (ragged tails, several rank chunks, grouped ordering) on the tests' small shapes.
    # (the K tiles are 32 wide: each tile of the dropout mask costs ~150 interpreted Philox ops)
    _FWD_CONFIGS = [_cfg(4, 1, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2)]
    # dX: 64 wide, so an NF4 tile row spans two 32-element blocks in the tests (the GPU's wide tiles)
    _DX_CONFIGS = [_cfg(4, 1, BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, GROUP_M=2)]
    _DOWN_CONFIGS = [_cfg(4, 1, BLOCK_M=16, BLOCK_K=32)]
    _V_CONFIGS = [_cfg(4, 1, BLOCK_M=16, BLOCK_N=16)]
    _DB_CONFIGS = [_cfg(4, 1, BLOCK_M=16, BLOCK_N=16)]
    _DA_CONFIGS = [_cfg(4, 1, BLOCK_M=16, BLOCK_K=32)]
else:
    _FWD_CONFIGS = [
        _cfg(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8),
        _cfg(8, 3, BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8),
        _cfg(8, 4, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8),
        _cfg(8, 4, BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8),
        _cfg(4, 4, BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8),
        _cfg(4, 4, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8),
        _cfg(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8),
        _cfg(4, 2, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8),
    ]
    # dX: BLOCK_K is the output width, BLOCK_N the reduction step
    _DX_CONFIGS = [
        _cfg(8, 3, BLOCK_M=128, BLOCK_K=256, BLOCK_N=64, GROUP_M=8),
        _cfg(8, 3, BLOCK_M=256, BLOCK_K=128, BLOCK_N=64, GROUP_M=8),
        _cfg(8, 4, BLOCK_M=128, BLOCK_K=128, BLOCK_N=64, GROUP_M=8),
        _cfg(8, 4, BLOCK_M=128, BLOCK_K=128, BLOCK_N=32, GROUP_M=8),
        _cfg(4, 4, BLOCK_M=128, BLOCK_K=128, BLOCK_N=32, GROUP_M=8),
        _cfg(4, 4, BLOCK_M=64, BLOCK_K=128, BLOCK_N=64, GROUP_M=8),
        _cfg(4, 3, BLOCK_M=64, BLOCK_K=64, BLOCK_N=64, GROUP_M=8),
        _cfg(4, 2, BLOCK_M=64, BLOCK_K=64, BLOCK_N=32, GROUP_M=8),
    ]
    _DOWN_CONFIGS = [
        _cfg(8, 3, BLOCK_M=64, BLOCK_K=128), _cfg(8, 3, BLOCK_M=64, BLOCK_K=64),
        _cfg(4, 3, BLOCK_M=64, BLOCK_K=128), _cfg(4, 4, BLOCK_M=128, BLOCK_K=64), _cfg(8, 3, BLOCK_M=128, BLOCK_K=128),
        _cfg(4, 4, BLOCK_M=32, BLOCK_K=128), _cfg(4, 2, BLOCK_M=32, BLOCK_K=64),
    ]
    _V_CONFIGS = [
        _cfg(4, 3, BLOCK_M=64, BLOCK_N=128), _cfg(4, 4, BLOCK_M=128, BLOCK_N=64), _cfg(8, 3, BLOCK_M=128, BLOCK_N=128),
        _cfg(4, 4, BLOCK_M=32, BLOCK_N=128), _cfg(4, 2, BLOCK_M=32, BLOCK_N=64),
    ]
    _DB_CONFIGS = [
        _cfg(4, 3, BLOCK_N=64, BLOCK_M=128), _cfg(4, 4, BLOCK_N=128, BLOCK_M=64), _cfg(8, 3, BLOCK_N=128, BLOCK_M=128),
        _cfg(4, 2, BLOCK_N=32, BLOCK_M=64), _cfg(8, 2, BLOCK_N=32, BLOCK_M=64),
    ]
    _DA_CONFIGS = [
        _cfg(4, 3, BLOCK_K=64, BLOCK_M=128), _cfg(4, 4, BLOCK_K=128, BLOCK_M=64), _cfg(8, 3, BLOCK_K=128, BLOCK_M=128),
        _cfg(4, 2, BLOCK_K=32, BLOCK_M=64),
    ]

# FTLIB_LORA_AUTOTUNE=0 skips timing: the first configuration of each list that fits is used
# (the gpu-marked tests set it to save compile time).
_AUTOTUNE = os.environ.get("FTLIB_LORA_AUTOTUNE", "1") != "0"
_MAX_ACC_PER_THREAD = 128  # register words per thread the big tiles may take (255 registers in all)
_MAX_SKINNY_WORDS = 96  # the down / dB passes' limit (their other live values are many small tiles)


def _smem_budget() -> int:
    props = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
    return int(props["max_shared_mem"])


# which config block is (output tile rows or width, reduction step) for each skinny kernel
_SKINNY_BLOCKS = {"down": ("BLOCK_M", "BLOCK_K"), "v": ("BLOCK_M", "BLOCK_N"),
                  "db": ("BLOCK_N", "BLOCK_M"), "da": ("BLOCK_K", "BLOCK_M")}


def estimate_resources(kind, c, kwargs) -> tuple[int, int]:
    """(shared memory bytes, 32-bit register words per thread the big tiles take) of config ``c``.

    Calibrated against the compiled kernels (``ftlib.kernels.compile_check``; the table is
    ``benchmarks/results/compile.csv``): for every default configuration the estimate is not below
    the compiled shared memory, and the configurations within ``_MAX_ACC_PER_THREAD`` words do not
    spill on sm_80 / sm_90. The GEMMs' shared memory is the main loop's operand stages
    (``num_stages`` x the x and W tiles; NF4 adds the dequantized tile) plus one stage of the rank-r
    epilogue's operands (u or v, and B or A: ``(BM + width) x BLOCK_R``). The epilogue loop is not
    software-pipelined (``_lora_kernels``): pipelined, it held ``num_stages`` copies of those operands
    and ranks > 16 compiled to up to 80 KiB more than this sum (the 128 x 128 x 32 default on sm_89
    then needed 160 KiB of its 99 KiB). The compiler reuses the main loop's buffers for it, so the
    sum is an upper bound for every configuration the launcher keeps (``compile.csv``: every
    configuration of every variant on sm_90, sm_80 and sm_89); only three that it prunes for their
    registers (NF4 dX with DoRA and dropout, 128-wide tiles on sm_90) compile to up to 12 KiB more.
    """
    esize = 4 if kwargs["PRECISION"] == "ieee" else 2
    stages, threads, kw = max(c.num_stages, 1), 32 * c.num_warps, c.kwargs
    br = kwargs["BLOCK_R"]
    if kind in ("fwd", "dx"):
        bm = kw["BLOCK_M"]
        width, red = (kw["BLOCK_N"], kw["BLOCK_K"]) if kind == "fwd" else (kw["BLOCK_K"], kw["BLOCK_N"])
        # two fp32 tiles: forward x W^T and h W^T (DoRA with dropout); dX g W and the masked part
        two = kwargs.get("DROP_DORA", False) or (kind == "dx" and kwargs["DROPOUT"])
        a_stage = bm * red * esize * (2 if two and kind == "fwd" else 1)  # x (and h) tiles
        words = bm * width * (2 if two else 1)  # fp32 accumulators
        if kwargs["NF4"] and kwargs["NF4_K_ALIGNED"]:
            # packed codes are staged; the dequantized tile is written once per step and is held in
            # registers in fp32 while it is built
            w_stage, extra = width * red // 2, width * red * esize
            words += width * red
        elif kwargs["NF4"]:
            # unaligned K: a code byte and the absmax (fp32, or u8 + fp32 second level) are gathered per
            # element and staged per step; their indices and values take registers too
            w_stage, extra = width * red * (6 if kwargs["DOUBLE_QUANT"] else 5), width * red * esize
            words += bm * width + 3 * width * red
        else:
            w_stage, extra = width * red * esize, 0
        if esize == 4:  # exact fp32 dots run on FMA units: operands are held in registers
            words += (bm + width) * red
        # the rank-r epilogue's operands (u or v, and B or A) are staged beside the main loop's buffers
        epilogue = (bm + width) * br * esize
        return stages * (a_stage + w_stage) + extra + epilogue, words // threads
    tile, red = (kw[name] for name in _SKINNY_BLOCKS[kind])
    smem = stages * (tile * red * esize + br * red * 4)
    if kind not in ("down", "db"):
        return smem, tile * br // threads
    # down / dB: the [tile, R] accumulator, the adapter tile [R, red] and, in the down pass, the
    # Philox state of the dropout mask (2 words an element; 4 when h is written too)
    k = (4 if kwargs.get("WRITE_H") else 2) if kwargs.get("DROPOUT") else 0
    # with dropout and R <= 64 the [tile, R] accumulator is counted twice: the down pass of r = 64 with
    # dropout at 64 x 128 x 8 warps (96 words by the sum alone) spilled 16 B at 255 registers on Triton
    # 3.6, sm_90 (benchmarks/results/compile_recorded_triton3.6.csv); 64 x 64 is taken instead. Larger
    # ranks keep their measured choices (the rank-256 note below)
    acc = tile * br * (2 if kwargs.get("DROPOUT") and br <= 64 else 1)
    words = (acc + br * red * esize // 4 + tile * red * k) // threads
    # rank 256 in the down pass spills in every tile compiled (the [64, 256] fp32 accumulator and
    # A's [256, 64] tile): 64 x 64 x 8 warps spills least (112 B on sm_90), which this limit picks
    return smem, words * _MAX_ACC_PER_THREAD // _MAX_SKINNY_WORDS


def _word_limit(kind, meta, arch) -> int:
    # Before Hopper (mma.sync: accumulator and operand fragments both in registers) the GEMMs have
    # fewer registers to spare: the forward's bias or DoRA epilogue and dX's second accumulator with
    # DoRA and dropout spill the 128-word tiles by 8-56 B on sm_80 (compile.csv): smaller tiles there.
    if arch >= 90 or kind not in ("fwd", "dx"):
        return _MAX_ACC_PER_THREAD
    if kind == "fwd":
        extra = meta["HAS_BIAS"] or (meta["DORA"] and not meta["DROP_DORA"])
    else:
        extra = meta["DORA"] and meta["DROPOUT"]
    if not extra:
        return _MAX_ACC_PER_THREAD
    return _MAX_ACC_PER_THREAD * 5 // 8 if meta["NF4"] else _MAX_ACC_PER_THREAD - 8


def tile_configs(kind: str, meta: dict, smem_limit: int, arch: int = 90) -> list[tuple[triton.Config, int]]:
    """The configurations pass ``kind`` may run with constexprs ``meta`` on a device with ``smem_limit`` bytes
    of shared memory per block, in preference order, each with its shared-memory estimate in bytes.

    ``arch`` is the compute capability as 10 * major + minor (sm_80: 80). The first is the one taken
    without autotuning (``FTLIB_LORA_AUTOTUNE=0``); the compile check
    (``ftlib.kernels.compile_check``) compiles each for real targets and holds the estimate to be
    no smaller than the compiled figure.
    """
    configs = CONFIGS[kind]
    kept = []
    for c in configs:
        smem, acc = estimate_resources(kind, c, meta)
        if smem <= smem_limit and acc <= _word_limit(kind, meta, arch):
            kept.append((c, smem))
    if kind in ("fwd", "dx") and meta["NF4"] and meta["NF4_K_ALIGNED"]:
        # prefer tiles whose K range is whole NF4 blocks or part of one (packed code loads)
        nb = meta["NF4_BLOCK"]
        aligned = [(c, s) for c, s in kept if nb % c.kwargs["BLOCK_K"] == 0 or c.kwargs["BLOCK_K"] % nb == 0]
        kept = aligned or kept
    if not kept:
        c = min(configs, key=lambda c: estimate_resources(kind, c, meta))
        kept = [(c, estimate_resources(kind, c, meta)[0])]
    return kept


def _prune(kind):
    def prune(configs, named_args, **kwargs):
        major, minor = torch.cuda.get_device_capability()
        kept = [c for c, _ in tile_configs(kind, kwargs, _smem_budget(), 10 * major + minor)]
        return kept if _AUTOTUNE else kept[:1]

    return prune


_KEYS = {
    "fwd": ["M_BUCKET", "N", "K", "R", "HAS_LORA", "HAS_BIAS", "DORA", "DROP_DORA", "WRITE_Z", "NF4", "DOUBLE_QUANT",
            "NF4_BLOCK", "PRECISION"],
    "dx": ["M_BUCKET", "N", "K", "R", "DORA", "DROPOUT", "NF4", "DOUBLE_QUANT", "NF4_BLOCK", "PRECISION"],
    "down": ["M_BUCKET", "K", "R", "DROPOUT", "WRITE_H", "PRECISION"],
    "v": ["M_BUCKET", "N", "R", "DORA", "PRECISION"],
    "db": ["M_BUCKET", "N", "R", "DORA_DC", "PRECISION"],
    "da": ["M_BUCKET", "K", "R", "DROPOUT", "PRECISION"],
}


def _untimed(kernel_call, quantiles):
    """The autotuner's ``do_bench`` with FTLIB_LORA_AUTOTUNE=0: times nothing, runs nothing. The prune has left one
    configuration then, which Triton 3.9 takes without timing but Triton 3.6 still timed (``do_bench``:
    ~25 + 100 ms and an L2-flush buffer per kernel and key); the launch that follows compiles and runs it."""
    return [0.0] * len(quantiles)


def _autotune(configs, kind):
    # Keys hold the token count as M_BUCKET, M rounded up to a power of two (it may change every step
    # with dynamic padding): one tuning per layer shape and bucket, not one per distinct M.
    if _INTERPRET:
        return triton.autotune(configs=configs, key=[])
    return triton.autotune(configs=configs, key=_KEYS[kind], prune_configs_by={"early_config_prune": _prune(kind)},
                           do_bench=None if _AUTOTUNE else _untimed)


CONFIGS = {"fwd": _FWD_CONFIGS, "down": _DOWN_CONFIGS, "v": _V_CONFIGS, "db": _DB_CONFIGS, "dx": _DX_CONFIGS,
            "da": _DA_CONFIGS}
# pass name -> the @triton.jit kernel (unwrapped), for the compile check
KERNELS = {"fwd": _k._fwd_kernel, "down": _k._down_kernel, "v": _k._bwd_v_kernel, "db": _k._bwd_db_kernel,
           "dx": _k._bwd_dx_kernel, "da": _k._bwd_da_kernel}
_fwd_kernel = _autotune(_FWD_CONFIGS, "fwd")(_k._fwd_kernel)
_down_kernel = _autotune(_DOWN_CONFIGS, "down")(_k._down_kernel)
_bwd_v_kernel = _autotune(_V_CONFIGS, "v")(_k._bwd_v_kernel)
_bwd_db_kernel = _autotune(_DB_CONFIGS, "db")(_k._bwd_db_kernel)
_bwd_dx_kernel = _autotune(_DX_CONFIGS, "dx")(_k._bwd_dx_kernel)
_bwd_da_kernel = _autotune(_DA_CONFIGS, "da")(_k._bwd_da_kernel)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

# Token splits of the dB / dA reductions: enough programs to fill the GPU, each split a multiple
# of the largest token tile; partial sums [S, ...] fp32 are added in a fixed order afterwards.
_SPLIT_ALIGN = 16 if _INTERPRET else 256
_SPLIT_MIN_ROWS = 16 if _INTERPRET else 1024
# K / N splits of the down and v passes: counted against row tiles of _SKINNY_ROWS, each split a
# multiple of _SKINNY_ALIGN (a multiple of every BLOCK_K / BLOCK_N they use) and >= _SKINNY_MIN long
_SKINNY_ROWS = 16 if _INTERPRET else 64
_SKINNY_ALIGN = 32 if _INTERPRET else 256
_SKINNY_MIN = 32 if _INTERPRET else 1024


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: small, so the tests' token counts are split too
    return torch.cuda.get_device_properties(device).multi_processor_count


def _cdiv(a: int, b: int) -> int:
    # plain integer math on the host (triton.cdiv / next_power_of_2 cost microseconds a call in
    # Triton 3.9, where they are wrapped for use inside kernels; a LoRA call made ~16 of them)
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _splits(m: int, tiles: int, device: torch.device, align: int = 0, min_len: int = 0) -> tuple[int, int]:
    """(number of splits, length of each) of a reduction of length m with ``tiles`` output tiles.

    Enough programs to fill the GPU, each split a multiple of ``align`` and at least ``min_len`` long
    (the token splits of dB / dA by default; the K / N splits of the down / v passes).
    """
    align, min_len = align or _SPLIT_ALIGN, min_len or _SPLIT_MIN_ROWS
    want = _cdiv(2 * _sm_count(device), max(tiles, 1))
    s = max(1, min(want, m // min_len))
    length = _cdiv(_cdiv(m, s), align) * align
    return _cdiv(m, length), length


def _block_r(r: int, chunk: bool) -> int:
    full = max(16, _pow2(r))
    return min(full, 64) if chunk else full  # GEMM epilogues loop over rank chunks of <= 64


def _device_guard(x: torch.Tensor):
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


class _Plan:
    """Everything about one call that is not a differentiable tensor."""

    def __init__(self, spec, dtype, scaling, seed, offset, weight, bias, device):
        self.m, self.k, self.n, self.r = spec.m, spec.k, spec.n, spec.r
        self.m_bucket = _pow2(spec.m)  # the autotuners' key for the token count
        self.dtype = dtype
        self.scaling = float(scaling)
        self.dora, self.dropout, self.nf4 = spec.dora, spec.dropout, spec.nf4
        self.threshold, self.drop_scale = spec.threshold, spec.drop_scale
        self.rng = rng_words(seed, offset)  # key0, key1, ctr2, ctr3: each < 2^31
        self.precision = "ieee" if dtype == torch.float32 else "tf32"  # fp32 stays exact fp32
        self.bias = bias
        self.device = device
        self.weight = weight  # dense tensor in the compute dtype, or the NF4Linear
        if spec.nf4:
            f32 = torch.float32
            self.double_quant = bool(weight.double_quant)
            self.nf4_block = int(weight.blocksize)
            absmax = weight.absmax if self.double_quant else weight.absmax.view(f32)
            second = ((weight.absmax2.view(f32), weight.absmax_code.view(f32), weight.offset.view(f32))
                      if self.double_quant else (absmax, absmax, absmax))
            codes = weight.codes
            self.w_args = (codes, codes, absmax, *second)
            self.stride_wn = 0
        else:
            self.double_quant, self.nf4_block = False, 64
            self.w_args = (weight,) * 6
            self.stride_wn = weight.stride(0)

    def w_meta(self):
        return dict(NF4=self.nf4, DOUBLE_QUANT=self.double_quant, NF4_BLOCK=self.nf4_block,
                    NF4_K_ALIGNED=self.nf4 and self.k % self.nf4_block == 0)


def _gemm_grid(rows: int, cols: int, row_block: str, col_block: str):
    return lambda meta: (_cdiv(rows, meta[row_block]) * _cdiv(cols, meta[col_block]),)


def _forward(x, a, b, c, plan: _Plan, need_z: bool, has_lora: bool = True, out_dtype=None):
    m, k, n, r = plan.m, plan.k, plan.n, plan.r
    drop_dora = plan.dora and plan.dropout
    u = torch.empty(m, r, dtype=torch.float32, device=x.device) if has_lora else x
    h = torch.empty_like(x) if drop_dora else x  # freed when the forward returns
    if has_lora:
        # few tokens: split K so that the pass still has ~2 programs per SM (partials summed after)
        splits, k_per = _splits(k, _cdiv(m, _SKINNY_ROWS), x.device, _SKINNY_ALIGN, _SKINNY_MIN)
        part = u[None] if splits == 1 else torch.empty(splits, m, r, dtype=torch.float32, device=x.device)
        _down_kernel[lambda meta: (_cdiv(m, meta["BLOCK_M"]), splits)](
            x, a, part, h, m, k, r, plan.m_bucket, k_per, x.stride(0), a.stride(0), part.stride(0), part.stride(1),
            h.stride(0), *plan.rng, plan.threshold, plan.drop_scale,
            DROPOUT=plan.dropout, WRITE_H=drop_dora, PRECISION=plan.precision, BLOCK_R=_block_r(r, False),
        )
        if splits > 1:
            torch.sum(part, 0, out=u)
    y = torch.empty(m, n, dtype=out_dtype or plan.dtype, device=x.device)
    z = torch.empty(m, n, dtype=plan.dtype, device=x.device) if need_z else y
    bias = plan.bias if plan.bias is not None else y
    _fwd_kernel[_gemm_grid(m, n, "BLOCK_M", "BLOCK_N")](
        x, h, *plan.w_args, u, b if has_lora else x, bias, c if plan.dora else y, y, z,
        m, n, k, r, plan.m_bucket, plan.scaling,
        x.stride(0), h.stride(0), plan.stride_wn, u.stride(0), b.stride(0) if has_lora else 0, y.stride(0),
        z.stride(0),
        HAS_LORA=has_lora, HAS_BIAS=plan.bias is not None, DORA=plan.dora, DROP_DORA=drop_dora, WRITE_Z=need_z,
        PRECISION=plan.precision, BLOCK_R=_block_r(r, True), **plan.w_meta(),
    )
    return y, u, z


def _backward(g, x, u, z, a, b, c, plan: _Plan, need):
    """(dX, dA fp32, dB fp32, dc fp32), each None when not needed; ``need`` = needs_input_grad[:4]."""
    need_x, need_a, need_b, need_c = need
    m, k, n, r = plan.m, plan.k, plan.n, plan.r
    dev = g.device
    dx = da = db = dc = None
    rng = (*plan.rng, plan.threshold, plan.drop_scale)
    if need_x or need_a:
        v = torch.empty(m, r, dtype=torch.float32, device=dev)
        splits, n_per = _splits(n, _cdiv(m, _SKINNY_ROWS), dev, _SKINNY_ALIGN, _SKINNY_MIN)
        part = v[None] if splits == 1 else torch.empty(splits, m, r, dtype=torch.float32, device=dev)
        _bwd_v_kernel[lambda meta: (_cdiv(m, meta["BLOCK_M"]), splits)](
            g, b, c if plan.dora else v, part, m, n, r, plan.m_bucket, n_per, g.stride(0), b.stride(0),
            part.stride(0), part.stride(1),
            DORA=plan.dora, PRECISION=plan.precision, BLOCK_R=_block_r(r, False),
        )
        if splits > 1:
            torch.sum(part, 0, out=v)
    if need_b or need_c:
        splits, rows = _splits(m, _cdiv(n, 64), dev)
        db_part = torch.empty(splits, n, r, dtype=torch.float32, device=dev)
        dc_part = torch.empty(splits, n, dtype=torch.float32, device=dev) if need_c else db_part
        _bwd_db_kernel[lambda meta: (_cdiv(n, meta["BLOCK_N"]), splits)](
            g, u, z if need_c else g, db_part, dc_part, m, n, r, plan.m_bucket, rows,
            g.stride(0), u.stride(0), z.stride(0) if need_c else 0, db_part.stride(0), db_part.stride(1),
            dc_part.stride(0),
            DORA_DC=need_c, PRECISION=plan.precision, BLOCK_R=_block_r(r, False),
        )
        if need_b:
            scale = plan.scaling * c.detach().view(n, 1) if plan.dora else plan.scaling
            db = db_part.sum(0) * scale  # dB = s c (g^T u)
        if need_c:
            dc = dc_part.sum(0)
    if need_x:
        dx = torch.empty(m, k, dtype=plan.dtype, device=dev)
        _bwd_dx_kernel[_gemm_grid(m, k, "BLOCK_M", "BLOCK_K")](
            g, *plan.w_args, v, a, c if plan.dora else v, dx,
            m, n, k, r, plan.m_bucket, plan.scaling, g.stride(0), plan.stride_wn, v.stride(0), a.stride(0), dx.stride(0), *rng,
            DORA=plan.dora, DROPOUT=plan.dropout, PRECISION=plan.precision, BLOCK_R=_block_r(r, True),
            **plan.w_meta(),
        )
    if need_a:
        splits, rows = _splits(m, _cdiv(k, 64), dev)
        da_part = torch.empty(splits, r, k, dtype=torch.float32, device=dev)
        _bwd_da_kernel[lambda meta: (_cdiv(k, meta["BLOCK_K"]), splits)](
            x, v, da_part, m, k, r, plan.m_bucket, rows, x.stride(0), v.stride(0), da_part.stride(0), da_part.stride(1), *rng,
            DROPOUT=plan.dropout, PRECISION=plan.precision, BLOCK_R=_block_r(r, False),
        )
        da = da_part.sum(0) * plan.scaling  # dA = s v^T h
    return dx, da, db, dc


class _LoRAFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, b, c, plan):
        # x (M, K) compute dtype; a (R, K), b (N, R) adapters' dtype; c (N,) fp32 or None
        need_z = plan.dora and ctx.needs_input_grad[3]
        with _device_guard(x):
            y, u, z = _forward(x, a, b, c, plan, need_z)
        ctx.save_for_backward(x, u, z if need_z else None, a, b, c)
        ctx.plan = plan
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        x, u, z, a, b, c = ctx.saved_tensors
        plan = ctx.plan
        g = gy.to(plan.dtype)
        g = g if g.stride(-1) == 1 and g.stride(0) == plan.n else g.contiguous()
        with _device_guard(g):
            dx, da, db, dc = _backward(g, x, u, z, a, b, c, plan, ctx.needs_input_grad[:4])
        return (dx, None if da is None else da.to(a.dtype), None if db is None else db.to(b.dtype), dc, None)


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------

def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_device(x: torch.Tensor, r: int) -> None:
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"lora_matmul_triton: x must be float16, bfloat16 or float32, got {x.dtype}")
    if r > MAX_RANK:
        raise ValueError(f"lora_matmul_triton: rank {r} > {MAX_RANK} is not supported (use the torch backend)")
    if not x.is_cuda and not _INTERPRET:
        raise RuntimeError("lora_matmul_triton: needs CUDA tensors (set TRITON_INTERPRET=1 before importing ftlib "
                           "to run the kernels on CPU for testing)")


def _base_plan(x2, weight, spec, dtype, scaling, seed, offset, bias):
    w = weight
    if not spec.nf4:
        w = _unit_last(weight.detach().to(dtype))
    return _Plan(spec, dtype, scaling, seed, offset, w, None if bias is None else bias.detach(), x2.device)


def base_matmul_triton(x: torch.Tensor, weight, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x W^T`` (no bias, no adapter, no autograd) with the fused kernel; W dense or ``NF4Linear``.

    x [..., in] in the compute dtype; the result [..., out] in ``out_dtype`` (fp32 by default: DoRA's
    row norm uses it for W A^T without a 16-bit copy of an NF4 weight).
    """
    k = x.shape[-1]
    dummy_a = x.new_zeros(1, k)
    n = weight.out_features if is_nf4(weight) else weight.shape[0]
    spec = check_lora_args(x.detach(), weight, dummy_a, x.new_zeros(n, 1), 1.0, None, 0.0, 0, 0, None, None)
    _check_device(x, 1)
    x2 = _unit_last(x.detach().reshape(spec.m, k))
    if spec.m == 0:
        return x.new_zeros(*x.shape[:-1], n, dtype=out_dtype)
    plan = _base_plan(x2, weight, spec, x.dtype, 1.0, 0, 0, None)
    with _device_guard(x2), torch.no_grad():
        y, _, _ = _forward(x2, None, None, None, plan, need_z=False, has_lora=False, out_dtype=out_dtype)
    return y.reshape(*x.shape[:-1], n)


def dropout_mask_triton(seed: int, offset: int, rows: int, cols: int, p: float,
                        device: torch.device | str = "cuda") -> torch.Tensor:
    """The kernels' dropout mask D, fp32 [rows, cols], from the same Philox helper they use.

    Equal to ``lora_ref.dropout_mask_ref`` for the same arguments (the tests check it).
    """
    from .lora_ref import dropout_threshold

    t, scale = dropout_threshold(p)
    out = torch.empty(rows, cols, dtype=torch.float32, device=device)
    if out.numel():
        bm, bk = 16, 64
        with _device_guard(out):
            _k._mask_kernel[(_cdiv(rows, bm), _cdiv(cols, bk))](
                out, rows, cols, out.stride(0), *rng_words(seed, offset), t, scale, BLOCK_M=bm, BLOCK_K=bk)
    return out


def _row_norm(weight, lora_A, lora_B, scaling, dtype):
    """DoRA's ||W + s B A||_row through ``dora_ref`` (W A^T by the kernel: no out x in temporary)."""

    nf4 = is_nf4(weight)
    w32 = weight.dequantize(torch.float32) if nf4 else None  # ||W||^2 of an NF4 base: one fp32 dequantization
    dense = w32 if nf4 else weight.detach()
    return dora_row_norm(lambda a: base_matmul_triton(a.to(dtype), weight), row_sq_norm(dense), lora_A, lora_B,
                         scaling, weight_rows=lambda idx: dense[idx])


def lora_matmul_triton(
    x: torch.Tensor,
    weight,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    *,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed: int = 0,
    offset: int = 0,
    magnitude: torch.Tensor | None = None,
    weight_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused LoRA / DoRA layer; same arguments and semantics as ``ftlib.kernels.lora_matmul``."""
    spec = check_lora_args(x, weight, lora_A, lora_B, scaling, bias, dropout_p, seed, offset, magnitude,
                           weight_norm)
    _check_device(x, spec.r)
    if spec.m == 0:  # nothing to launch; the reference gives the empty result with its autograd graph
        return lora_matmul_ref(x, weight, lora_A, lora_B, scaling, bias=bias, dropout_p=dropout_p, seed=seed,
                               offset=offset, magnitude=magnitude, weight_norm=weight_norm)
    dtype = x.dtype
    x2 = _unit_last(x.reshape(spec.m, spec.k))
    plan = _base_plan(x2, weight, spec, dtype, scaling, seed, offset, bias)
    c = None
    if spec.dora:
        if weight_norm is None:
            weight_norm = _row_norm(plan.weight, lora_A, lora_B, scaling, dtype)
        c = magnitude.float() / weight_norm.detach().float()  # (N,); autograd takes dc to dm = dc / n
    y = _LoRAFn.apply(x2, _unit_last(lora_A), _unit_last(lora_B), c, plan)
    return y.reshape(*x.shape[:-1], spec.n)
