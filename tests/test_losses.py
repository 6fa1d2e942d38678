"""Token-weighted cross-entropy: shift convention, chunked == plain (value and gradients), peak memory."""

import weakref
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ftlib.losses import auto_chunk_size, chunked_cross_entropy, count_target_tokens, cross_entropy_sum


def make_case(seed, b, t, h, v, ignore_frac, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, h, generator=g, dtype=dtype) / h**0.5).requires_grad_()
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[torch.rand(b, t, generator=g) < ignore_frac] = -100
    return hidden, weight, labels


def test_shift_convention_labels_aligned_with_input_ids():
    """logits[:, t] predict labels[:, t + 1]: logits that put all mass on the next label give ~0 loss."""
    labels = torch.tensor([[5, 1, 2, 3], [-100, 4, 0, -100]])
    logits = torch.full((2, 4, 6), -1e4)
    for b in range(2):
        for t in range(3):
            if labels[b, t + 1] != -100:
                logits[b, t, labels[b, t + 1]] = 1e4
    loss, n = cross_entropy_sum(logits, labels)
    assert float(loss) == 0.0 and int(n) == 5 and int(count_target_tokens(labels)) == 5
    # the same logits scored against unshifted labels are badly wrong
    assert float(F.cross_entropy(logits.reshape(-1, 6), labels.reshape(-1), ignore_index=-100)) > 1e3


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 3), st.integers(1, 9), st.integers(1, 6), st.integers(2, 13),
       st.integers(1, 7), st.sampled_from([0.0, 0.3, 1.0]), st.booleans())
