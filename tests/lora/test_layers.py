"""LoRALinear: exact init, rsLoRA scaling, DoRA against the paper's formula in float64, merge/unmerge, autocast."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from ftlib.lora import LoRALinear, NF4Linear, dora_row_norm, dora_row_norm_direct


def _randomize(layer: LoRALinear, seed: int = 0) -> LoRALinear:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.3)
        if layer.use_dora:
            layer.lora_magnitude_vector.mul_(1 + 0.2 * torch.rand(layer.out_features, generator=g))
    return layer


@pytest.mark.parametrize("use_dora", [False, True])
@pytest.mark.parametrize("use_rslora", [False, True])
@pytest.mark.parametrize("init", ["kaiming", "gaussian"])
@pytest.mark.parametrize("bias", [False, True])
def test_init_output_equals_base_exactly(use_dora, use_rslora, init, bias):
    torch.manual_seed(0)
    base = nn.Linear(20, 12, bias=bias)
    x = torch.randn(3, 5, 20)
    ref = base(x)
    layer = LoRALinear(base, 4, 8, use_rslora=use_rslora, use_dora=use_dora, init=init)
    assert torch.equal(layer(x), ref)
    assert torch.all(layer.lora_A.weight != 0) and torch.all(layer.lora_B.weight == 0)


def test_init_output_equals_base_exactly_nf4():
    torch.manual_seed(0)
    base = NF4Linear.from_linear(nn.Linear(64, 16))
    x = torch.randn(4, 64)
    ref = base(x)
    for dora in (False, True):
        assert torch.equal(LoRALinear(base, 2, 4, use_dora=dora)(x), ref)


def test_scaling_and_update():
    torch.manual_seed(0)
    base = nn.Linear(10, 6)
    for rs, s in ((False, 16 / 4), (True, 16 / math.sqrt(4))):
        layer = _randomize(LoRALinear(base, 4, 16, use_rslora=rs))
        assert layer.scaling == pytest.approx(s)
        x = torch.randn(7, 10)
        expected = base(x) + s * x @ layer.lora_A.weight.t() @ layer.lora_B.weight.t()
        assert torch.allclose(layer(x), expected, atol=1e-6)


def _dora_ref64(x, w, b, A, B, m, s):
    """Paper formula (eq. 5 with the norm detached, section 4.3), float64."""
    full = w + s * B @ A  # (out, in)
    norm = torch.linalg.vector_norm(full, dim=1).detach()
    y = x @ ((m / norm).unsqueeze(1) * full).t()
    return y + b if b is not None else y


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_dora_forward_and_grads_match_float64_paper_formula(bias, use_rslora):
    torch.manual_seed(0)
    base = nn.Linear(23, 11, bias=bias)
    layer = _randomize(LoRALinear(base, 3, 6, use_dora=True, use_rslora=use_rslora))
    with torch.no_grad():
        layer.lora_A.weight.mul_(3)
    x = torch.randn(2, 5, 23, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)

    d = lambda t: t.detach().double().requires_grad_(True)
    x64, A64, B64, m64 = d(x), d(layer.lora_A.weight), d(layer.lora_B.weight), d(layer.lora_magnitude_vector)
    b64 = base.bias.detach().double() if bias else None
    y64 = _dora_ref64(x64, base.weight.detach().double(), b64, A64, B64, m64, layer.scaling)
    y64.backward(g.double())
    tol = dict(rtol=1e-5, atol=1e-5)
    assert torch.allclose(y.double(), y64, **tol), (y.double() - y64).abs().max()
    for got, want, name in ((x.grad, x64.grad, "x"), (layer.lora_A.weight.grad, A64.grad, "A"),
                            (layer.lora_B.weight.grad, B64.grad, "B"), (layer.lora_magnitude_vector.grad, m64.grad, "m")):
        assert torch.allclose(got.double(), want, **tol), f"grad {name}: max diff {(got.double() - want).abs().max()}"
    assert base.weight.grad is None and (not bias or base.bias.grad is None)


class _FixedMask(nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, x):
        return x * self.mask


def test_dora_with_dropout_matches_peft_form():
    # y = W x + b + (m/n - 1) W drop(x) + (m/n) s B A drop(x)
    torch.manual_seed(0)
    base = nn.Linear(9, 5)
    layer = _randomize(LoRALinear(base, 2, 4, dropout=0.5, use_dora=True)).train()
    x = torch.randn(3, 9)
    mask = (torch.rand(3, 9) > 0.5).float() * 2
    layer.lora_dropout = _FixedMask(mask)
    w, A, B, m, s = base.weight.double(), layer.lora_A.weight.double(), layer.lora_B.weight.double(), \
        layer.lora_magnitude_vector.double(), layer.scaling
    n = torch.linalg.vector_norm(w + s * B @ A, dim=1)
    h = x.double() * mask.double()
    want = x.double() @ w.t() + base.bias.double() + (m / n - 1) * (h @ w.t()) + (m / n) * s * (h @ A.t() @ B.t())
    assert torch.allclose(layer(x).double(), want, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(out_f=st.integers(1, 12), in_f=st.integers(1, 12), r=st.integers(1, 5),
       s=st.floats(0.01, 10.0), seed=st.integers(0, 2**16))
def test_efficient_dora_norm_equals_direct(out_f, in_f, r, s, seed):
    # invariant: ||W||^2 + 2s<W, BA> + s^2 ||BA||^2 row-wise == ||W + sBA||^2 row-wise
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g)
    A = torch.randn(r, in_f, generator=g)
    B = torch.randn(out_f, r, generator=g) * 0.3
    fast = dora_row_norm(lambda a: a @ w.t(), w.pow(2).sum(1), A, B, s)
    want = torch.linalg.vector_norm(w.double() + s * B.double() @ A.double(), dim=1)
    assert torch.allclose(fast.double(), want, rtol=1e-4, atol=1e-5 * (1 + s))
    assert torch.allclose(dora_row_norm_direct(w, A, B, s).double(), want, rtol=1e-5, atol=1e-6)


def test_dora_norm_cache_follows_base_weight():
    torch.manual_seed(0)
    base = nn.Linear(8, 4)
    layer = _randomize(LoRALinear(base, 2, 2, use_dora=True))
    n0 = layer.weight_norm()
    with torch.no_grad():
        base.weight.mul_(2)
    n1 = layer.weight_norm()
    want = dora_row_norm_direct(base.weight, layer.lora_A.weight, layer.lora_B.weight, layer.scaling)
    assert not torch.allclose(n0, n1) and torch.allclose(n1, want, rtol=1e-5)


@pytest.mark.parametrize("use_dora", [False, True])
def test_merge_unmerge_exact(use_dora):
    torch.manual_seed(0)
    base = nn.Linear(31, 17)
    w0 = base.weight.detach().clone()
    layer = _randomize(LoRALinear(base, 4, 8, use_dora=use_dora)).eval()
    x = torch.randn(6, 31)
    y = layer(x)
    layer.merge()
    assert layer.merged and not torch.equal(base.weight, w0)
    assert torch.allclose(layer(x), y, atol=1e-5, rtol=0)
    layer.unmerge()
    assert torch.allclose(base.weight, w0, atol=1e-6, rtol=1e-6)
    assert torch.allclose(layer(x), y, atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="not merged"):
        layer.unmerge()


def test_to_linear_matches_forward():
    torch.manual_seed(0)
    for base in (nn.Linear(64, 8), NF4Linear.from_linear(nn.Linear(64, 8), double_quant=True)):
        layer = _randomize(LoRALinear(base, 2, 4, use_dora=True)).eval()
        x = torch.randn(5, 64)
        lin = layer.to_linear(torch.float32)
        assert type(lin) is nn.Linear
        assert torch.allclose(lin(x), layer(x), atol=1e-5)


def test_nf4_base_refuses_in_place_merge():
    layer = LoRALinear(NF4Linear.from_linear(nn.Linear(64, 8)), 2, 4)
    with pytest.raises(RuntimeError, match="merge_and_unload"):
        layer.merge()


@pytest.mark.parametrize("use_dora", [False, True])
@pytest.mark.parametrize("quantized", [False, True])
def test_autocast_bf16_with_fp32_adapters(use_dora, quantized):
    torch.manual_seed(0)
    lin = nn.Linear(64, 16).to(torch.bfloat16)
    base = NF4Linear.from_linear(lin) if quantized else lin
    layer = _randomize(LoRALinear(base, 4, 8, use_dora=use_dora))
    assert layer.lora_A.weight.dtype == torch.float32
    x = torch.randn(3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().pow(2).sum().backward()
    assert layer.lora_A.weight.grad.dtype == torch.float32 and layer.lora_B.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in layer.base_layer.parameters())
    # against the same computation in fp32 (bf16 tolerance)
    ref_base = nn.Linear(64, 16)
    with torch.no_grad():
        ref_base.weight.copy_(layer.base_weight(torch.float32))
        ref_base.bias.copy_(lin.bias.float())
    ref = LoRALinear(ref_base, 4, 8, use_dora=use_dora)
    ref.load_state_dict({k: v.float() for k, v in layer.state_dict().items() if "lora" in k}, strict=False)
    assert torch.allclose(y.float(), ref(x), atol=0.05, rtol=0.05)
    # no autocast: bf16 input, fp32 adapter path, bf16 output
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive integer"):
        LoRALinear(nn.Linear(4, 4), 0, 1)
    with pytest.raises(ValueError, match="alpha"):
        LoRALinear(nn.Linear(4, 4), 2, 0)
    with pytest.raises(TypeError, match="nn.Linear"):
        LoRALinear(nn.Conv1d(4, 4, 1), 2, 1)
    with pytest.raises(ValueError, match="init"):
        LoRALinear(nn.Linear(4, 4), 2, 1, init="orthogonal")


def test_dora_under_inference_mode(monkeypatch):
    """A fresh DoRA layer (m = ||W||, B = 0) adds exactly nothing: bitwise equal to the base with the
    same GEMM (torch's), and to fp32 rounding on the default CPU backend (oneDNN's GEMM)."""
    torch.manual_seed(0)
    x = torch.randn(3, 16)
    with torch.inference_mode():  # weights made here are inference tensors (no version counter)
        base = nn.Linear(16, 8)
        layer = LoRALinear(base, 2, 4, use_dora=True)
        torch.testing.assert_close(layer(x), base(x), rtol=1e-6, atol=1e-6)
        monkeypatch.setenv("FTLIB_LINEAR_BACKEND", "torch")
        assert torch.equal(layer(x), base(x))


@settings(max_examples=20, deadline=None)
@given(out_f=st.integers(1, 24), in_f=st.integers(1, 24), r=st.integers(1, 6), use_dora=st.booleans(),
       use_rslora=st.booleans(), seed=st.integers(0, 2**16))
@example(out_f=4, in_f=1, r=6, use_dora=True, use_rslora=True, seed=1)  # row 0: m/n ~ 128, W + sBA cancels
def test_merge_unmerge_property(out_f, in_f, r, use_dora, use_rslora, seed):
    # invariants: forward(merged) == forward(unmerged); unmerge(merge(W)) == W (fp32 rounding)
    torch.manual_seed(seed)
    base = nn.Linear(in_f, out_f)
    w0 = base.weight.detach().clone()
    layer = _randomize(LoRALinear(base, r, 2 * r, use_dora=use_dora, use_rslora=use_rslora), seed).eval()
    x = torch.randn(3, in_f)
    y = layer(x)
    # fp32 rounding is relative to the terms summed, not to the result: DoRA scales a row by m/n, and a
    # row whose update nearly cancels W (n << ||W||) sums terms ~ (m/n) |W| |x| to a much smaller output.
    with torch.no_grad():
        mag = layer.lora_magnitude_vector / layer.weight_norm() if use_dora else torch.ones(out_f)
        a_abs, b_abs = layer.lora_A.weight.abs(), layer.lora_B.weight.abs()
        terms = (x.abs() @ w0.abs().t()) * (mag.abs() + 1) + layer.scaling * mag.abs() * (x.abs() @ a_abs.t() @ b_abs.t())
        atol = 64 * torch.finfo(torch.float32).eps * (terms.max().item() + base.bias.abs().max().item())
    layer.merge()
    torch.testing.assert_close(layer(x), y, atol=atol, rtol=0)
    layer.unmerge()
    torch.testing.assert_close(base.weight, w0, atol=1e-6, rtol=1e-5)


def test_dora_norm_exact_when_update_nearly_cancels_the_base_row():
    """Invariant: weight_norm equals the directly materialised fp32 norm (what merge uses) even
    when rows of W + sBA are ~1e-4 of ||W||, where the expanded square alone loses every digit
    (its error is ~eps * ||W||^2 / ||W + sBA||^2 ~ 6 in relative terms)."""
    torch.manual_seed(0)
    base = nn.Linear(16, 6, bias=False)
    layer = LoRALinear(base, 4, 8, use_dora=True)
    with torch.no_grad():
        layer.lora_B.weight.normal_()
        delta = layer.scaling * (layer.lora_B.weight @ layer.lora_A.weight)
        base.weight.copy_(-delta + 1e-4 * torch.randn_like(delta))
    want = torch.linalg.vector_norm(base.weight.double() + layer.scaling * (
        layer.lora_B.weight.double() @ layer.lora_A.weight.double()), dim=1)
    got = layer.weight_norm()
    direct = dora_row_norm_direct(base.weight, layer.lora_A.weight, layer.lora_B.weight, layer.scaling)
    torch.testing.assert_close(got, direct, rtol=1e-6, atol=0)
    # fp32 itself conditions W + sBA to ~eps * |W| / |W + sBA| ~ 1e-3 relative here.
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=0)
