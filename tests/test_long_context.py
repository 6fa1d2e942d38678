"""ftlib.long_context: the sequence-chunked MLP equals the unchunked one (float64, values and every gradient),
and the bytes autograd holds saved at once shrink as the module doc states."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.long_context import chunk_mlp, chunked_apply, peak_saved_bytes, unchunk_mlp
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
       ckpt=st.sampled_from([None, "block", "mlp"]), fused=st.booleans())
def test_chunked_mlp_equals_unchunked(t, b, chunks, lora, ckpt, fused):
    """float64: hidden states and the gradient of every trainable tensor (LoRA factors, or all weights),
    any K (more chunks than tokens included), with block / MLP checkpointing on top, fused gate_up too."""
    model = _model(lora=lora, fused_proj=fused)
    if ckpt:
        model.set_gradient_checkpointing(1, part=ckpt)
    ids = torch.randint(0, 37, (b, t), generator=torch.Generator().manual_seed(t))
    want_h, want_g = _run(model, ids)
    keys = list(model.state_dict())
    chunk_mlp(model, chunks)
    assert list(model.state_dict()) == keys  # same module tree, same checkpoint keys
    got_h, got_g = _run(model, ids)
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=1e-12)
    assert got_g.keys() == want_g.keys() and len(got_g) > 0
    for k, g in want_g.items():
        torch.testing.assert_close(got_g[k], g, rtol=0, atol=1e-12, msg=k)
    unchunk_mlp(model)
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"


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


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="chunks must be an int >= 1"):
        chunk_mlp(_model(lora=False), 0)
    with pytest.raises(ValueError, match="has no module named 'mlp'"):
        chunk_mlp(torch.nn.Linear(2, 2), 2)
