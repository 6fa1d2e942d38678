"""ftlib.long_context: the sequence-chunked MLP equals the unchunked one (float64, values and every gradient),
and the bytes autograd holds saved at once shrink as the module doc states."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ftlib.long_context as lc
from ftlib.long_context import (
    chunk_mlp,
    chunk_norms,
    chunked_apply,
    offload_checkpoints,
    peak_saved_bytes,
    unchunk_mlp,
    unoffload_checkpoints,
)
from ftlib.lora import LoRAConfig, apply_lora
from ftlib.models import LlamaConfig, LlamaForCausalLM

CFG = dict(vocab_size=37, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)


def _model(lora=True, dropout=0.0, dtype=torch.float64, **cfg):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**(CFG | cfg)))
    if lora:
        apply_lora(model, LoRAConfig(r=3, alpha=6, target_modules="all-linear", dropout=dropout), verbose=False)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.2)
    return model.to(dtype).train()


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    h = model.model(ids)
    w = torch.randn(h.shape, generator=torch.Generator().manual_seed(3), dtype=h.dtype)
    (h * w).sum().backward()
    return h.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@settings(max_examples=20, deadline=None)
@given(t=st.integers(1, 23), b=st.integers(1, 2), chunks=st.integers(1, 30), lora=st.booleans(),
       ckpt=st.sampled_from([None, "block", "mlp"]), fused=st.booleans(), norms=st.booleans(),
       qk_norm=st.sampled_from([None, "head"]))
def test_chunked_mlp_equals_unchunked(t, b, chunks, lora, ckpt, fused, norms, qk_norm):
    """float64: hidden states and the gradient of every trainable tensor (LoRA factors, or all weights),
    any K (more chunks than tokens included), with block / MLP checkpointing on top, fused gate_up too;
    with the norms chunked as well (per-head q/k norms included: chunked along T, not the heads)."""
    model = _model(lora=lora, fused_proj=fused, qk_norm=qk_norm)
    if ckpt:
        model.set_gradient_checkpointing(1, part=ckpt)
    ids = torch.randint(0, 37, (b, t), generator=torch.Generator().manual_seed(t))
    want_h, want_g = _run(model, ids)
    keys = list(model.state_dict())
    chunk_mlp(model, chunks)
    if norms:
        chunk_norms(model, chunks)
    assert list(model.state_dict()) == keys  # same module tree, same checkpoint keys
    got_h, got_g = _run(model, ids)
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=1e-12)
    assert got_g.keys() == want_g.keys() and len(got_g) > 0
    for k, g in want_g.items():
        torch.testing.assert_close(got_g[k], g, rtol=0, atol=1e-12, msg=k)
    unchunk_mlp(model)
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP" and type(model.model.norm).__name__ == "RMSNorm"


def test_dropout_masks_are_replayed_in_the_recomputation():
    """With adapter dropout the chunks' masks are drawn once: the recomputed backward is the gradient of the
    forward that ran (the same chunks without recomputation, from the same seed)."""
    model = _model(dropout=0.3)
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 19, 16, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(5)
    plain = torch.cat([mlp(p) for p in torch.tensor_split(x, 4, dim=-2)], dim=-2)
    params = [p for p in mlp.parameters() if p.requires_grad]
    gx_plain, *gp_plain = torch.autograd.grad(plain.sum(), [x, *params])
    torch.manual_seed(5)
    y = chunked_apply(mlp, x, 4, tuple(mlp.parameters()))
    y.sum().backward()
    torch.testing.assert_close(y, plain, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, gx_plain, rtol=0, atol=1e-12)
    for p, g in zip(params, gp_plain):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-12)


def _mlp_peak(chunks, t, dtype=torch.bfloat16):
    model = _model(dtype=dtype, hidden_size=64, intermediate_size=160)
    mlp = model.model.layers[0].mlp
    if chunks:
        chunk_mlp(model, chunks)
    x = torch.randn(1, t, 64, dtype=dtype, requires_grad=True)
    return peak_saved_bytes(lambda: mlp(x).float().sum().backward())


@pytest.mark.parametrize("chunks", [2, 4, 8])
def test_peak_saved_bytes_shrink_as_stated(chunks):
    """bf16, H = 64, I = 160, r = 3 on gate/up/down, T = 64: unchunked a H + 4 a I + 3 a r bytes a token at
    once; K chunks a H + (4 a I + 3 a r) / K (x, then one chunk's recomputed tensors in backward)."""
    t, a, h, i, r = 64, 2, 64, 160, 3
    whole = _mlp_peak(0, t)
    assert whole == t * (a * h + 4 * a * i + 3 * a * r)
    assert _mlp_peak(chunks, t) == t * a * h + t * (4 * a * i + 3 * a * r) // chunks


@pytest.mark.parametrize("chunks,dropout", [(1, 0.0), (3, 0.0), (1, 0.3), (3, 0.3)])
def test_offloaded_checkpoints_equal_no_checkpointing(chunks, dropout):
    """float64: hidden states and every LoRA gradient with each block's input kept as a (CPU) copy and the block
    recomputed in backward, equal to the same model without checkpointing; with adapter dropout too (the
    forward draws the masks in the same order, the recomputation replays them)."""
    model = _model(dropout=dropout, num_hidden_layers=3)
    ids = torch.randint(0, 37, (2, 13), generator=torch.Generator().manual_seed(1))
    if chunks > 1:
        chunk_mlp(model, chunks)
    torch.manual_seed(7)
    want_h, want_g = _run(model, ids)
    keys = list(model.state_dict())
    offload_checkpoints(model, copy_cpu=True)
    assert list(model.state_dict()) == keys
    torch.manual_seed(7)
    got_h, got_g = _run(model, ids)
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=0)
    assert got_g.keys() == want_g.keys() and len(got_g) == 3 * 7 * 2
    for k, g in want_g.items():
        torch.testing.assert_close(got_g[k], g, rtol=0, atol=1e-12, msg=k)
    unoffload_checkpoints(model)
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"


