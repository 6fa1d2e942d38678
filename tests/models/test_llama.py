"""Decoder: packed == padded per document, checkpointing on/off, bf16, RoPE scaling, config I/O."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.models import LlamaConfig, rope_inv_freq


def _doc_batch(lengths, vocab=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def _padded(docs, left: bool):
    t = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), t, dtype=torch.long)
    mask = torch.zeros(len(docs), t, dtype=torch.long)
    for i, d in enumerate(docs):
        sl = slice(t - len(d), t) if left else slice(0, len(d))
        ids[i, sl], mask[i, sl] = d, 1
    return ids, mask


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_packed_and_padded_match_per_document(make_model, model_type):
    model = make_model(model_type).double()
    docs = _doc_batch([5, 3, 7, 1])
    # reference: each document alone
    alone = [model(d[None])[0] for d in docs]
    # packed: two rows of 8 tokens (5+3 | 7+1), cu_seqlens over the flattened 16 tokens
    ids = torch.cat(docs).view(2, 8)
    pos = torch.cat([torch.arange(len(d)) for d in docs]).view(2, 8)
    cu = torch.tensor([0, 5, 8, 15, 16], dtype=torch.int32)
    packed = model(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=7).reshape(16, -1)
    packed_no_pos = model(ids, cu_seqlens=cu).reshape(16, -1)  # positions derived from cu_seqlens
    torch.testing.assert_close(packed_no_pos, packed, rtol=0, atol=0)
    for left in (False, True):
        ids_p, mask = _padded(docs, left)
        padded = model(ids_p, attention_mask=mask)
        for i in range(len(docs)):
            s, e = int(cu[i]), int(cu[i + 1])
            torch.testing.assert_close(packed[s:e], alone[i], rtol=1e-10, atol=1e-10)
            real = padded[i][mask[i].bool()]
            torch.testing.assert_close(real, alone[i], rtol=1e-10, atol=1e-10, msg=f"doc {i} left={left}")


def test_hidden_states_without_head(make_model):
    model = make_model()
    ids = torch.randint(0, 128, (2, 6))
    hidden = model.model(ids)
    assert hidden.shape == (2, 6, 32)
    torch.testing.assert_close(model.lm_head(hidden), model(ids), rtol=0, atol=0)


@pytest.mark.parametrize("every,part", [(1, "block"), (2, "block"), (1, "attn"), (1, "mlp")])
def test_checkpointing_gives_same_gradients(make_model, every, part):
    model = make_model("qwen2", num_hidden_layers=3).double()
    ids = torch.randint(0, 128, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0

    def grads():
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=mask).pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = grads()
    model.set_gradient_checkpointing(every=every, part=part)
    flags = [layer.checkpoint_part for layer in model.model.layers]
    assert flags == [part if i % every == 0 else None for i in range(3)]
    got = grads()
    model.set_gradient_checkpointing(None)
    assert all(layer.checkpoint_part is None for layer in model.model.layers)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=0, atol=1e-14, msg=n)


def test_checkpointing_recomputes(make_model, monkeypatch):
    # The switch must really route through torch.utils.checkpoint (not only produce equal grads).
    import ftlib.models.llama as llama

    calls = []
    real = llama.checkpoint
    monkeypatch.setattr(llama, "checkpoint", lambda fn, *a, **k: calls.append(k) or real(fn, *a, **k))
    model = make_model()
    model.set_gradient_checkpointing(every=1, part="mlp")
    model(torch.randint(0, 128, (1, 4))).sum().backward()
    assert len(calls) == 2 and all(k == {"use_reentrant": False} for k in calls)
    with pytest.raises(ValueError, match="part"):
        model.set_gradient_checkpointing(part="everything")


def test_bf16_forward_backward(make_model):
    model = make_model("qwen2").to(torch.bfloat16)
    model.set_gradient_checkpointing(every=1)
    ids = torch.randint(0, 128, (2, 10))
    logits = model(ids, attention_mask=torch.ones_like(ids))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all(), n
    ref = make_model("qwen2")(ids)
    assert (logits.float() - ref).abs().max() < 0.1  # bf16 close to the fp32 model


def _llama3_closed_form(head_dim, theta, factor, low, high, old_len):
    # Meta's reference apply_scaling (llama-models, Llama 3.1), one frequency at a time in float64.
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(freq)
        elif wavelen > old_len / low:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


@settings(max_examples=25, deadline=None)
@given(
    half_dim=st.integers(4, 64),
    theta=st.sampled_from([10000.0, 500000.0]),
    factor=st.floats(1.0, 32.0),
    low=st.floats(0.5, 2.0),
    gap=st.floats(0.5, 6.0),
    old_len=st.sampled_from([64, 1024, 8192]),
)
def test_llama3_rope_scaling_matches_closed_form(half_dim, theta, factor, low, gap, old_len):
    scaling = dict(rope_type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=low + gap,
                   original_max_position_embeddings=old_len)
    got = rope_inv_freq(2 * half_dim, theta, scaling).double()
    want = _llama3_closed_form(2 * half_dim, theta, factor, low, low + gap, old_len)
    base = rope_inv_freq(2 * half_dim, theta).double()
    # compare the per-frequency multipliers got/base in [1/factor, 1]. The smoothing weight
    # s = (L / wavelen - low) / (high - low) is computed from the float32 inv_freq, whose relative
    # error is up to ~ln(theta) ulps (theta ** x with x rounded to float32): s then carries an
    # absolute error of ~16 eps * high / gap, and the multiplier (1 - s) / factor + s inherits it.
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(got / base, want / base, rtol=0, atol=32 * eps * (1 + (low + gap) / gap))
    # invariant: scaling never raises a frequency and never lowers it by more than `factor`
    assert (got <= base * (1 + 1e-6)).all() and (got >= base / factor * (1 - 1e-6)).all()


def test_config_hf_dict_round_trip_and_layouts():
    d = {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "pretraining_tp": 1,
        "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16",
    }
    cfg = LlamaConfig.from_hf_dict(d)
    assert cfg.head_dim == 128 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.extra == {"pretraining_tp": 1}
    back = LlamaConfig.from_hf_dict(cfg.to_hf_dict())
    assert back == cfg
    # the newer rope_parameters layout gives the same config
    new = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, **{
        k: v for k, v in d["rope_scaling"].items() if k != "type"}}
    assert LlamaConfig.from_hf_dict(new) == cfg
    q = LlamaConfig.from_hf_dict({"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                                  "num_hidden_layers": 1, "num_attention_heads": 2, "tie_word_embeddings": True,
                                  "use_sliding_window": False, "sliding_window": 4096})
    assert q.qkv_bias and not q.o_bias and q.sliding_window is None and q.num_key_value_heads == 2


@pytest.mark.parametrize("change,match", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"rope_scaling": {"rope_type": "su", "factor": 4.0}}, "rope_type 'su' is not supported"),
    ({"layer_types": ["chunked_attention"]}, r"layer_types\[0\] 'chunked_attention' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_config_errors_name_file_and_field(change, match):
    d = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
         "num_hidden_layers": 1, "num_attention_heads": 4, **change}
    with pytest.raises(ValueError, match=match) as e:
        LlamaConfig.from_hf_dict(d, source="ckpt/config.json")
    assert "ckpt/config.json" in str(e.value)
    with pytest.raises(ValueError, match="missing field 'hidden_size'"):
        LlamaConfig.from_hf_dict({"model_type": "llama", "vocab_size": 8})


def test_sliding_window_hides_keys_beyond_it(make_model):
    """Past the window the logits change (keys hidden), before it they equal the full-attention model's."""
    windowed, full = make_model("mistral", sliding_window=8), make_model("mistral")
    ids = torch.randint(0, 128, (1, 20))
    with torch.no_grad():
        a, b = windowed(ids), full(ids)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-6)
    assert (a[:, 8:] - b[:, 8:]).abs().amax(-1).min() > 1e-4


