"""``xent_block_``: the fused CPU softmax step of the chunked cross-entropy against float64 (log-sum-exp
and softmax - onehot on odd block shapes and row strides), NaN kept, labels checked, and the
chunked loss of an fp32 head through it against float64 ``F.cross_entropy``."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.kernels import xent_block_, xent_block_backend
from ftlib.losses import chunked_cross_entropy


def _cpp_or_skip():
    if xent_block_backend(torch.zeros(4, 2)) != "cpu":
        pytest.skip("ftlib/cpu/csrc/xent_block.cpp needs a C++ compiler and an AVX2 + FMA CPU")


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.integers(1, 40), st.integers(0, 17), st.floats(0.1, 30.0), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_block_matches_float64(v, c, pad, spread, grad, seed):
    """Invariant: lse[c] = logsumexp_v z[v, c]; with grad, z = softmax(z, 0) - onehot(y) in place; the
    padding columns of the row stride are not touched; without grad z is not touched."""
    _cpp_or_skip()
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(v, c + pad, generator=gen) * spread
    z = full[:, :c]
    y = torch.randint(0, v, (c,), generator=gen)
    z64, before = z.double().clone(), full.clone()
    assert xent_block_backend(z) == "cpu"
    lse = xent_block_(z, y, grad)
    torch.testing.assert_close(lse.double(), torch.logsumexp(z64, 0), rtol=2e-6, atol=2e-6)
    want = torch.softmax(z64, 0)
    want[y, torch.arange(c)] -= 1.0
    if grad:
        torch.testing.assert_close(z.double(), want, rtol=1e-5, atol=2e-6)
    else:
        assert torch.equal(full[:, :c], before[:, :c])
    assert torch.equal(full[:, c:], before[:, c:])


def test_rows_split_over_threads_merge_maxima_and_sums(monkeypatch):
    """Rows split into 3 ranges (each with its own running maxima and sums, merged at the end) give
    the one-range result to fp32 rounding."""
    _cpp_or_skip()
    mod = importlib.import_module("ftlib.cpu.xent_block")
    z = torch.randn(1000, 9) * 4
    z[900:, 2] += 30.0  # the column's maximum in the last range only
    y = torch.randint(0, 1000, (9,))
    one = z.clone()
    lse1 = xent_block_(one, y, True)
    monkeypatch.setattr(mod, "threads", lambda name, n: 3)
    three = z.clone()
    lse3 = xent_block_(three, y, True)
    torch.testing.assert_close(lse3, lse1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(three, one, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(lse3.double(), torch.logsumexp(z.double(), 0), rtol=1e-6, atol=1e-6)


def test_nan_logit_gives_nan_loss_and_column():
    _cpp_or_skip()
    z = torch.randn(100, 9)
    z[40, 3] = float("nan")
    lse = xent_block_(z, torch.zeros(9, dtype=torch.int64), True)
    assert lse[3].isnan() and z[:, 3].isnan().all()
    assert not lse[[0, 1, 2, 4, 5, 6, 7, 8]].isnan().any()


def test_labels_are_checked():
    z = torch.randn(10, 3)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\)"):
        xent_block_(z, torch.tensor([0, 10, 2]), True)
    with pytest.raises(ValueError, match="y must be"):
        xent_block_(z, torch.tensor([0, 1]), True)


@pytest.mark.parametrize("vocab,chunk", [(1000, None), (517, 7), (4099, 64)])
def test_chunked_loss_through_the_kernel_matches_float64(monkeypatch, vocab, chunk):
    """The chunked loss of an fp32 head on CPU (the (V, C) block, the fused softmax step) against
    float64 F.cross_entropy: loss and the gradients of the hidden states and the head; and equal to
    the PyTorch ops' path (FTLIB_XENT_BACKEND=torch) to fp32 rounding."""
    _cpp_or_skip()
    g = torch.Generator().manual_seed(vocab)
    h = torch.randn(2, 37, 24, generator=g).requires_grad_()
    w = (torch.randn(vocab, 24, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, vocab, (2, 37), generator=g)
    labels[0, :5] = -100
    out = {}
    for backend in ("auto", "torch"):
        monkeypatch.setenv("FTLIB_XENT_BACKEND", backend)
        loss, n = chunked_cross_entropy(h, w, labels, chunk_size=chunk)
        out[backend] = (loss, *torch.autograd.grad(loss, (h, w)))
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logits = (h64[:, :-1] @ w64.t()).reshape(-1, vocab)
    ref = F.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
    want = (ref, *torch.autograd.grad(ref, (h64, w64)))
    assert int(n) == int((labels[:, 1:] != -100).sum())
    for got, exp in zip(out["auto"], want):
        torch.testing.assert_close(got.double(), exp, rtol=2e-5, atol=2e-5 * float(exp.detach().abs().max()))
    for a, b in zip(out["auto"], out["torch"]):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5 * float(b.detach().abs().max()))


def test_float_labels_are_refused():
    """Labels index the block's rows: float labels (truncated before) are refused naming the dtype."""
    from ftlib.kernels.xent_block import xent_block_

    with pytest.raises(ValueError, match="integer.*float32"):
        xent_block_(torch.randn(5, 3), torch.tensor([1.5, 2.2, 0.0]), False)
