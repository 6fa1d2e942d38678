"""Host reads in one training step of the GPU code path: none per layer, few per step.

On CUDA every read of a device value to the host (``.item()``, ``float(t)``, ``.tolist()``, ``.cpu()``,
``nonzero`` and other ops whose output size depends on the data) waits for the queued kernels.
One LoRA step (packed batch, Triton attention and LoRA kernels in the interpreter, chunked loss,
global-norm clipping, AdamW) is counted with a ``TorchDispatchMode`` (the aten ops) and wrappers of
the Python-level reads (``tolist``/``cpu``/``numpy``, which a CPU tensor serves without an aten op),
leaving out what Triton's interpreter does itself. The SDPA fallback (``FTLIB_ATTN_BACKEND=sdpa``,
the per-document loop CUDA takes without Triton) is counted too. The count of a 2-layer model minus a 1-layer
one is the per-layer count: 0. The rest: one read per micro-batch in the loss (its target count
and label check together) and two in ``TrainOptimizer.step`` (the window's totals before the
clipper, then the norm and the clipper's statistics), the loss itself read for logging left out.
"""

import collections
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernels need TRITON_INTERPRET=1 set before import (tests/conftest.py)",
                allow_module_level=True)

_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
             "unique_consecutive", "is_nonzero", "repeat_interleave", "equal"}
_PY_READS = ("tolist", "cpu", "numpy")


# Reads the GPU path never makes: branches taken only for tensors that live on the host (the
# Triton launcher checks a CPU cu_seqlens on the host, where reading it costs nothing; on CUDA the
# tensor is on the device and that branch is not taken; the optimizer reads a token count that
# chunked_cross_entropy returns on the host, on CUDA too)
_HOST_ONLY = {("attention_triton.py", "_validate"), ("optim.py", "_host_value")}


def _counted() -> bool:
    """Whether the read being made is the GPU path's: not Triton's interpreter, not a host-only branch."""
    f = sys._getframe(2)
    for _ in range(12):
        if f is None:
            return True
        if f.f_globals.get("__name__", "").startswith("triton"):  # the interpreter's own tensor handling
            return False
        if (os.path.basename(f.f_code.co_filename), f.f_code.co_name) in _HOST_ONLY:
            return False
        f = f.f_back
    return True


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS and _counted():
            if name != "repeat_interleave" or kwargs is None or kwargs.get("output_size") is None:
                self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def py_reads(monkeypatch):
    counts = collections.Counter()
    for name in _PY_READS:
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, _name=name, **k):
            if _counted():
                counts[_name] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return counts


def _step_counts(layers, py_reads, monkeypatch, attn="triton"):
    from ftlib import losses
    from ftlib.clip import GlobalNormClipper
    from ftlib.lora import LoRAConfig, apply_lora
    from ftlib.losses import chunked_cross_entropy
    from ftlib.models import LlamaConfig, LlamaForCausalLM
    from ftlib.optim import TrainOptimizer, make_adamw, param_groups

    monkeypatch.setenv("FTLIB_ATTN_BACKEND", attn)  # sdpa: the per-document loop CUDA falls back to
    monkeypatch.setenv("FTLIB_LORA_BACKEND", "triton")
    monkeypatch.setattr(losses, "_vocab_major", lambda *a: False)  # the loss's block as on CUDA: (chunk, V)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    apply_lora(model, LoRAConfig(r=8, alpha=16, target_modules="all-linear"), verbose=False)
    opt = TrainOptimizer(make_adamw(param_groups(model, lr=1e-3), lr=1e-3, impl="fused"), precision="fp32")
    clip = GlobalNormClipper(1.0)
    lens = [20, 13, 15]
    n = sum(lens)
    ids = torch.randint(1, 96, (1, n))
    cu = torch.tensor([0, 20, 33, 48], dtype=torch.int32)
    pos = torch.cat([torch.arange(x) for x in lens])[None]
    labels = ids.clone()
    labels[0, :3] = -100
    counter = SyncCounter()
    py_reads.clear()
    with counter:
        hidden = model.model(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=max(lens))
        loss_sum, n_tgt = chunked_cross_entropy(hidden, model.lm_head.weight, labels)
        opt.backward(loss_sum, n_tgt)
        result = opt.step(clip)
    assert not result.skipped
    return counter.counts + py_reads


@pytest.mark.parametrize("attn, allowed", [("triton", 2), ("sdpa", 3)])
def test_no_host_sync_per_layer_and_two_per_step(monkeypatch, py_reads, attn, allowed):
    one = _step_counts(1, py_reads, monkeypatch, attn)
    two = _step_counts(2, py_reads, monkeypatch, attn)
    per_layer = {k: two[k] - one[k] for k in two.keys() | one.keys() if two[k] != one[k]}
    assert per_layer == {}, f"host reads per decoder layer: {per_layer} (1 layer: {dict(one)}, 2: {dict(two)})"
    total = sum(one.values())
    # 1 in chunked_cross_entropy (a micro-batch) + 1 in TrainOptimizer.step (its count came from the loss,
    # on the host; the loss sum is read with the norm and the clipper statistics); the SDPA fallback reads the
    # document boundaries once per batch (cached for every layer and the backward)
    assert total <= allowed, f"{total} host reads in one step outside the layers: {dict(one)}"