def test_bad_forward_inputs(make_model):
    model = make_model()
    ids = torch.randint(0, 128, (2, 4))
    with pytest.raises(ValueError, match="attention_mask must be"):
        model(ids, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="cannot be combined"):
        model(ids, attention_mask=torch.ones(2, 4), cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="input_ids must be"):
        model(ids[0])


@settings(max_examples=10, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5), rows=st.integers(1, 2), seed=st.integers(0, 99))
def test_packing_invariant_property(make_model, lengths, rows, seed):
    # invariant: logits of a document do not depend on what it is packed with (no cross-document attention)
    model = make_model("qwen2").double()
    docs = _doc_batch(lengths, seed=seed)
    total = sum(lengths)
    pad = (-total) % rows  # fill the last row with a padding "document" so B*T covers everything
    flat = torch.cat(docs + [torch.zeros(pad, dtype=torch.long)])
    bounds = [0]
    for n in lengths + ([pad] if pad else []):
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32)
    with torch.no_grad():
        packed = model(flat.view(rows, -1), cu_seqlens=cu).reshape(total + pad, -1)
        for i, d in enumerate(docs):
            torch.testing.assert_close(packed[bounds[i]:bounds[i + 1]], model(d[None])[0], rtol=1e-10, atol=1e-10)



def test_padded_batches_run_as_varlen_so_fused_kernels_apply(make_model, monkeypatch):
    """Left/right padding becomes cu_seqlens (no dense key mask, which only the O(T^2) reference takes).

    Real tokens' logits and every gradient of a loss over real tokens equal each document run alone.
    """
    import ftlib.models.llama as llama

    calls = []
    real = llama.attention
    monkeypatch.setattr(llama, "attention", lambda *a, **k: calls.append(k) or real(*a, **k))
    model = make_model("qwen2").double()
    docs = _doc_batch([6, 2, 4])

    def grads(fn):
        model.zero_grad(set_to_none=True)
        fn().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want = grads(lambda: sum(model(d[None])[0].pow(2).sum() for d in docs))
    for left in (False, True):
        ids, mask = _padded(docs, left)
        calls.clear()
        got = grads(lambda ids=ids, mask=mask: model(ids, attention_mask=mask)[mask.bool()].pow(2).sum())
        assert calls and all(k.get("key_padding_mask") is None and k["cu_seqlens"] is not None for k in calls)
        # rows of T=6: [6 real] [2 real | 4 pad] [4 real | 2 pad], or the pads first when left-padded
        want_cu = [0, 6, 10, 12, 14, 18] if left else [0, 6, 8, 12, 16, 18]
        assert calls[0]["cu_seqlens"].tolist() == want_cu and calls[0]["max_seqlen"] == 6
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12, msg=f"{n} left={left}")
    # a mask with a hole inside a row cannot be segments: it keeps the dense key mask
    mask = torch.ones(1, 5, dtype=torch.long)
    mask[0, 2] = 0
    calls.clear()
    model(torch.randint(0, 128, (1, 5)), attention_mask=mask)
    assert all(k.get("key_padding_mask") is not None for k in calls)


def _rms_textbook(x, w, eps):
    h = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_rmsnorm_forward_and_gradients_equal_the_textbook_form(dtype, tol):
    """The written-out RMSNorm backward equals autograd through y = w * (x * rsqrt(mean(x^2) + eps))
    for the input and a trainable weight (float64: exact up to rounding; gradcheck too)."""
    from ftlib.models import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(24, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(24, generator=g) + 0.5)
    x = (torch.randn(3, 7, 24, generator=g) * 3).to(dtype).requires_grad_()
    w = norm.weight.detach().clone().requires_grad_()
    dy = torch.randn(3, 7, 24, generator=g).to(dtype)
    y, want = norm(x), _rms_textbook(x, w, 1e-5)
    assert y.dtype == want.dtype == dtype
    torch.testing.assert_close(y, want, rtol=tol, atol=tol)
    got = torch.autograd.grad(y, (x, norm.weight), dy)
    ref = torch.autograd.grad(want, (x, w), dy)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * float(b.abs().max()))
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(norm, (x,))
