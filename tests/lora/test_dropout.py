"""Adapter-input dropout: the law of the mask, its seeding, exact gradients and what backward keeps."""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ftlib.lora._fused as fused_mod
import ftlib.lora.layers as layers_mod
from ftlib.cpu import lora_cpu_unsupported
from ftlib.kernels.lora_ref import uniform16_ref
from ftlib.lora import LoRALinear
from ftlib.lora.dropout import dropout_mask, kept_fraction, masked_linear


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5])
def test_mask_law_independence_and_exact_expectation(p):
    """Invariant: each element is kept with probability kept_fraction(p) (p within 2^-17 of the
    request), independently of its neighbours and of another module's mask on the same input, and
    the scale makes E[drop(x)] = x exactly."""
    torch.manual_seed(0)
    x = torch.ones(1024, 1024)
    m1, scale = dropout_mask(x, p)
    m2, _ = dropout_mask(x, p)
    n = m1.numel()
    q = kept_fraction(p)
    assert abs((1 - q) - p) <= 2.0**-17 and scale == 1.0 / q
    sd = math.sqrt(q * (1 - q) / n)
    for m in (m1, m2):
        assert m.dtype == torch.bool and m.shape == x.shape
        assert abs(m.float().mean().item() - q) < 5 * sd
    both = (m1 & m2).float().mean().item()  # independent masks: P(both kept) = q^2
    assert abs(both - q * q) < 5 * math.sqrt(q * q * (1 - q * q) / n)
    nxt = (m1[:, 1:] & m1[:, :-1]).float().mean().item()  # neighbours independent too
    assert abs(nxt - q * q) < 5 * math.sqrt(q * q * (1 - q * q) / n)
    assert not torch.equal(m1, m2)