def test_chunked_equals_plain_value_and_grads(seed, b, t, h, v, chunk, ignore_frac, vocab_major):
    """Invariant: chunked_cross_entropy == cross_entropy_sum(hidden @ W.T) in loss, count and the
    gradients w.r.t. hidden and W, for any chunk size and either block layout ((V, C) on CPU,
    (C, V) on accelerators) (float64, tight)."""
    hidden, weight, labels = make_case(seed, b, t, h, v, ignore_frac)
    with mock.patch("ftlib.losses._vocab_major", lambda device_type, dtype: vocab_major):
        loss, n = chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk)
    gh, gw = torch.autograd.grad(loss * 1.7, (hidden, weight), allow_unused=True)
    ref, n_ref = cross_entropy_sum(hidden @ weight.t(), labels)
    rh, rw = torch.autograd.grad(ref * 1.7, (hidden, weight), allow_unused=True)
    assert int(n) == int(n_ref)
    torch.testing.assert_close(loss.double(), ref.double(), rtol=1e-6, atol=1e-6)
    zero = lambda x, like: torch.zeros_like(like) if x is None else x
    torch.testing.assert_close(zero(gh, hidden), zero(rh, hidden), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(zero(gw, weight), zero(rw, weight), rtol=1e-6, atol=1e-9)


def test_chunked_fp32_and_frozen_head():
    hidden, weight, labels = make_case(0, 2, 11, 8, 17, 0.2, dtype=torch.float32)
    weight.requires_grad_(False)  # a LoRA run: the head is frozen
    loss, _ = chunked_cross_entropy(hidden, weight, labels, chunk_size=4)
    (gh,) = torch.autograd.grad(loss, hidden)
    ref, _ = cross_entropy_sum(hidden @ weight.t(), labels)
    (rh,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, rh, rtol=1e-4, atol=1e-6)


def test_chunked_never_saves_full_logits():
    """Invariant: nothing saved for backward is as large as the [N, V] logits (N target tokens)."""
    b, t, h, v, chunk = 2, 33, 4, 50, 8
    hidden, weight, labels = make_case(1, b, t, h, v, 0.0, dtype=torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        loss, n = chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk)
    assert saved and max(saved) < int(n) * v
    loss.backward()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_under_bf16_autocast_matches_plain_in_value_and_gradients(seed):
    """Under bf16 autocast the loss equals plain cross-entropy on autocast logits to fp32 summation
    order (measured ~1e-7); the hidden gradient equals the autocast reference's (both round the same
    fp32 dL/dz to bf16 before the same bf16 matmul; measured equal) and scales linearly with the
    upstream gradient; the head gradient equals a float64 evaluation of softmax - onehot on the same
    bf16 operands (ftlib accumulates it in fp32, measured ~1.5e-7; the autocast reference rounds it
    to bf16, ~3e-3 off)."""
    hidden, weight, labels = make_case(seed, 2, 33, 64, 512, 0.1, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = chunked_cross_entropy(hidden, weight, labels, chunk_size=7)
        ref, _ = cross_entropy_sum(F.linear(hidden, weight), labels)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    gh, gw = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    rh, _ = torch.autograd.grad(ref, (hidden, weight))
    assert gh.dtype == torch.float32 and gw.dtype == torch.float32
    torch.testing.assert_close(gh, rh, rtol=0, atol=1e-4 * float(rh.abs().max()))
    gh2, gw2 = torch.autograd.grad(loss * 0.75, (hidden, weight))
    torch.testing.assert_close(gh2, 0.75 * gh, rtol=1e-6, atol=0)
    torch.testing.assert_close(gw2, 0.75 * gw, rtol=1e-6, atol=0)
    hb, wb = hidden.detach().bfloat16(), weight.detach().bfloat16()
    y = labels[:, 1:]
    keep = y != -100
    z = (hb @ wb.t()).double()[:, :-1][keep]  # the bf16 matmul's logits of the target tokens
    dz = torch.softmax(z, dim=-1)
    dz[torch.arange(len(dz)), y[keep]] -= 1.0
    gw64 = dz.t() @ hb[:, :-1][keep].double()
    torch.testing.assert_close(gw.double(), gw64, rtol=0, atol=1e-6 * float(gw64.abs().max()))


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created while active (views of earlier tensors are not new)."""

    def __init__(self, existing=()):
        super().__init__()
        self.refs: dict[int, list] = {}
        self.known = {t.untyped_storage().data_ptr() for t in existing}
        self.now = self.peak = 0

    def _drop(self, key):
        entry = self.refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key in self.known:
                    continue
                if key not in self.refs:
                    self.refs[key] = [st.nbytes(), 0]
                    self.now += st.nbytes()
                    self.peak = max(self.peak, self.now)
                self.refs[key][1] += 1
                weakref.finalize(t, self._drop, key)
        return out


@pytest.mark.parametrize("trainable_head", [False, True])
@pytest.mark.parametrize("bf16", [False, True])
def test_chunked_peak_memory_is_one_block(trainable_head, bf16):
    """Measured peak of forward + backward: one [chunk, V] fp32 block (1.5 under bf16 autocast: the
    bf16 matmul output and its fp32 copy), plus what any implementation keeps (the head gradient
    accumulator, the bf16 head copy, O(N H) vectors). The earlier version held ~4 blocks."""
    n, h, v, chunk = 256, 8, 4096, 32
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, n + 1, h, generator=g, requires_grad=True)
    weight = (torch.randn(v, h, generator=g) / 3).requires_grad_(trainable_head)
    labels = torch.randint(0, v, (1, n + 1), generator=g)
    with _LiveBytes(existing=(hidden, weight, labels)) as mem:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk)
        loss.backward()
    block = chunk * v * 4
    extras = (v * h * 4 if trainable_head else 0) + (v * h * 2 if bf16 else 0) + 8 * n * h * 4 + (16 << 10)
    assert mem.peak <= (1.5 if bf16 else 1.0) * block + extras, f"peak {mem.peak / block:.2f} blocks"
    assert hidden.grad is not None and (weight.grad is not None) == trainable_head


def test_auto_chunk_size_follows_the_vocabulary():
    """~64 MiB fp32 blocks: one chunk of 2048 rows at V = 8k (plain CE with a fused gradient), 128 at 128k;
    ~512 MiB on CPU (1024 rows at 128k)."""
    assert auto_chunk_size(8192) == 2048 and auto_chunk_size(128_256) == 128 and auto_chunk_size(32) == 8192
    assert auto_chunk_size(128_256, "cpu") == 1024 and auto_chunk_size(8192, "cpu") == 8192
    assert auto_chunk_size(256_000, "cpu") == 512 and auto_chunk_size(128_256, "cuda") == 128
    hidden, weight, labels = make_case(5, 2, 9, 4, 11, 0.2)
    a, _ = chunked_cross_entropy(hidden, weight, labels)
    b, _ = chunked_cross_entropy(hidden, weight, labels, chunk_size=3)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_no_gradient_work_without_grad_mode():
    """Under no_grad (evaluation) the loss computes no gradient: only the logits' matmul runs."""
    from torch.utils._python_dispatch import TorchDispatchMode as Mode

    hidden, weight, labels = make_case(6, 2, 9, 8, 13, 0.0, dtype=torch.float32)

    class CountMM(Mode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountMM.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm_.default,
                                  torch.ops.mkldnn._linear_pointwise.default)  # the logits on oneDNN
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), CountMM():
        chunked_cross_entropy(hidden, weight, labels, chunk_size=4)  # 16 targets: 4 chunks
    assert CountMM.n == 4
    CountMM.n = 0
    with CountMM():
        chunked_cross_entropy(hidden, weight, labels, chunk_size=4)
    assert CountMM.n == 12  # logits, dL/dh and dL/dW per chunk


def test_all_labels_ignored_gives_zero():
    hidden, weight, labels = make_case(3, 2, 5, 4, 7, 1.0)
    loss, n = chunked_cross_entropy(hidden, weight, labels)
    loss.backward()
    assert float(loss.detach()) == 0.0 and int(n) == 0 and float(hidden.grad.abs().sum()) == 0.0


def test_bad_loss_input_raises():
    hidden, weight, labels = make_case(4, 2, 5, 4, 7, 0.0)
    with pytest.raises(ValueError, match="labels must be"):
        cross_entropy_sum(torch.zeros(2, 6, 7), labels)
    with pytest.raises(ValueError, match="lm_head_weight"):
        chunked_cross_entropy(hidden, weight.t(), labels)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_cross_entropy(hidden, weight, labels, chunk_size=0)
    bad = labels.clone()
    bad[0, 2] = 7
    with pytest.raises(ValueError, match=r"labels must be in \[0, 7\)"):
        chunked_cross_entropy(hidden, weight, bad)
    with pytest.raises(TypeError, match="int64"):
        cross_entropy_sum(torch.zeros(2, 5, 7), labels.float())


def test_chunked_converts_the_head_weight_once_per_pass():
    """Invariant (memory/time at V = 128k): when the matmul dtype differs from the head's dtype the
    [V, H] weight is converted once per forward and once per backward, not once per chunk."""
    from torch.utils._python_dispatch import TorchDispatchMode

    hidden, weight, labels = make_case(0, 2, 9, 8, 13, 0.0, dtype=torch.float32)
    head = weight.detach().to(torch.bfloat16).requires_grad_()  # fp32 hidden x bf16 head -> fp32 matmuls

    class CountWeightCopies(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == tuple(head.shape):
                CountWeightCopies.n += 1
            return func(*args, **(kwargs or {}))

    with CountWeightCopies():
        loss, _ = chunked_cross_entropy(hidden, head, labels, chunk_size=3)  # 16 targets: 6 chunks
    assert CountWeightCopies.n == 1
    CountWeightCopies.n = 0
    with CountWeightCopies():
        loss.backward()
    assert CountWeightCopies.n <= 2  # the matmul copy and the final fp32 -> bf16 cast of grad_w
    assert head.grad is not None and hidden.grad is not None


def test_causal_lm_loss_module_is_the_summed_shifted_cross_entropy_of_the_model():
    import ftlib.evaluation
    from ftlib.losses import CausalLMLoss
    from ftlib.models import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).double()
    ids = torch.randint(0, 61, (2, 11))
    labels = ids.clone()
    labels[0, :4] = -100
    batch = {"input_ids": ids, "labels": labels}
    loss, n = CausalLMLoss(model)(batch)
    want = F.cross_entropy(model(ids)[:, :-1].reshape(-1, 61), labels[:, 1:].reshape(-1), reduction="sum")
    torch.testing.assert_close(loss, want)
    assert int(n) == int((labels[:, 1:] != -100).sum())
    assert not hasattr(ftlib.evaluation, "causal_lm_loss")  # one home: ftlib.losses
    loss.backward()
    assert model.lm_head.weight.grad is not None  # gradients flow through the module (what DDP / FSDP2 wrap)
