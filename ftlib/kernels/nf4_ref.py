"""NF4 and blockwise 8-bit quantization math (QLoRA's storage format), bit-compatible with bitsandbytes.

NormalFloat4 (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs",
arXiv:2305.14314) stores a weight as 4-bit indices into a 16-value codebook built
from quantiles of N(0, 1), scaled per block of ``blocksize`` (64) consecutive values
of the row-major flattened weight by the block's absolute maximum:

    absmax_b = max_{i in b} |w_i|
    code_i   = argmin_j |NF4[j] - w_i / absmax_b|   (ties go to the lower index)
    w_i     ~= NF4[code_i] * absmax_b

Two codes are packed per byte, the first value in the high nibble (bitsandbytes' order); an
odd element count is padded with the code of 0.0. Double quantization (QLoRA section 3) stores
the fp32 absmax vector in 8 bits with bitsandbytes' signed dynamic map (blocks of 256):

    absmax ~= DYN[q_b] * absmax2_{b // 256} + offset

so the 4-bit round-trip error is at most ``absmax_b * max_j (NF4[j+1] - NF4[j]) / 2``.

The 4-bit step mirrors bitsandbytes' CPU kernel operation for operation (multiply by the
reciprocal of absmax for whole blocks, divide for the ragged last one, nearest code with ties to
the lower index; fp32 throughout), so packed codes and absmax are byte-identical. For the 8-bit
absmax step ftlib rounds to the exact nearest code (bitsandbytes' PyTorch reference op does the
same); its CPU C kernel uses an approximate binary search that returns a nearby, not the nearest,
code for a small fraction of values (0.2-0.4% in ftlib's tests), so those few 8-bit absmax codes
differ (offset and second-level scales are identical). The 256-value map is stored with the layer
(bitsandbytes' CPU kernel overwrites its first entry with -1.0), so a state quantized by either
library dequantizes in the other to exactly the same values.

This is the math the kernels read (``_lora_kernels._w_tile`` dequantizes this layout tile by
tile) and the PyTorch reference; ``ftlib.lora.nf4`` builds the ``NF4Linear`` layer on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "ABSMAX_BLOCKSIZE",
    "NF4_CODE",
    "check_blocksize",
    "dequantize_absmax",
    "dequantize_blockwise_8bit",
    "dequantize_nf4",
    "double_quantize_absmax",
    "dynamic_map",
    "quantize_blockwise_8bit",
    "quantize_nf4",
]

# bitsandbytes.functional.get_4bit_type("nf4"): create_normal_map(offset=0.9677083).
NF4_CODE = torch.tensor(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    dtype=torch.float32,
)

ABSMAX_BLOCKSIZE = 256  # bitsandbytes' blocksize for the second-level (double) quantization
_DYNAMIC_MAP: torch.Tensor | None = None


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (``create_dynamic_map()``), 256 sorted fp32 values.

    Reproduced step for step (same fp32 ``linspace`` and midpoints) so the values are identical.
    """
    global _DYNAMIC_MAP
    if _DYNAMIC_MAP is None:
        data: list[float] = []
        max_exp, non_sign = 7, 7
        for i in range(max_exp):
            items = int(2 ** (i + non_sign - max_exp) + 1)
            bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
            means = (bounds[:-1] + bounds[1:]) / 2.0
            data += ((10 ** (-(max_exp - 1) + i)) * means).tolist()
            data += (-(10 ** (-(max_exp - 1) + i)) * means).tolist()
        data += [0.0, 1.0]
        data.sort()
        _DYNAMIC_MAP = torch.tensor(data, dtype=torch.float32)
    return _DYNAMIC_MAP


