"""Rotary position embeddings (RoPE), with the ``linear`` and ``llama3`` frequency scalings.

Math (Su et al. 2021, "RoFormer", arXiv:2104.09864), head dim D, pair index
i in [0, D/2), base theta:

    inv_freq_i = theta ** (-2i / D)
    angle(p)_i = p * inv_freq_i                       (p = the token's position)
    rope(x)    = x * cos(angle) + rotate_half(x) * sin(angle)

with the "half split" layout of Hugging Face / Meta checkpoints: pair i is
(x[i], x[i + D/2]) and ``rotate_half(x) = cat(-x[D/2:], x[:D/2])``.

Scalings (applied to ``inv_freq``, never to positions):

- ``linear``: inv_freq / factor (position interpolation, Chen et al. 2023).
- ``llama3`` (Llama 3.1 reference ``apply_scaling``): with wavelength
  w_i = 2*pi / inv_freq_i, L = original_max_position_embeddings,
  w_lo = L / low_freq_factor, w_hi = L / high_freq_factor:

      w_i < w_hi           -> inv_freq_i                    (high frequencies kept)
      w_i > w_lo           -> inv_freq_i / factor           (low frequencies scaled)
      otherwise            -> (1 - s) * inv_freq_i / factor + s * inv_freq_i,
                              s = (L / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor)

Angles are computed in float32 whatever the model dtype (bf16 positions above
256 would be rounded), then cos/sin are cast to the activations' dtype, as the
reference implementations do.
"""

from __future__ import annotations

import math

import torch

from ftlib.kernels.rope import rope, rotate_half

__all__ = ["apply_rope", "rope_cos_sin", "rope_inv_freq", "rotate_half"]


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None, device=None) -> torch.Tensor:
    """Inverse frequencies float32 [head_dim // 2] for base ``theta`` and an optional scaling dict."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind != "llama3":
        raise ValueError(f"rope scaling type {kind!r} is not supported (expected default, linear or llama3)")
    old_len = scaling["original_max_position_embeddings"]
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos, sin [..., D] for integer ``position_ids`` [...] (angles in float32, result in ``dtype``)."""
    freqs = position_ids[..., None].to(torch.float32) * inv_freq.to(device=position_ids.device, dtype=torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., D): same angle for x[i] and x[i + D/2]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by cos/sin [B, T, D] (broadcast over the heads): ``x * cos +
    rotate_half(x) * sin`` as ``ftlib.kernels.rope`` (one pass each way on CPU)."""
    return rope(x, cos, sin)
