"""Pure-PyTorch reference of the fused LoRA matmul: the CPU path, the test oracle, the fallback.

Math, for x [M, K] (tokens x in), a frozen base W [N, K] (dense or NF4), adapters A [R, K] and
B [N, R], scaling s, optional bias b [N], and h = drop(x) = x * D with D the dropout mask:

    LoRA   y = x W^T + b + s (h A^T) B^T
    DoRA   y = x W^T + b + (c - 1) * (h W^T) + c * s (h A^T) B^T,     c = m / n   (per output row)
           which is y = c * (x W^T + s (x A^T) B^T) + b without dropout (Liu et al.,
           arXiv:2402.09353, in PEFT's form with dropout); n = ||W + s B A||_row is a constant
           for autograd (paper section 4.3).

Gradients (g = dL/dy; no dW: the base is frozen; c = 1 for LoRA):

    v  = (g * c) B                                   [M, R]
    dB = s (g * c)^T (h A^T)                         [N, R]
    dA = s v^T h                                     [R, K]
    dX = g W + D * (s v A)                           (LoRA, and DoRA without dropout with g * c for g)
    dX = g W + D * ((g * (c - 1)) W + s v A)         (DoRA with dropout)
    dc = sum_tokens g * (h W^T + s (h A^T) B^T),     dm = dc / n

Dropout mask (counter-based, never stored: the kernels regenerate it in backward). Element
(i, k) of the flattened [M, K] input draws from Philox4x32-10 (Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011) with

    counter = (k // 8, i, offset mod 2^31, offset // 2^31),   key = (seed mod 2^31 ^ 0x2545F491, seed // 2^31)

one call giving 4 x 32 bits = 8 uniform 16-bit numbers, for columns 8 (k // 8) .. 8 (k // 8) + 7:
column k takes bits [16 (k % 2), 16 (k % 2) + 16) of output word (k % 8) // 2. An element is kept
when its 16-bit number is >= t = round(p * 65536); kept elements are scaled by 65536 / (65536 - t),
so E[D] = 1 exactly and the realised drop probability is t / 65536 (p to within 2^-17). seed and
offset are integers in [0, 2^62); the key's xor constant keeps the stream apart from torch's own
Philox uses of the same seed. ``dropout_mask_ref`` computes the mask; the Triton kernels compute
the same bits (tests compare them).

``lora_matmul_ref`` takes the same arguments as ``ftlib.kernels.lora_matmul`` and computes in x's
dtype (float64 stays float64) with the DoRA scaling in at least float32; autograd gives the
gradients of x, A, B and the magnitude m. When ``weight_norm`` is not given it is computed
directly as ||W + s B A||_row (an out x in temporary: this is the oracle, not the fast path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["dropout_mask_ref", "dropout_threshold", "lora_matmul_ref", "philox4x32", "rng_words", "uniform16_ref"]

_U32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
KEY_XOR = 0x2545F491  # xored into the low key word (see the module docstring)
SEED_LIMIT = 2**62
_HALF_RANGE = 65536


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product a * b (b int64 holding uint32) without overflow."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    b_hi, b_lo = b >> 16, b & 0xFFFF
    t = a_lo * b_lo
    mid = a_hi * b_lo + a_lo * b_hi + (t >> 16)  # < 2^34
    lo = ((mid & 0xFFFF) << 16) | (t & 0xFFFF)
    hi = a_hi * b_hi + (mid >> 16)
    return hi & _U32, lo


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = 10):
    """Philox4x32 (Random123's round and key schedule) on int64 tensors holding uint32 values.

    ``c0..c3`` broadcastable int64 tensors, ``k0, k1`` Python ints; returns the four output words.
    """
    k0, k1 = int(k0) & _U32, int(k1) & _U32
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _U32, (k1 + _W1) & _U32
    return c0, c1, c2, c3


def dropout_threshold(p: float) -> tuple[int, float]:
    """(t, scale) for drop probability ``p``: drop when the 16-bit uniform is < t; keep scaled by ``scale``."""
    if not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 <= p < 1.0):
        raise ValueError(f"lora_matmul: dropout_p must be a number in [0, 1), got {p!r}")
    t = int(round(p * _HALF_RANGE))
    if t >= _HALF_RANGE:
        raise ValueError(f"lora_matmul: dropout_p={p!r} rounds to 1 at the mask's 2^-16 resolution")
    return t, _HALF_RANGE / (_HALF_RANGE - t)


def _split62(v: int, what: str) -> tuple[int, int]:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < SEED_LIMIT:
        raise ValueError(f"lora_matmul: {what} must be an integer in [0, 2^62), got {v!r}")
    return v & 0x7FFFFFFF, v >> 31


def rng_words(seed: int, offset: int) -> tuple[int, int, int, int]:
    """(key0, key1, counter2, counter3) of the mask stream, each < 2^31 (so kernels take them as int32)."""
    s_lo, s_hi = _split62(seed, "seed")
    o_lo, o_hi = _split62(offset, "offset")
    return s_lo ^ KEY_XOR, s_hi, o_lo, o_hi


def uniform16_ref(seed: int, offset: int, rows: int, cols: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16-bit uniforms of the mask stream, int64 [rows, cols] in [0, 65536) (see the module docstring)."""
    k0, k1, o_lo, o_hi = rng_words(seed, offset)
    groups = -(-cols // 8)
    c0 = torch.arange(groups, dtype=torch.int64, device=device).view(1, groups)
    c1 = torch.arange(rows, dtype=torch.int64, device=device).view(rows, 1)
    c0, c1 = torch.broadcast_tensors(c0, c1)
    c2 = torch.full_like(c0, o_lo)
    c3 = torch.full_like(c0, o_hi)
    words = philox4x32(c0, c1, c2, c3, k0, k1)  # 4 x (rows, groups)
    halves = torch.stack([h for w in words for h in (w & 0xFFFF, w >> 16)], dim=-1)  # (rows, groups, 8)
    return halves.reshape(rows, groups * 8)[:, :cols]


def dropout_mask_ref(seed: int, offset: int, rows: int, cols: int, p: float,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """The dropout mask D, fp32 [rows, cols]: 0 where dropped, 65536 / (65536 - t) where kept."""
    t, scale = dropout_threshold(p)
    return torch.where(uniform16_ref(seed, offset, rows, cols, device) >= t, scale, 0.0).to(torch.float32)


# ----------------------------------------------------------------------------------------------
# Argument checks shared by every backend
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoRASpec:
    """Checked sizes and options of one lora_matmul call."""

    m: int
    k: int
    n: int
    r: int
    nf4: bool
    dora: bool
    threshold: int  # 0: no dropout
    drop_scale: float
    dropout: bool


_NF4_FIELDS = ("codes", "absmax", "blocksize", "double_quant", "out_features", "in_features", "dequantize")


def is_nf4(weight) -> bool:
    """Whether ``weight`` is an NF4 base (``ftlib.lora.NF4Linear`` or anything with its fields, in
    ``nf4_ref``'s layout): kernels know the storage format, not the layer class."""
    return not isinstance(weight, torch.Tensor) and all(hasattr(weight, f) for f in _NF4_FIELDS)


def check_lora_args(x, weight, lora_A, lora_B, scaling, bias, dropout_p, seed, offset, magnitude,
                    weight_norm) -> LoRASpec:
    """Validate one call; raise with the offending argument named."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise TypeError(f"lora_matmul: x must be a floating-point tensor [..., in], got "
                        f"{type(x).__name__ if not isinstance(x, torch.Tensor) else (x.dtype, tuple(x.shape))}")
    k = x.shape[-1]
    nf4 = is_nf4(weight)
    if nf4:
        n, kw = weight.out_features, weight.in_features
        if weight.codes.device != x.device:
            raise ValueError(f"lora_matmul: the NF4 weight is on {weight.codes.device}, x on {x.device}")
    else:
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
            raise TypeError("lora_matmul: weight must be a floating-point tensor [out, in] or an NF4Linear, got "
                            f"{type(weight).__name__ if not isinstance(weight, torch.Tensor) else tuple(weight.shape)}")
        n, kw = weight.shape
    if kw != k:
        raise ValueError(f"lora_matmul: x has {k} input features, the weight {kw} (weight is [out={n}, in={kw}])")
    for name, t in (("lora_A", lora_A), ("lora_B", lora_B)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise TypeError(f"lora_matmul: {name} must be a 2-D floating-point tensor")
    r = lora_A.shape[0]
    if r < 1 or lora_A.shape[1] != k:
        raise ValueError(f"lora_matmul: lora_A must be [r, in={k}] with r >= 1, got {tuple(lora_A.shape)}")
    if tuple(lora_B.shape) != (n, r):
        raise ValueError(f"lora_matmul: lora_B must be [out={n}, r={r}], got {tuple(lora_B.shape)}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,)):
        raise ValueError(f"lora_matmul: bias must be [out={n}], got "
                         f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
    if (weight_norm is not None) and magnitude is None:
        raise ValueError("lora_matmul: weight_norm is given without magnitude (DoRA needs both)")
    for name, t in (("magnitude", magnitude), ("weight_norm", weight_norm)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,)):
            raise ValueError(f"lora_matmul: {name} must be [out={n}], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    for name, t in (("weight", None if nf4 else weight), ("lora_A", lora_A), ("lora_B", lora_B), ("bias", bias),
                    ("magnitude", magnitude), ("weight_norm", weight_norm)):
        if t is not None and t.device != x.device:
            raise ValueError(f"lora_matmul: {name} is on {t.device}, x on {x.device}")
    if torch.is_grad_enabled():
        for name, t in (("weight", None if nf4 else weight), ("bias", bias)):
            if t is not None and t.requires_grad:
                raise ValueError(f"lora_matmul: {name} requires grad, but the base layer is frozen here (no "
                                 f"gradient is computed for it); call {name}.requires_grad_(False)")
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or not math.isfinite(scaling):
        raise ValueError(f"lora_matmul: scaling must be a finite number, got {scaling!r}")
    t, drop_scale = dropout_threshold(dropout_p)
    rng_words(seed, offset)  # range checks
    return LoRASpec(m=x.numel() // k if k else 0, k=k, n=n, r=r, nf4=nf4, dora=magnitude is not None,
                    threshold=t, drop_scale=drop_scale, dropout=dropout_p > 0)


def _dense_weight(weight, dtype: torch.dtype) -> torch.Tensor:
    if is_nf4(weight):
        return weight.dequantize(torch.float32).to(dtype)  # fp32 values NF4[code] * absmax, then rounded
    return weight.detach().to(dtype)


def direct_row_norm(w: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float,
                    dtype: torch.dtype) -> torch.Tensor:
    """||W + s B A||_row in ``dtype`` from the materialised sum (the oracle's norm)."""
    with torch.no_grad():
        return torch.linalg.vector_norm(w.to(dtype) + scaling * (lora_B.to(dtype) @ lora_A.to(dtype)), dim=1)


def lora_matmul_ref(
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
    """The LoRA / DoRA layer of the module docstring, in x's dtype; see ``ftlib.kernels.lora_matmul``."""
    spec = check_lora_args(x, weight, lora_A, lora_B, scaling, bias, dropout_p, seed, offset, magnitude,
                           weight_norm)
    dt = x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(spec.m, spec.k)
    w = _dense_weight(weight, dt)  # (N, K), no grad
    a, b = lora_A.to(dt), lora_B.to(dt)
    h = x2
    if spec.dropout:
        h = x2 * dropout_mask_ref(seed, offset, spec.m, spec.k, dropout_p, x.device).to(dt)
    base = F.linear(x2, w)  # (M, N)
    lora = F.linear(F.linear(h, a), b) * scaling  # (M, N)
    if not spec.dora:
        y = base + lora
        if bias is not None:
            y = y + bias.to(dt)
        return y.reshape(*lead, spec.n)
    ct = torch.promote_types(dt, torch.float32)
    norm = weight_norm if weight_norm is not None else direct_row_norm(w, lora_A, lora_B, scaling, ct)
    c = magnitude.to(ct) / norm.detach().to(ct)  # (N,)
    if spec.dropout:
        hw = F.linear(h, w)  # W drop(x): the DoRA term sees the dropped input
        y = (base.to(ct) - hw.to(ct)) + c * (hw.to(ct) + lora.to(ct))
    else:
        y = c * (base.to(ct) + lora.to(ct))
    if bias is not None:
        y = y + bias.to(ct)
    return y.to(dt).reshape(*lead, spec.n)