def test_offloaded_inputs_come_back_last_block_first(monkeypatch):
    """Backward of block l fetches its own input and starts the copy of block l - 1's; nothing else is kept."""
    model = offload_checkpoints(_model(num_hidden_layers=3), copy_cpu=True)
    events, made = [], []
    init, fetch, prefetch = lc._HostCopy.__init__, lc._HostCopy.fetch, lc._HostCopy.prefetch

    def record_init(self, x, copy_cpu):
        init(self, x, copy_cpu)
        made.append(self)
        assert self.host.data_ptr() != x.data_ptr()  # a copy, not the block's input

    monkeypatch.setattr(lc._HostCopy, "__init__", record_init)
    monkeypatch.setattr(lc._HostCopy, "fetch", lambda self: events.append(("fetch", made.index(self))) or fetch(self))
    monkeypatch.setattr(lc._HostCopy, "prefetch",
                        lambda self: events.append(("prefetch", made.index(self))) or prefetch(self))
    _run(model, torch.randint(0, 37, (1, 9), generator=torch.Generator().manual_seed(0)))
    assert len(made) == 3
    assert [e for e in events if e[0] == "fetch"] == [("fetch", 2), ("fetch", 1), ("fetch", 0)]
    assert events.index(("prefetch", 1)) < events.index(("fetch", 1))  # started during block 2's backward
    assert all(c.host is None and c.gpu is None for c in made)  # every copy dropped once used
    model.set_gradient_checkpointing(1)
    with pytest.raises(RuntimeError, match="offload_checkpoints replaces the block's checkpointing"):
        _run(model, torch.zeros(1, 4, dtype=torch.long))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="chunks must be an int >= 1"):
        chunk_mlp(_model(lora=False), 0)
    with pytest.raises(ValueError, match="has no module named 'mlp'"):
        chunk_mlp(torch.nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match="has no decoder blocks"):
        offload_checkpoints(torch.nn.Linear(2, 2))
