"""The linear family on the CPU wing's oneDNN products: ``linear_nograd`` / ``linear_input_grad`` / ``linear``
(``ftlib.kernels.linear`` over ``ftlib.cpu.linear``: oneDNN's fp32 GEMM for frozen weights
on CPU) against float64, the backend choice, and their use by the LoRA layer and the chunked loss."""


import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from ftlib.kernels import linear, linear_backend, linear_input_grad, linear_nograd
from ftlib.lora import LoRALinear
from ftlib.losses import chunked_cross_entropy

ONEDNN = linear_backend(torch.zeros(1, 1), torch.zeros(1, 1)) == "cpu"
needs_onednn = pytest.mark.skipif(not ONEDNN, reason="torch built without oneDNN")


class _Count(TorchDispatchMode):
    """Counts oneDNN linear calls."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.mkldnn._linear_pointwise.default
        return func(*args, **(kwargs or {}))


def _close(got, ref):
    """fp32 GEMM against float64: within 1e-5 of the largest output (K <= 300 terms)."""
    tol = 1e-5 * max(1.0, ref.abs().max().item())
    assert (got.double() - ref).abs().max().item() <= tol


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from([(5,), (2, 7), (1, 3, 4)]), st.integers(1, 300), st.integers(1, 70), st.booleans(),
       st.booleans(), st.integers(0, 1000))
def test_products_and_gradient_match_float64(lead, k, n, bias, strided, seed):
    """Invariant: linear_nograd(x, W, b) = x W^T + b and linear_input_grad(dy, W) = dy W to fp32
    rounding for 2-D and 3-D x (strided too), and linear's value and input gradient equal
    F.linear's; the output is a fresh tensor autograd lets the caller update in place."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, 2 * k if strided else k, generator=gen)
    x = x[..., ::2] if strided else x
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    _close(linear_nograd(x, w, b), ref)
    dy = torch.randn(*lead, n, generator=gen)
    _close(linear_input_grad(dy, w), dy.double() @ w.double())
    xg = x.detach().clone().requires_grad_()
    y = linear(xg, w, b)
    assert not y._is_view()
    y.add_(1.0)  # an in-place update of the output (LoRA adds its B product so)
    (dx,) = torch.autograd.grad(y, xg, dy)
    _close(dx, dy.double() @ w.double())


@needs_onednn
def test_backend_choice(monkeypatch):
    """oneDNN for plain fp32 CPU tensors; torch's ops for fp64, 1-D inputs, autocast, a tensor
    subclass (DTensor and friends), under compile, and with FTLIB_LINEAR_BACKEND=torch;
    linear leaves a weight that trains to F.linear (its gradient flows)."""
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    assert linear_backend(x, w) == "cpu"
    assert linear_backend(x.double(), w.double()) == "torch"
    assert linear_backend(x[0], w) == "torch"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear_backend(x, w) == "torch"

    class Sub(torch.Tensor):
        pass

    assert linear_backend(x.as_subclass(Sub), w) == "torch"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert linear_backend(x, w) == "torch"
    monkeypatch.undo()
    wt = w.clone().requires_grad_()
    with _Count() as c:
        linear(x, wt).sum().backward()
    assert c.n == 0 and wt.grad is not None
    with _Count() as c:
        linear(x.requires_grad_(), w).sum().backward()
    assert c.n == 2  # the product and its input gradient
    monkeypatch.setenv("FTLIB_LINEAR_BACKEND", "torch")
    assert linear_backend(x, w) == "torch"
    monkeypatch.setenv("FTLIB_LINEAR_BACKEND", "cpu")
    assert linear_backend(x, w) == "cpu"
    with pytest.raises(RuntimeError, match="FTLIB_LINEAR_BACKEND=cpu cannot run this call: .*fp32"):
        linear_backend(x.double(), w.double())
    with pytest.raises(RuntimeError, match="FTLIB_LINEAR_BACKEND=cpu cannot run this call: .*takes a gradient"):
        linear(x, wt)  # forced: a weight that trains is refused, not quietly run on F.linear
    monkeypatch.setenv("FTLIB_LINEAR_BACKEND", "mkl")
    with pytest.raises(ValueError, match=r"FTLIB_LINEAR_BACKEND='mkl': expected one of auto\|cpu\|torch"):
        linear_backend(x, w)


