"""NF4 4-bit weight storage (the QLoRA base), bit-compatible with bitsandbytes.

NormalFloat4 (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs",
arXiv:2305.14314) stores a weight as 4-bit indices into a 16-value codebook built
from quantiles of N(0, 1), scaled per block of ``blocksize`` (64) consecutive values
of the row-major flattened weight by the block's absolute maximum:

    absmax_b = max_{i in b} |w_i|
    code_i   = argmin_j |NF4[j] - w_i / absmax_b|   (ties go to the lower index)
    w_i     ~= NF4[code_i] * absmax_b

so the round-trip error is at most ``absmax_b * max_j (NF4[j+1] - NF4[j]) / 2``.
Two codes are packed per byte, the first value in the high nibble (bitsandbytes'
order); an odd element count is padded with the code of 0.0.

Double quantization (QLoRA section 3) stores the fp32 absmax vector itself in 8
bits: subtract its mean ``offset``, then quantize blockwise (blocksize 256) with
bitsandbytes' signed "dynamic" 8-bit map (Dettmers 2015, arXiv:1511.04561):

    absmax ~= DYN[q_b] * absmax2_{b // 256} + offset

The 4-bit step mirrors bitsandbytes' CPU kernel operation for operation (multiply by
the reciprocal of absmax for whole blocks, divide for the ragged last one, nearest
code with ties to the lower index; fp32 throughout), so packed codes and absmax are
byte-identical. For the 8-bit absmax step ftlib rounds to the exact nearest code
(bitsandbytes' PyTorch reference op does the same); its CPU C kernel uses an
approximate binary search that returns a nearby, not the nearest, code for a small
fraction of values (0.2-0.4% in ftlib's tests), so those few 8-bit absmax codes differ
(offset and second-level scales are identical). The 256-value map is stored with the layer
(bitsandbytes' CPU kernel overwrites its first entry with -1.0), so a state quantized
by either library dequantizes in the other to exactly the same values.

``NF4Linear`` is a frozen linear layer holding these tensors as ``requires_grad=False``
parameters, all 1-D: codes and 8-bit absmax as uint8, fp32 scales stored as their int32
bit patterns. FSDP2's ``fully_shard`` shards and all-gathers them like any other
parameter, which is what multi-GPU QLoRA needs, and because none of them is a floating
point tensor, neither an FSDP2 ``MixedPrecisionPolicy(param_dtype=bfloat16)`` nor
``model.to(bfloat16)`` can round the scales (only the bias follows the model's dtype). Dequantization uses bitsandbytes on CUDA when installed
(``FTLIB_NF4_BACKEND=auto|bnb|torch``), the pure-PyTorch code here elsewhere. The
matmul recomputes the dequantized weight in backward instead of saving it, so the
only weight-sized memory is one transient copy in the compute dtype.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "NF4_CODE",
    "NF4Linear",
    "dequantize_absmax",
    "dequantize_blockwise_8bit",
    "dequantize_nf4",
    "double_quantize_absmax",
    "dynamic_map",
    "nf4_backend",
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

_ABSMAX_BLOCKSIZE = 256  # bitsandbytes' blocksize for the second-level (double) quantization
_BACKENDS = ("auto", "bnb", "torch")
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


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 values as an int32 tensor of the same bits (a copy)."""
    return t.detach().float().contiguous().clone().view(torch.int32)


