"""``NF4Linear``: a frozen linear layer on an NF4 4-bit weight (the QLoRA base), bit-compatible with bitsandbytes.

The format and its math (NormalFloat4, Dettmers et al., "QLoRA", arXiv:2305.14314: 4-bit indices
into a 16-value codebook scaled per block by the block's absmax; double quantization of the absmax
with bitsandbytes' signed dynamic 8-bit map; bitsandbytes' packing order; where ftlib's rounding
differs from bitsandbytes' CPU kernel) live in ``ftlib.kernels.nf4_ref``, whose docstring states
them; the kernels read the same format. Its names are re-exported here.

``NF4Linear`` holds these tensors as ``requires_grad=False`` parameters, all 1-D: codes and 8-bit
absmax as uint8, fp32 scales stored as their int32 bit patterns. FSDP2's ``fully_shard`` shards and
all-gathers them like any other parameter, which is what multi-GPU QLoRA needs, and because none of
them is a floating point tensor, neither an FSDP2 ``MixedPrecisionPolicy(param_dtype=bfloat16)`` nor
``model.to(bfloat16)`` can round the scales (only the bias follows the model's dtype).
Dequantization uses bitsandbytes on CUDA when installed (``FTLIB_NF4_BACKEND=auto|bnb|torch``), the
pure-PyTorch code elsewhere. The matmul recomputes the dequantized weight in backward instead of
saving it, so the only weight-sized memory is one transient copy in the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ftlib._backends import backend_choice
from ftlib.kernels.nf4_ref import (
    ABSMAX_BLOCKSIZE,
    NF4_CODE,
    check_blocksize,
    dequantize_absmax,
    dequantize_blockwise_8bit,
    dequantize_nf4,
    double_quantize_absmax,
    dynamic_map,
    quantize_blockwise_8bit,
    quantize_nf4,
)

__all__ = [
    "NF4Linear",
    "NF4_CODE",
    "dequantize_absmax",
    "dequantize_blockwise_8bit",
    "dequantize_nf4",
    "double_quantize_absmax",
    "dynamic_map",
    "nf4_backend",
    "quantize_blockwise_8bit",
    "quantize_nf4",
]



def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 values as an int32 tensor of the same bits (a copy)."""
    return t.detach().float().contiguous().clone().view(torch.int32)


def _f32(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_bits`: the int32 bit pattern read as fp32 (a view)."""
    return t.view(torch.float32)


def nf4_backend(device: torch.device) -> str:
    """``"bnb"`` or ``"torch"``: the dequantizer used for tensors on ``device``."""
    want = backend_choice("FTLIB_NF4_BACKEND")
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
            blocksize=ABSMAX_BLOCKSIZE, dtype=torch.float32,
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
        check_blocksize(blocksize)
        self.in_features, self.out_features = in_features, out_features
        self.blocksize, self.double_quant, self.compute_dtype = blocksize, double_quant, compute_dtype
        n = in_features * out_features
        nb = -(-n // blocksize)
        frozen = lambda t: nn.Parameter(t, requires_grad=False)
        self.codes = frozen(torch.full(((n + 1) // 2,), 0x77, dtype=torch.uint8, device=device))
        if double_quant:
            self.absmax = frozen(torch.zeros(nb, dtype=torch.uint8, device=device))
            self.absmax2 = frozen(torch.zeros(-(-nb // ABSMAX_BLOCKSIZE), dtype=torch.int32, device=device))
            self.offset = frozen(torch.zeros(1, dtype=torch.int32, device=device))
            self.absmax_code = frozen(_bits(dynamic_map()).to(device))
        else:
            self.absmax = frozen(torch.zeros(nb, dtype=torch.int32, device=device))
        self.bias = frozen(torch.zeros(out_features, dtype=compute_dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, blocksize: int = 64, double_quant: bool = False) -> NF4Linear:
        """Quantize an ``nn.Linear`` (its dtype becomes the compute dtype). A linear on the ``meta``
        device gives a meta layer of the right shapes, filled later (``ftlib.distributed``'s sharded
        loading quantizes the real weight one layer at a time)."""
        return cls.from_weight(linear.weight, linear.bias, blocksize=blocksize, double_quant=double_quant)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, blocksize: int = 64,
                    double_quant: bool = False) -> NF4Linear:
        """Quantize a weight [out, in] (and keep ``bias``): :meth:`from_linear` without the ``nn.Linear``."""
        w = weight.detach()
        layer = cls(
            w.shape[1], w.shape[0], bias is not None, blocksize=blocksize,
            double_quant=double_quant, compute_dtype=w.dtype, device=w.device,
        )
        if w.is_meta:
            return layer
        codes, absmax = quantize_nf4(w, blocksize)
        layer.codes.data = codes
        if double_quant:
            q, absmax2, offset = double_quantize_absmax(absmax)
            layer.absmax.data, layer.absmax2.data, layer.offset.data = q, _bits(absmax2), _bits(offset)
        else:
            layer.absmax.data = _bits(absmax)
        if bias is not None:
            layer.bias.data = bias.detach().clone()
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
            if quant_state.state2.blocksize != ABSMAX_BLOCKSIZE:
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