@needs_onednn
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_layer_base_runs_on_onednn_and_matches_torch(monkeypatch, dropout):
    """Both LoRA paths on CPU (the general one, and the one-node layer with dropout) run the frozen
    base's product and input gradient on oneDNN, and give the output and gradients of torch's GEMMs
    to fp32 rounding (same dropout mask: same seed)."""
    torch.manual_seed(0)
    layer = LoRALinear(torch.nn.Linear(24, 40), 8, 16, dropout=dropout)
    torch.nn.init.normal_(layer.lora_B.weight)
    layer.base_layer.requires_grad_(False)
    x = torch.randn(2, 5, 24)
    runs = {}
    for backend in ("auto", "torch"):
        monkeypatch.setenv("FTLIB_LINEAR_BACKEND", backend)
        layer.zero_grad()
        xg = x.clone().requires_grad_()
        torch.manual_seed(1)
        with _Count() as c:
            y = layer(xg)
            y.square().sum().backward()
        runs[backend] = (y.detach(), xg.grad, layer.lora_A.weight.grad.clone(), layer.lora_B.weight.grad.clone())
        assert (c.n == 2) == (backend == "auto"), (backend, c.n)
    for a, b in zip(runs["auto"], runs["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_chunked_loss_logits_on_onednn_match_float64():
    """The chunked loss's (V, C) logits block runs on oneDNN; loss and hidden gradient equal float64
    cross-entropy."""
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(2, 9, 16, generator=gen).requires_grad_()
    w = torch.randn(50, 16, generator=gen)
    y = torch.randint(0, 50, (2, 9), generator=gen)
    with _Count() as c:
        loss, n = chunked_cross_entropy(h, w, y, chunk_size=5)
    assert c.n == 4  # 16 targets, 4 chunks
    (g,) = torch.autograd.grad(loss, h)
    h64 = h.detach().double().requires_grad_()
    ref = F.cross_entropy((h64 @ w.double().t())[:, :-1].reshape(-1, 50), y[:, 1:].reshape(-1), reduction="sum")
    (g64,) = torch.autograd.grad(ref, h64)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(g.double(), g64, rtol=1e-5, atol=1e-6)


@needs_onednn
def test_llama_lora_bases_run_on_onednn_and_plain_projections_on_f_linear(monkeypatch):
    """ftlib's Llama calls its projections plainly: a plain ``nn.Linear`` runs F.linear (training every
    weight, or under no_grad), and the frozen base of each LoRA layer (q/v here) runs its product and
    input gradient on oneDNN through the LoRA family's CPU path; loss and adapter gradients equal
    torch's GEMMs' to fp32 rounding."""
    from ftlib.lora import LoRAConfig, apply_lora
    from ftlib.models import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with _Count() as c:
        model(ids).sum().backward()
    assert c.n == 0  # every weight trains: F.linear
    with torch.no_grad(), _Count() as c:
        model(ids)
    assert c.n == 0  # plain modules, plain F.linear
    apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"], dropout=0.0), verbose=False)
    for p in model.parameters():
        p.grad = None
    runs = {}
    for backend in ("auto", "torch"):
        monkeypatch.setenv("FTLIB_LINEAR_BACKEND", backend)
        with _Count() as c:
            loss = model(ids).float().logsumexp(-1).mean()
            loss.backward()
        runs[backend] = (loss.detach(), *(p.grad.clone() for n, p in model.named_parameters() if "lora_" in n))
        for p in model.parameters():
            p.grad = None
        # (q, v) x 2 layers products, and the input gradients of the second layer's (the first one's input,
        # the frozen embedding's normalised output, takes none)
        assert c.n == (4 + 2 if backend == "auto" else 0)
    for a, b in zip(runs["auto"], runs["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("layout", ["stride 2", "stride 0 (expanded)"])
def test_strided_or_expanded_bias_gives_f_linears_values(layout):
    """A bias that is a strided view or an expanded scalar (stride 0) is read by its strides: linear_nograd,
    linear and a LoRA layer's frozen base equal F.linear (the GEMM read it as contiguous: error 4.5 with stride
    2, 4.9e30 with stride 0, an out-of-bounds read)."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 3, 16, generator=gen), torch.randn(6, 16, generator=gen)
    b = torch.randn(12, generator=gen)[::2] if layout == "stride 2" else torch.randn(1, generator=gen).expand(6)
    ref = F.linear(x.double(), w.double(), b.double())
    _close(linear_nograd(x, w, b), ref)
    _close(linear(x, w, b), ref)
    layer = torch.nn.Linear(16, 6).requires_grad_(False)
    layer.weight.data, layer.bias.data = w, b
    assert layer.bias.stride() == b.stride()
    _close(LoRALinear(layer, 8, 16)(x), ref)  # B = 0: the base's output


def test_a_broadcast_bias_of_another_shape_runs_as_f_linear():
    """A bias F.linear broadcasts ([1, out]) is not what oneDNN reads: the PyTorch product runs."""
    gen = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(4, 8, generator=gen), torch.randn(6, 8, generator=gen), torch.randn(1, 6, generator=gen)
    ref = F.linear(x.double(), w.double(), b.double())
    _close(linear_nograd(x, w, b), ref)
    _close(linear(x, w, b), ref)