def _blockwise_scale(flat: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split fp32 ``flat`` [n] into blocks; return (values / absmax clamped to [-1, 1] [n], absmax [nb])."""
    n = flat.numel()
    rem = n % blocksize
    full = n - rem
    blocks = flat[:full].view(-1, blocksize)  # (nb_full, blocksize)
    absmax = blocks.abs().amax(dim=1) if full else flat.new_zeros(0)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)).view(-1, 1), -1, 1).reshape(-1)
    if rem:
        # bitsandbytes divides (not multiplies by the reciprocal) in the ragged last block
        am = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, am.view(1)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / am, -1, 1)])
    return scaled, absmax


def _nearest(scaled: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest value in the sorted ``code`` (ties to the lower index), as uint8."""
    code = code.to(scaled.device)
    midpoints = (code[:-1] + code[1:]) / 2
    return torch.bucketize(scaled, midpoints, out_int32=True).to(torch.uint8)


_PAIR_TABLES: dict[torch.device, torch.Tensor] = {}


def _nf4_pair_table(device: torch.device) -> torch.Tensor:
    """(256, 2) fp32: the two NF4 values a packed byte stands for, high nibble first."""
    if device not in _PAIR_TABLES:
        byte = torch.arange(256)
        _PAIR_TABLES[device] = torch.stack([NF4_CODE[byte >> 4], NF4_CODE[byte & 0xF]], dim=1).to(device)
    return _PAIR_TABLES[device]


def check_blocksize(blocksize: int) -> None:
    if blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        raise ValueError(f"NF4 blocksize must be one of 32, 64, ..., 4096 (a power of two), got {blocksize}")


@torch.no_grad()
def quantize_nf4(weight: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``weight`` (any shape, fp32/fp16/bf16) to NF4.

    Returns ``codes`` uint8 [ceil(n / 2)] (two codes a byte, first in the high nibble)
    and ``absmax`` fp32 [ceil(n / blocksize)], equal to bitsandbytes' ``quantize_4bit``
    output (``codes`` is its packed tensor flattened, ``absmax`` its ``quant_state.absmax``).
    A weight with NaN/Inf values raises ValueError (it would spoil its whole block).
    """
    check_blocksize(blocksize)
    if not weight.is_floating_point() or weight.dtype == torch.float64:
        raise TypeError(f"quantize_nf4 expects a fp32/fp16/bf16 tensor, got {weight.dtype}")
    if weight.numel() == 0:
        raise ValueError("quantize_nf4: cannot quantize an empty tensor")
    flat = weight.reshape(-1)
    scaled, absmax = _blockwise_scale(flat.float(), blocksize)
    if not bool(torch.isfinite(absmax).all()):  # [nb] values: a cheap check; NaN/Inf would spoil a block
        first = int((~torch.isfinite(flat)).nonzero()[0, 0])
        raise ValueError(f"quantize_nf4: weight has non-finite values (first at flat index {first})")
    if scaled.numel() % 2:
        scaled = F.pad(scaled, (0, 1))  # pad value 0.0 -> code of 0.0, as bitsandbytes does
    q = _nearest(scaled, NF4_CODE)  # (n_even,)
    codes = (q[0::2] << 4) | q[1::2]
    return codes, absmax


def dequantize_nf4(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype = torch.float32,
    blocksize: int = 64,
) -> torch.Tensor:
    """Pure-PyTorch inverse of :func:`quantize_nf4`: ``NF4[code] * absmax`` in fp32, cast to ``dtype``."""
    check_blocksize(blocksize)
    n = 1
    for s in shape:
        n *= int(s)
    nb = -(-n // blocksize)
    if codes.numel() != (n + 1) // 2 or absmax.numel() != nb:
        raise ValueError(
            f"dequantize_nf4: shape {tuple(shape)} with blocksize {blocksize} needs {(n + 1) // 2} code bytes "
            f"and {nb} absmax values, got {codes.numel()} and {absmax.numel()}"
        )
    # one gather per byte from a 256 x 2 table (high nibble first): no per-element int64 index
    pairs = _nf4_pair_table(codes.device)  # (256, 2)
    vals = pairs.index_select(0, codes.reshape(-1).int()).reshape(-1)  # (2 * bytes,)
    vals = F.pad(vals, (0, nb * blocksize - vals.numel())) if vals.numel() < nb * blocksize else vals
    vals = vals[: nb * blocksize].view(nb, blocksize) * absmax.float().view(-1, 1)
    return vals.reshape(-1)[:n].view(*shape).to(dtype)


@torch.no_grad()
def quantize_blockwise_8bit(x: torch.Tensor, blocksize: int = ABSMAX_BLOCKSIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit blockwise quantization to the nearest value of the dynamic map.

    Returns ``q`` uint8 [n] and ``absmax`` fp32 [ceil(n / blocksize)] (bitsandbytes'
    ``quantize_blockwise`` layout; see the module docstring for the rounding note).
    """
    scaled, absmax = _blockwise_scale(x.reshape(-1).float(), blocksize)
    return _nearest(scaled, dynamic_map()), absmax


def dequantize_blockwise_8bit(
    q: torch.Tensor, absmax: torch.Tensor, blocksize: int = ABSMAX_BLOCKSIZE, code: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise_8bit`: ``code[q] * absmax`` fp32 [n] (default code: the dynamic map)."""
    n = q.numel()
    nb = -(-n // blocksize)
    code = dynamic_map() if code is None else code
    vals = code.to(q.device, torch.float32)[q.reshape(-1).long()]
    vals = F.pad(vals, (0, nb * blocksize - n)).view(nb, blocksize) * absmax.float().view(-1, 1)
    return vals.reshape(-1)[:n]


@torch.no_grad()
def double_quantize_absmax(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """QLoRA double quantization: ``(q uint8 [nb], absmax2 fp32 [ceil(nb / 256)], offset fp32 [1])``."""
    offset = absmax.float().mean()
    q, absmax2 = quantize_blockwise_8bit(absmax.float() - offset)
    return q, absmax2, offset.view(1)


def dequantize_absmax(
    q: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor, code: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`double_quantize_absmax`, fp32 [nb]."""
    return dequantize_blockwise_8bit(q, absmax2, code=code) + offset.float().reshape(())
