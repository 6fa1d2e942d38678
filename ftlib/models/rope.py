"""Rotary position embeddings (RoPE) and every frequency scaling checkpoints use.

Math (Su et al. 2021, "RoFormer", arXiv:2104.09864), rotary dim R (the head dim D, or
``int(D * partial_rotary_factor)`` for Phi-3 style partial rotary), pair index i in [0, R/2),
base theta:

    inv_freq_i = theta ** (-2i / R)
    angle(p)_i = p * inv_freq_i                       (p = the token's position)
    rope(x)    = x * cos(angle) * a + rotate_half(x) * sin(angle) * a    (a: attention scaling)

with the "half split" layout of Hugging Face / Meta checkpoints: pair i is
(x[i], x[i + R/2]) and ``rotate_half(x) = cat(-x[R/2:], x[:R/2])``; with partial rotary the
last D - R dims pass through unrotated.

Scalings (``rope_scaling["rope_type"]``; L = ``original_max_position_embeddings``, M =
``max_position_embeddings``, S = the forward's longest position + 1):

- ``linear``: inv_freq / factor (position interpolation, Chen et al. 2023).
- ``dynamic`` (NTK-aware, bloc97 / emozilla): when S > M the base becomes
  theta * (factor * S / M - (factor - 1)) ** (R / (R - 2)); below M it is theta.
- ``yarn`` (Peng et al. 2023, arXiv:2309.00071): per pair a ramp between interpolation
  (inv_freq / factor) and extrapolation (inv_freq), ramp = clamp((i - lo) / (hi - lo), 0, 1) with
  lo, hi the pair indices rotating beta_fast and beta_slow times over L (floor / ceil unless
  ``truncate`` is false); a = ``attention_factor`` or 0.1 ln(factor) + 1 (with ``mscale`` /
  ``mscale_all_dim``: their ratio of that form).
- ``longrope`` (Phi-3, Ding et al. 2024): inv_freq / ext_factor_i with ``long_factor`` when
  S > L, ``short_factor`` otherwise; a = ``attention_factor`` or sqrt(1 + ln(M/L) / ln L)
  (1 when M <= L).
- ``llama3`` (Llama 3.1 reference ``apply_scaling``): with wavelength
  w_i = 2*pi / inv_freq_i, w_lo = L / low_freq_factor, w_hi = L / high_freq_factor:

      w_i < w_hi           -> inv_freq_i                    (high frequencies kept)
      w_i > w_lo           -> inv_freq_i / factor           (low frequencies scaled)
      otherwise            -> (1 - s) * inv_freq_i / factor + s * inv_freq_i,
                              s = (L / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor)

These are the formulas of transformers' ``modeling_rope_utils`` (the specification). Angles are
computed in float32 whatever the model dtype (bf16 positions above 256 would be rounded), then
cos/sin are scaled and cast to the activations' dtype, as the reference implementations do.
"""

from __future__ import annotations

import math

import torch

from ftlib.kernels.rope import rope, rotate_half

__all__ = ["ROPE_TYPES", "apply_rope", "rope_attention_scaling", "rope_cos_sin", "rope_inv_freq", "rotate_half"]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def _base_inv_freq(dim: int, theta: float, device=None) -> torch.Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    return 1.0 / (theta ** exponent)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None, device=None, *,
                  seq_len: int | None = None, max_position_embeddings: int | None = None) -> torch.Tensor:
    """Inverse frequencies float32 [head_dim // 2] for base ``theta`` and an optional scaling dict.

    ``head_dim`` is the rotary dim R. ``seq_len`` (the forward's longest position + 1) selects
    ``dynamic``'s base and ``longrope``'s factors; a Python int the caller knows on the host
    (``BatchPlan.rope_seq_len``), so under ``torch.compile`` the choice is a guard, not a device
    read. ``max_position_embeddings`` is M for ``dynamic`` (and ``longrope``'s default ``factor``).
    """
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return _base_inv_freq(head_dim, theta, device)
    if kind == "dynamic":
        m = int(max_position_embeddings or scaling.get("original_max_position_embeddings") or 0)
        factor = float(scaling["factor"])
        if seq_len is not None and m and seq_len > m:
            theta = theta * ((factor * seq_len / m) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return _base_inv_freq(head_dim, theta, device)
    if kind == "longrope":
        old_len = int(scaling["original_max_position_embeddings"])
        ext = scaling["long_factor"] if seq_len is not None and seq_len > old_len else scaling["short_factor"]
        ext = torch.tensor(ext, dtype=torch.float32, device=device)
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        return 1.0 / (ext * theta ** shape)
    inv_freq = _base_inv_freq(head_dim, theta, device)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "yarn":
        return _yarn(head_dim, theta, factor, scaling, device)
    if kind != "llama3":
        raise ValueError(f"rope_type {kind!r} is not supported (expected one of {', '.join(ROPE_TYPES)})")
    old_len = scaling["original_max_position_embeddings"]
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, factor: float, s: dict, device) -> torch.Tensor:
    old_len = float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def pair_index(rotations: float) -> float:  # the pair rotating `rotations` times over old_len
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = pair_index(beta_fast), pair_index(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # as the reference: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1).to(device)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).to(torch.float32) / dim)
    extrapolate = 1 - ramp  # 1 on the fast (high-frequency) pairs: kept as they are
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_attention_scaling(scaling: dict | None, max_position_embeddings: int) -> float:
    """The factor ``a`` cos and sin are multiplied by (1.0 except for ``yarn`` and ``longrope``)."""
    kind = (scaling or {}).get("rope_type", "default")
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    old_len = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if kind == "yarn":
        factor = float(factor) if factor is not None else max_position_embeddings / old_len
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if m and m_all:
            return float(_mscale(factor, m) / _mscale(factor, m_all))
        return _mscale(factor)
    factor = float(factor) if factor is not None else max_position_embeddings / old_len
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """cos, sin [..., R] for integer ``position_ids`` [...] (angles in float32, times ``scale``, in ``dtype``)."""
    freqs = position_ids[..., None].to(torch.float32) * inv_freq.to(device=position_ids.device, dtype=torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., R): same angle for x[i] and x[i + R/2]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by cos/sin [B, T, R] (broadcast over the heads): ``x * cos +
    rotate_half(x) * sin`` as ``ftlib.kernels.rope`` (one pass each way on CPU) on the first R
    dims; with R < D (partial rotary) the other D - R dims pass through."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return rope(x, cos, sin)
    return torch.cat((rope(x[..., :r].contiguous(), cos, sin), x[..., r:]), dim=-1)
