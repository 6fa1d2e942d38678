"""LoRALinear through the fused LoRA matmul: same outputs and gradients as its PyTorch path, PEFT parity.

``FTLIB_LORA_BACKEND=triton`` runs the Triton kernels (on CPU in the interpreter, which
tests/conftest.py turns on); ``torch`` the layer's own PyTorch path. fp32 layers agree to 1e-5
(both compute in fp32; the kernels' sums run in another order); fp16 under autocast to 2e-3.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ftlib.kernels.lora_triton as lora_triton
from ftlib.kernels.lora_ref import lora_matmul_ref
from ftlib.lora import LoRAConfig, LoRALinear, NF4Linear, apply_lora, save_adapter, trainable_params
from ftlib.lora._fused import draw_dropout_rng

pytest.importorskip("triton")


@pytest.fixture
def kernel_calls(monkeypatch):
    """Count calls of the Triton op (so a test knows the fused path really ran)."""
    calls = []
    real = lora_triton.lora_matmul_triton

    def counting(*args, **kwargs):
        calls.append(kwargs.get("dropout_p", 0.0))
        return real(*args, **kwargs)

    monkeypatch.setattr(lora_triton, "lora_matmul_triton", counting)
    return calls


def _layer(kind, *, dora=False, rslora=False, dropout=0.0, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(45, 29, bias=bias)
    base = NF4Linear.from_linear(lin, double_quant=kind == "nf4dq") if kind.startswith("nf4") else lin
    layer = LoRALinear(base, 3, 6, dropout=dropout, use_dora=dora, use_rslora=rslora)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.3)
        if dora:
            layer.lora_magnitude_vector.mul_(1 + 0.2 * torch.rand(29, generator=g))
    return layer


def _step(layer, x, gy, backend, monkeypatch, autocast=None):
    monkeypatch.setenv("FTLIB_LORA_BACKEND", backend)
    for p in layer.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    if autocast is None:
        y = layer(x)
    else:
        with torch.autocast("cpu", dtype=autocast):
            y = layer(x)
    y.backward(gy.to(y.dtype))
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.requires_grad}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("kind,dora,rslora,bias", [
    ("dense", False, False, True), ("dense", True, True, True), ("dense", False, True, False),
    ("nf4", False, False, True), ("nf4dq", True, False, True),
])
def test_same_outputs_and_gradients_with_either_backend(kind, dora, rslora, bias, monkeypatch, kernel_calls):
    layer = _layer(kind, dora=dora, rslora=rslora, dropout=0.1, bias=bias).eval()  # eval: dropout off
    g = torch.Generator().manual_seed(7)
    x, gy = torch.randn(2, 13, 45, generator=g), torch.randn(2, 13, 29, generator=g)
    y_t, dx_t, grads_t = _step(layer, x, gy, "torch", monkeypatch)
    assert not kernel_calls
    y_k, dx_k, grads_k = _step(layer, x, gy, "triton", monkeypatch)
    assert kernel_calls == [0.0]
    torch.testing.assert_close(y_k, y_t, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx_k, dx_t, atol=1e-5, rtol=1e-5)
    assert set(grads_k) == set(grads_t) and (not dora or "lora_magnitude_vector" in grads_k)
    for name in grads_t:
        assert grads_k[name].dtype == torch.float32, name
        torch.testing.assert_close(grads_k[name], grads_t[name], atol=1e-5, rtol=1e-5, msg=name)
    assert all(p.grad is None for p in layer.base_layer.parameters())


@pytest.mark.parametrize("kind,dora", [("dense", False), ("nf4", True)])
def test_autocast_fp16(kind, dora, monkeypatch, kernel_calls):
    # the adapters stay fp32; under autocast both paths compute in fp16 and the gradients land in fp32
    layer = _layer(kind, dora=dora)
    g = torch.Generator().manual_seed(8)
    x, gy = torch.randn(21, 45, generator=g), torch.randn(21, 29, generator=g)
    y_t, dx_t, grads_t = _step(layer, x, gy, "torch", monkeypatch, autocast=torch.float16)
    y_k, dx_k, grads_k = _step(layer, x, gy, "triton", monkeypatch, autocast=torch.float16)
    assert kernel_calls and y_k.dtype == y_t.dtype == torch.float16 and dx_k.dtype == torch.float32
    err = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
    assert err(y_k, y_t) < 2e-3 and err(dx_k, dx_t) < 2e-3
    for name in grads_t:
        assert grads_k[name].dtype == torch.float32 and err(grads_k[name], grads_t[name]) < 2e-3, name


@pytest.mark.parametrize("dora", [False, True])
def test_training_dropout_is_the_reference_stream(dora, monkeypatch, kernel_calls):
    # in training the fused path draws (seed, offset) from torch's generator; the reference with the
    # same pair gives the same output and gradients
    layer = _layer("dense", dora=dora, dropout=0.3).train()
    g = torch.Generator().manual_seed(9)
    x, gy = torch.randn(19, 45, generator=g), torch.randn(19, 29, generator=g)
    torch.manual_seed(123)
    y_k, dx_k, grads_k = _step(layer, x, gy, "triton", monkeypatch)
    assert kernel_calls == [0.3]
    torch.manual_seed(123)
    seed, offset = draw_dropout_rng(x.device)
    xr = x.clone().requires_grad_()
    params = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters() if p.requires_grad}
    y_r = lora_matmul_ref(xr, layer.base_layer.weight, params["lora_A.weight"], params["lora_B.weight"],
                          layer.scaling, bias=layer.base_layer.bias, dropout_p=0.3, seed=seed, offset=offset,
                          magnitude=params.get("lora_magnitude_vector"),
                          weight_norm=layer.weight_norm() if dora else None)
    y_r.backward(gy)
    torch.testing.assert_close(y_k, y_r.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx_k, xr.grad, atol=1e-5, rtol=1e-5)
    for name, p in params.items():
        torch.testing.assert_close(grads_k[name], p.grad, atol=1e-5, rtol=1e-5, msg=name)
    # the next call draws a new stream
    y2 = layer(x)
    assert not torch.allclose(y2, y_k)


def test_activation_checkpointing_recomputes_the_same_mask(monkeypatch, kernel_calls):
    # torch.utils.checkpoint restores torch's RNG state before recomputing: the recomputed forward
    # draws the same (seed, offset), so gradients equal those of the plain run
    monkeypatch.setenv("FTLIB_LORA_BACKEND", "triton")
    layer = nn.Sequential(_layer("dense", dropout=0.5)).train()
    x = torch.randn(9, 45)
    runs = []
    for ckpt in (False, True):
        torch.manual_seed(3)
        for p in layer.parameters():
            p.grad = None
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if ckpt else layer(x)
        y.square().sum().backward()
        runs.append((y.detach(), layer[0].lora_A.weight.grad.clone(), layer[0].lora_B.weight.grad.clone()))
    assert len(kernel_calls) == 3  # plain, checkpointed forward, recomputation
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_merged_and_disabled_layers_skip_the_kernel(monkeypatch, kernel_calls):
    monkeypatch.setenv("FTLIB_LORA_BACKEND", "triton")
    layer = _layer("dense").eval()
    x = torch.randn(5, 45)
    y = layer(x)
    layer.merge()
    torch.testing.assert_close(layer(x), y, atol=1e-5, rtol=1e-5)
    layer.unmerge()
    layer.disabled = True
    assert torch.equal(layer(x), layer.base_layer(x))
    assert len(kernel_calls) == 1


transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.mark.parametrize("variant", [{}, {"use_dora": True}])
def test_fused_model_matches_peft(variant, tmp_path, monkeypatch, kernel_calls):
    # a tiny Llama adapted by ftlib and run through the kernels gives PEFT's logits and adapter gradients
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).eval()
    model = copy.deepcopy(base)
    apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], **variant))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainable_params(model).values():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    save_adapter(model, tmp_path)
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path, is_trainable=True).eval()
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35], [8, 9, 7, 9, 3, 2, 38]])
    monkeypatch.setenv("FTLIB_LORA_BACKEND", "triton")
    ours = model(input_ids=ids).logits
    assert len(kernel_calls) == 2 * 3
    theirs = pm(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    (ours.square().mean()).backward()
    (theirs.square().mean()).backward()
    peft_name = lambda n: (n.replace(".default", "").replace("lora_magnitude_vector.weight", "lora_magnitude_vector")
                           .removeprefix("base_model.model."))
    peft_grads = {peft_name(n): p.grad for n, p in pm.named_parameters() if p.requires_grad}
    assert set(peft_grads) == set(trainable_params(model))
    for name, p in trainable_params(model).items():
        torch.testing.assert_close(p.grad, peft_grads[name], atol=1e-6, rtol=1e-4, msg=name)