def _f32(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_bits`: the int32 bit pattern read as fp32 (a view)."""
    return t.view(torch.float32)


def _check_blocksize(blocksize: int) -> None:
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
    _check_blocksize(blocksize)
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
    _check_blocksize(blocksize)
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
def quantize_blockwise_8bit(x: torch.Tensor, blocksize: int = _ABSMAX_BLOCKSIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit blockwise quantization to the nearest value of the dynamic map.

    Returns ``q`` uint8 [n] and ``absmax`` fp32 [ceil(n / blocksize)] (bitsandbytes'
    ``quantize_blockwise`` layout; see the module docstring for the rounding note).
    """
    scaled, absmax = _blockwise_scale(x.reshape(-1).float(), blocksize)
    return _nearest(scaled, dynamic_map()), absmax


def dequantize_blockwise_8bit(
    q: torch.Tensor, absmax: torch.Tensor, blocksize: int = _ABSMAX_BLOCKSIZE, code: torch.Tensor | None = None
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


def nf4_backend(device: torch.device) -> str:
    """``"bnb"`` or ``"torch"``: the dequantizer used for tensors on ``device``."""
    want = os.environ.get("FTLIB_NF4_BACKEND", "auto").lower()
    if want not in _BACKENDS:
        raise ValueError(f"FTLIB_NF4_BACKEND={want!r}: expected one of {_BACKENDS}")
    if want == "torch":
        return "torch"
    try:
        import bitsandbytes  # noqa: F401
        have_bnb = True
    except ImportError:
        have_bnb = False
    if want == "bnb":
        if not have_bnb:
            raise RuntimeError("FTLIB_NF4_BACKEND=bnb but bitsandbytes is not installed (pip install bitsandbytes)")
        return "bnb"
    return "bnb" if (have_bnb and device.type == "cuda") else "torch"


def _dequantize_bnb(layer: NF4Linear, dtype: torch.dtype) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    shape = (layer.out_features, layer.in_features)
    code = NF4_CODE.to(layer.codes.device)
    if layer.double_quant:
        state2 = bnbf.QuantState(
            absmax=_f32(layer.absmax2), code=_f32(layer.absmax_code),
            blocksize=_ABSMAX_BLOCKSIZE, dtype=torch.float32,
        )
        state = bnbf.QuantState(
            absmax=layer.absmax, shape=torch.Size(shape), dtype=dtype, blocksize=layer.blocksize,
            code=code, quant_type="nf4", offset=_f32(layer.offset).reshape(()), state2=state2,
        )
    else:
        state = bnbf.QuantState(
            absmax=_f32(layer.absmax), shape=torch.Size(shape), dtype=dtype, blocksize=layer.blocksize,
            code=code, quant_type="nf4",
        )
    return bnbf.dequantize_4bit(layer.codes.view(-1, 1), state)


class _NF4Matmul(torch.autograd.Function):
    """y = x W^T for an NF4 W; backward recomputes W (nothing weight-sized is saved)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: NF4Linear) -> torch.Tensor:  # x (..., in)
        ctx.layer = layer
        return F.linear(x, layer.dequantize(x.dtype))  # (..., out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        w = ctx.layer.dequantize(grad_out.dtype)  # (out, in)
        return grad_out @ w, None


class NF4Linear(nn.Module):
    """A frozen ``nn.Linear`` stored in NF4: ``y = x dequant(W)^T + b``.

    Parameters (all ``requires_grad=False``, all shardable by FSDP2; "fp32 bits" means
    an int32 tensor holding fp32 values bit for bit, read with ``.view(torch.float32)``):
    ``codes`` uint8 [ceil(out*in/2)]; ``absmax`` fp32 bits [nb] (uint8 [nb] with double
    quantization, then also ``absmax2`` fp32 bits [ceil(nb/256)], ``offset`` fp32 bits [1]
    and the 8-bit map ``absmax_code`` fp32 bits [256]);
    ``bias`` in ``compute_dtype`` or None. The matmul runs in the input's dtype (the
    autocast dtype under autocast).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        blocksize: int = 64,
        double_quant: bool = False,
        compute_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        _check_blocksize(blocksize)
        self.in_features, self.out_features = in_features, out_features
        self.blocksize, self.double_quant, self.compute_dtype = blocksize, double_quant, compute_dtype
        n = in_features * out_features
        nb = -(-n // blocksize)
        frozen = lambda t: nn.Parameter(t, requires_grad=False)
        self.codes = frozen(torch.full(((n + 1) // 2,), 0x77, dtype=torch.uint8, device=device))
        if double_quant:
            self.absmax = frozen(torch.zeros(nb, dtype=torch.uint8, device=device))
            self.absmax2 = frozen(torch.zeros(-(-nb // _ABSMAX_BLOCKSIZE), dtype=torch.int32, device=device))
            self.offset = frozen(torch.zeros(1, dtype=torch.int32, device=device))
            self.absmax_code = frozen(_bits(dynamic_map()).to(device))
        else:
            self.absmax = frozen(torch.zeros(nb, dtype=torch.int32, device=device))
        self.bias = frozen(torch.zeros(out_features, dtype=compute_dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, blocksize: int = 64, double_quant: bool = False) -> NF4Linear:
        """Quantize an ``nn.Linear`` (its dtype becomes the compute dtype)."""
        w = linear.weight.detach()
        layer = cls(
            linear.in_features, linear.out_features, linear.bias is not None, blocksize=blocksize,
            double_quant=double_quant, compute_dtype=w.dtype, device=w.device,
        )
        codes, absmax = quantize_nf4(w, blocksize)
        layer.codes.data = codes
        if double_quant:
            q, absmax2, offset = double_quantize_absmax(absmax)
            layer.absmax.data, layer.absmax2.data, layer.offset.data = q, _bits(absmax2), _bits(offset)
        else:
            layer.absmax.data = _bits(absmax)
        if linear.bias is not None:
            layer.bias.data = linear.bias.detach().clone()
        return layer

    @classmethod
    def from_bnb(cls, packed: torch.Tensor, quant_state, bias: torch.Tensor | None = None) -> NF4Linear:
        """Wrap a weight quantized by ``bitsandbytes.functional.quantize_4bit(..., quant_type="nf4")``."""
        if quant_state.quant_type != "nf4" or len(quant_state.shape) != 2:
            raise ValueError(f"from_bnb: need a 2-D nf4 quant state, got {quant_state.quant_type} {quant_state.shape}")
        out_f, in_f = quant_state.shape
        nested = quant_state.nested
        layer = cls(in_f, out_f, bias is not None, blocksize=quant_state.blocksize, double_quant=nested,
                    compute_dtype=quant_state.dtype, device=packed.device)
        layer.codes.data = packed.reshape(-1).view(torch.uint8).clone()
        layer.absmax.data = quant_state.absmax.clone() if nested else _bits(quant_state.absmax)
        if nested:
            if quant_state.state2.blocksize != _ABSMAX_BLOCKSIZE:
                raise ValueError(f"from_bnb: nested absmax blocksize {quant_state.state2.blocksize}, expected 256")
            layer.absmax2.data = _bits(quant_state.state2.absmax)
            layer.offset.data = _bits(quant_state.offset.reshape(1))
            layer.absmax_code.data = _bits(quant_state.state2.code)
        if bias is not None:
            layer.bias.data = bias.detach().clone()
        return layer

    def scales(self) -> torch.Tensor:
        """The per-block absmax, fp32 [nb] (undoing double quantization when used)."""
        if self.double_quant:
            return dequantize_absmax(self.absmax, _f32(self.absmax2), _f32(self.offset), _f32(self.absmax_code))
        return _f32(self.absmax)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight [out, in] in ``dtype`` (default ``compute_dtype``)."""
        dtype = dtype or self.compute_dtype
        if nf4_backend(self.codes.device) == "bnb":
            return _dequantize_bnb(self, dtype)
        return dequantize_nf4(
            self.codes, self.scales(), (self.out_features, self.in_features), dtype, self.blocksize
        )

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            return x.to(torch.get_autocast_dtype(x.device.type))
        return x

    def linear_nobias(self, x: torch.Tensor) -> torch.Tensor:
        """``x dequant(W)^T`` without the bias, (..., in) -> (..., out)."""
        return _NF4Matmul.apply(self._input(x), self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_nobias(x)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def to_linear(self, dtype: torch.dtype | None = None) -> nn.Linear:
        """A plain ``nn.Linear`` holding the dequantized weight in ``dtype`` (default ``compute_dtype``)."""
        dtype = dtype or self.compute_dtype
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.codes.device, dtype=dtype)
        with torch.no_grad():
            out.weight.copy_(self.dequantize(torch.float32))
            if self.bias is not None:
                out.bias.copy_(self.bias)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"blocksize={self.blocksize}, double_quant={self.double_quant}, compute_dtype={self.compute_dtype}")
