"""CUDA checks for the QLoRA path (skipped without a GPU): bitsandbytes fast path vs the reference."""

import pytest
import torch
from torch import nn

from ftlib.lora import LoRALinear, NF4Linear
from ftlib.lora.nf4 import dequantize_nf4, nf4_backend, quantize_nf4

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("double_quant", [False, True])
def test_bnb_fast_path_equals_reference(double_quant, monkeypatch):
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, device="cuda", dtype=torch.bfloat16)
    layer = NF4Linear.from_linear(lin, double_quant=double_quant)
    # the quantizer is plain torch: same codes on CUDA as on CPU
    codes_cpu, absmax_cpu = quantize_nf4(lin.weight.detach().cpu())
    assert torch.equal(layer.codes.cpu(), codes_cpu)
    assert nf4_backend(layer.codes.device) == "bnb"
    fast32, fast16 = layer.dequantize(torch.float32), layer.dequantize(torch.bfloat16)
    monkeypatch.setenv("FTLIB_NF4_BACKEND", "torch")
    ref32, ref16 = layer.dequantize(torch.float32), layer.dequantize(torch.bfloat16)
    assert torch.equal(fast32, ref32)
    torch.testing.assert_close(fast16, ref16, atol=0, rtol=2**-7)  # at most one bf16 rounding step apart
    if not double_quant:
        assert torch.equal(ref32.cpu(), dequantize_nf4(codes_cpu, absmax_cpu, (96, 256)))


@pytest.mark.parametrize("use_dora", [False, True])
def test_qlora_layer_trains_under_autocast(use_dora):
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    base = NF4Linear.from_linear(nn.Linear(512, 256, device="cuda", dtype=torch.bfloat16), double_quant=True)
    layer = LoRALinear(base, 8, 16, use_dora=use_dora)
    x = torch.randn(4, 33, 512, device="cuda")
    ref = base(x.to(torch.bfloat16))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    assert torch.equal(y, ref)  # B = 0: the adapted output is the base output
    y.float().pow(2).mean().backward()
    assert layer.lora_A.weight.grad is None or layer.lora_A.weight.grad.abs().sum() == 0
    assert layer.lora_B.weight.grad.abs().sum() > 0 and layer.lora_B.weight.grad.dtype == torch.float32
    assert all(p.grad is None for p in base.parameters())