@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 63), (5, 64), (4, 65), (3, 300), (2, 3, 513)])
@pytest.mark.parametrize("p", [0.05, 0.5, 0.9])
@pytest.mark.parametrize("compiled", [True, False])
def test_cpu_mask_is_the_fused_kernels_philox_stream(monkeypatch, shape, p, compiled):
    """The CPU mask is ``uniform16_ref(seed, 0, rows, cols) >= round(p 2^16)`` of the flattened
    [rows, cols] input, seed one draw of torch's generator: the C++ kernel's 256- and 64-column
    vector blocks and its scalar tail, split over 3 threads, and the PyTorch fallback (no library)."""
    if compiled:
        if lora_cpu_unsupported() is not None:
            pytest.skip("ftlib/cpu/csrc/lora_dropout.cpp needs a C++ compiler and an AVX2 + FMA CPU")
        monkeypatch.setattr(importlib.import_module("ftlib.cpu.lora_dropout"), "threads", lambda name, n: 3)
    else:
        monkeypatch.setenv("FTLIB_LORA_BACKEND", "torch")  # the same stream in PyTorch ops
    torch.manual_seed(11)
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    torch.manual_seed(11)
    mask, scale = dropout_mask(torch.empty(shape), p)
    cols = shape[-1]
    t = round(p * 65536)
    want = (uniform16_ref(seed, 0, math.prod(shape) // cols, cols) >= t).view(shape)
    assert mask.dtype == torch.bool and torch.equal(mask, want)
    assert scale == 65536 / (65536 - t)


def test_masks_follow_torch_seed_and_rng_state():
    x = torch.zeros(64, 33)
    torch.manual_seed(7)
    a = [dropout_mask(x, 0.1)[0] for _ in range(3)]
    torch.manual_seed(7)
    b = [dropout_mask(x, 0.1)[0] for _ in range(3)]
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    torch.manual_seed(8)
    assert not torch.equal(dropout_mask(x, 0.1)[0], a[0])
    torch.manual_seed(7)
    dropout_mask(x, 0.1)
    state = torch.get_rng_state()  # a checkpoint after the first mask
    after = dropout_mask(x, 0.1)[0]
    torch.set_rng_state(state)
    assert torch.equal(dropout_mask(x, 0.1)[0], after) and torch.equal(after, a[1])


def test_masked_linear_equals_explicit_dropout_float64(monkeypatch):
    """Forward and both gradients equal F.linear(x * m * scale, A) with the same mask."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 10, generator=g, dtype=torch.float64, requires_grad=True)
    a = torch.randn(4, 10, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(3, 7, 10, generator=g) > 0.3
    monkeypatch.setattr("ftlib.lora.dropout.dropout_mask", lambda t, p: (mask, 1 / 0.7))
    u = masked_linear(x, a, 0.3)
    want = F.linear(x * mask / 0.7, a)
    torch.testing.assert_close(u, want, rtol=1e-12, atol=1e-12)
    gu = torch.randn(u.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(u, (x, a), gu)
    ref = torch.autograd.grad(want, (x, a), gu)
    for t, r in zip(got, ref):
        torch.testing.assert_close(t, r, rtol=1e-12, atol=1e-12)


def test_masked_linear_under_bf16_autocast_matches_nn_linear(monkeypatch):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 16, generator=g, requires_grad=True)
    lin = nn.Linear(16, 4, bias=False)
    mask = torch.rand(5, 16, generator=g) > 0.1
    monkeypatch.setattr("ftlib.lora.dropout.dropout_mask", lambda t, p: (mask, 1 / 0.9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        u = masked_linear(x, lin.weight, 0.1)
        want = lin(x * mask / 0.9)
    assert u.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(u, want, rtol=1e-2, atol=1e-2)
    got = torch.autograd.grad(u.float().sum(), (x, lin.weight))
    ref = torch.autograd.grad(want.float().sum(), (x, lin.weight))
    assert got[1].dtype == torch.float32
    for t, r in zip(got, ref):
        torch.testing.assert_close(t, r, rtol=1e-2, atol=1e-2)


def test_lora_layer_dropout_train_and_eval(monkeypatch):
    """Training applies drop(x) to the adapter input only; eval and p = 0 use x itself."""
    torch.manual_seed(0)
    base = nn.Linear(12, 6)
    layer = LoRALinear(base, 3, 6, dropout=0.25)
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(4, 12, dtype=torch.float32)
    mask = torch.rand(4, 12) > 0.25
    monkeypatch.setattr("ftlib.lora.dropout.dropout_mask", lambda t, p: (mask, 1 / 0.75))
    want = base(x) + layer.scaling * layer.lora_B(layer.lora_A(x * mask / 0.75))
    torch.testing.assert_close(layer.train()(x), want, rtol=1e-5, atol=1e-6)
    clean = base(x) + layer.scaling * layer.lora_B(layer.lora_A(x))
    torch.testing.assert_close(layer.eval()(x), clean, rtol=1e-5, atol=1e-6)


def test_dora_with_fast_dropout_matches_peft_form(monkeypatch):
    torch.manual_seed(0)
    base = nn.Linear(9, 5)
    layer = LoRALinear(base, 2, 4, dropout=0.5, use_dora=True).train()
    with torch.no_grad():
        layer.lora_B.weight.normal_(0, 0.3)
        layer.lora_magnitude_vector.mul_(1.1)
    x = torch.randn(3, 9)
    mask = torch.rand(3, 9) > 0.5
    monkeypatch.setattr(layers_mod, "dropout_mask", lambda t, p: (mask, 2.0))
    w, A, B, m, s = (base.weight.double(), layer.lora_A.weight.double(), layer.lora_B.weight.double(),
                     layer.lora_magnitude_vector.double(), layer.scaling)
    n = torch.linalg.vector_norm(w + s * B @ A, dim=1)
    h = x.double() * mask * 2.0
    want = x.double() @ w.t() + base.bias.double() + (m / n - 1) * (h @ w.t()) + (m / n) * s * (h @ A.t() @ B.t())
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


def test_backward_keeps_x_once_and_one_byte_masks():
    """Three adapters on one input (q/k/v): autograd keeps x once plus three bool masks, never a
    dropped float copy of x (which nn.Dropout + nn.Linear keep per projection)."""
    torch.manual_seed(0)
    x = torch.randn(8, 32, requires_grad=True)
    layers = [LoRALinear(nn.Linear(32, 32), 4, 8, dropout=0.1).train() for _ in range(3)]
    for layer in layers:
        nn.init.normal_(layer.lora_B.weight)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        h = x * 1.0  # the shared (normalised) input
        out = sum(layer(h).sum() for layer in layers)
    big = [t for t in saved if t.shape == x.shape]
    floats = {t.untyped_storage().data_ptr() for t in big if t.dtype.is_floating_point}
    masks = [t for t in big if t.dtype == torch.bool]
    assert len(floats) == 1 and len(masks) == 3, [(t.dtype, t.untyped_storage().data_ptr()) for t in big]
    out.backward()
    assert all(layer.lora_A.weight.grad.abs().sum() > 0 for layer in layers)


@pytest.mark.parametrize("shape", [(7,), (3, 7), (2, 3, 5)])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_lora_layer_update_and_gradients_float64(monkeypatch, shape, p):
    """y = W x + b + s B A drop(x), and the gradients of x, A and B, for 2-D, 3-D (the update
    accumulated into the base output by one in-place GEMM) and 4-D inputs (the fallback)."""
    g = torch.Generator().manual_seed(3)
    base = nn.Linear(10, 6).double()
    layer = LoRALinear(base, 4, 12, dropout=p, adapter_dtype=torch.float64).train()
    with torch.no_grad():
        layer.lora_B.weight.normal_(generator=g)
    x = torch.randn(*shape, 10, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(*shape, 10, generator=g) > p
    monkeypatch.setattr("ftlib.lora.dropout.dropout_mask", lambda t, q: (mask, 1 / (1 - q)))
    y = layer(x)
    a, b = layer.lora_A.weight, layer.lora_B.weight
    want = F.linear(x, base.weight, base.bias) + layer.scaling * F.linear(F.linear(x * mask / (1 - p), a), b)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(y, (x, a, b), gy)
    ref = torch.autograd.grad(want, (x, a, b), gy)
    for t, r in zip(got, ref):
        torch.testing.assert_close(t, r, rtol=1e-12, atol=1e-12)


def _cpu_lib_or_skip(r=16):
    if lora_cpu_unsupported(r) is not None:
        pytest.skip("ftlib/cpu/csrc/lora_dropout.cpp needs a C++ compiler and an AVX2 + FMA CPU")
    return importlib.import_module("ftlib.cpu.lora_dropout")


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("r", [8, 16, 24, 64])
@pytest.mark.parametrize("n,k", [(1, 3), (5, 33), (37, 100), (6, 1411)])
def test_cpu_kernels_equal_float64_products(monkeypatch, r, n, k, threads):
    """The three C++ products on odd shapes (row and column tails, every rank branch, work split over
    threads) against float64: u = (x * m) A^T * c, dx = (du A) * m, dA = du^T (x * m); a NaN in x
    stays NaN where dropped."""
    wing = _cpu_lib_or_skip(r)
    monkeypatch.setattr(wing, "threads", lambda name, n: threads)
    g = torch.Generator().manual_seed(r * 1000 + n + k)
    x, a, du = torch.randn(n, k, generator=g), torch.randn(r, k, generator=g), torch.randn(n, r, generator=g)
    m = torch.rand(n, k, generator=g) > 0.3
    xm = x.double() * m
    tol = dict(rtol=1e-5, atol=1e-5 * math.sqrt(k))
    torch.testing.assert_close(wing.masked_xa_cpu(x, m, a, 0.7).double(), xm @ a.double().t() * 0.7, **tol)
    torch.testing.assert_close(wing.masked_dx_cpu(du, a, m).double(), (du.double() @ a.double()) * m, **tol)
    torch.testing.assert_close(wing.masked_da_cpu(du, x, m).double(), du.double().t() @ xm, rtol=1e-5,
                               atol=1e-5 * math.sqrt(n))
    x[0, 0], m[0, 0] = float("nan"), False
    assert wing.masked_xa_cpu(x, m, a, 1.0)[0].isnan().all()  # as x * m in the PyTorch path


def test_lora_layer_cpu_kernels_equal_torch_ops(monkeypatch):
    """An fp32 LoRA layer with dropout on CPU runs the C++ products (counted), and its output and
    gradients equal the PyTorch path's (FTLIB_LORA_BACKEND=torch) on the same masks."""
    wing = _cpu_lib_or_skip(16)
    calls = []
    real = wing.masked_xa_cpu
    monkeypatch.setattr(wing, "masked_xa_cpu", lambda *a: calls.append(1) or real(*a))

    def run():
        torch.manual_seed(0)
        layer = LoRALinear(nn.Linear(40, 24), 16, 32, dropout=0.1).train()
        nn.init.normal_(layer.lora_B.weight)
        x = torch.randn(2, 9, 40, requires_grad=True)
        y = layer(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
        return y.detach(), x.grad, layer.lora_A.weight.grad, layer.lora_B.weight.grad

    got = run()
    assert calls, "the C++ path was not taken"
    monkeypatch.setenv("FTLIB_LORA_BACKEND", "torch")
    n = len(calls)
    want = run()
    assert len(calls) == n
    for t, w in zip(got, want):
        torch.testing.assert_close(t, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(37, 40), (2, 19, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_one_node_cpu_layer_equals_the_general_path(monkeypatch, shape, bias):
    """A frozen fp32 ``nn.Linear`` base with a dropout adapter on CPU runs as one autograd node
    (``masked_lora_linear``: dx = dy W with the adapter's masked part added in place, B's product
    accumulated into the output); output and the gradients of x, A and B equal the general path's
    (base layer, then ``masked_linear`` and B's in-place product) on the same mask."""
    _cpu_lib_or_skip(8)
    taken = []
    real = fused_mod.masked_lora_linear
    monkeypatch.setattr(fused_mod, "masked_lora_linear", lambda *a: taken.append(1) or real(*a))

    def run():
        torch.manual_seed(0)
        layer = LoRALinear(nn.Linear(40, 24, bias=bias), 8, 16, dropout=0.2).train()
        layer.base_layer.requires_grad_(False)
        nn.init.normal_(layer.lora_B.weight)
        x = torch.randn(*shape, requires_grad=True)
        y = layer(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
        return y.detach(), x.grad, layer.lora_A.weight.grad, layer.lora_B.weight.grad

    got = run()
    assert len(taken) == 1
    monkeypatch.setattr(fused_mod, "masked_lora_linear", lambda *a: None)  # the layer's own two-node path
    want = run()
    for name, t, w in zip(("y", "dx", "dA", "dB"), got, want):
        torch.testing.assert_close(t, w, rtol=1e-5, atol=1e-5, msg=name)
