"""Embedding noise: NEFTune's alpha / sqrt(L d) with L each document's length, Gaussian noise, and the hook."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.embed_noise import EmbeddingNoise, document_lengths

D = 64


def _emb(vocab=50, d=D):
    torch.manual_seed(0)
    return torch.nn.Embedding(vocab, d)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _delta(emb, noise, batch, step=0):
    noise.set_batch(batch, step=step)
    with torch.no_grad():
        return emb(batch["input_ids"]) - F.embedding(batch["input_ids"], emb.weight)


@settings(max_examples=25)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=6), rows=st.sampled_from([1, 2]),
       alpha=st.sampled_from([1.0, 5.0, 15.0]))
def test_neftune_scale_is_per_document_in_packed_rows(lens, rows, alpha):
    n = sum(lens)
    t = -(-n // rows)
    lens = lens + ([rows * t - n] if rows * t > n else [])  # a padding tail segment, as the packer makes
    emb = _emb()
    noise = EmbeddingNoise(emb, neftune_alpha=alpha, seed=3)
    ids = torch.randint(0, 50, (rows, t))
    batch = {"input_ids": ids, "cu_seqlens": _cu(lens)}
    delta = _delta(emb, noise, batch).view(-1, D)
    start = 0
    for L in lens:
        bound = alpha / math.sqrt(L * D)
        ratio = delta[start:start + L] / bound
        assert float(ratio.abs().max()) <= 1.0 + 1e-5, (L, float(ratio.abs().max()))
        # uniform(-1, 1) over L * 64 >= 64 values: max |u| < 0.8 has probability 0.8^64 < 1e-6
        assert float(ratio.abs().max()) > 0.8, (L, float(ratio.abs().max()))
        start += L


def test_neftune_padded_batch_uses_real_tokens_and_skips_padding():
    emb = _emb()
    noise = EmbeddingNoise(emb, neftune_alpha=5.0)
    ids = torch.randint(0, 50, (2, 12))
    am = torch.zeros(2, 12, dtype=torch.int64)
    am[0, :12] = 1
    am[1, 9:] = 1  # left padding, 3 real tokens
    delta = _delta(emb, noise, {"input_ids": ids, "attention_mask": am})
    assert bool((delta[1, :9] == 0).all())
    for r, L in ((0, 12), (1, 3)):
        real = delta[r][am[r].bool()] / (5.0 / math.sqrt(L * D))
        assert 0.8 < float(real.abs().max()) <= 1.0 + 1e-5


def test_plain_batch_uses_the_row_length():
    emb = _emb()
    noise = EmbeddingNoise(emb, neftune_alpha=5.0)
    delta = _delta(emb, noise, {"input_ids": torch.randint(0, 50, (3, 20))})
    assert 0.8 < float((delta / (5.0 / math.sqrt(20 * D))).abs().max()) <= 1.0 + 1e-5


def test_document_lengths_packed_equals_padded():
    lens = [5, 1, 9]
    packed = document_lengths(torch.zeros(1, 15, dtype=torch.long), cu_seqlens=_cu(lens))
    assert packed.view(-1).tolist() == [5] * 5 + [1] + [9] * 9
    am = torch.zeros(3, 9, dtype=torch.long)
    for r, L in enumerate(lens):
        am[r, :L] = 1
    padded = document_lengths(torch.zeros(3, 9, dtype=torch.long), attention_mask=am)
    assert padded[am.bool()].tolist() == packed.view(-1).tolist() and bool((padded[~am.bool()] == 0).all())


def test_gaussian_noise_std_and_padding():
    emb = _emb(d=256)
    noise = EmbeddingNoise(emb, gaussian_std=0.02, seed=1)
    ids = torch.randint(0, 50, (4, 64))
    am = torch.ones(4, 64, dtype=torch.int64)
    am[:, 48:] = 0
    delta = _delta(emb, noise, {"input_ids": ids, "attention_mask": am})
    real = delta[am.bool()]
    # 48k samples: the sample std is within 2 % of sigma with overwhelming probability (sd of s ~ 0.3 %)
    assert abs(float(real.std()) / 0.02 - 1) < 0.02 and abs(float(real.mean())) < 1e-3
    assert bool((delta[~am.bool()] == 0).all())


def test_training_only_and_remove():
    emb = _emb()
    noise = EmbeddingNoise(emb, neftune_alpha=5.0)
    ids = torch.randint(0, 50, (2, 8))
    emb.eval()
    assert torch.equal(emb(ids), F.embedding(ids, emb.weight))  # eval: no noise, no set_batch needed
    emb.train()
    noise.set_batch({"input_ids": ids})
    assert not torch.equal(emb(ids), F.embedding(ids, emb.weight))
    noise.remove()
    assert torch.equal(emb(ids), F.embedding(ids, emb.weight))


def test_noise_is_a_function_of_seed_and_step():
    emb = _emb()
    batch = {"input_ids": torch.randint(0, 50, (2, 8))}
    a = EmbeddingNoise(emb, neftune_alpha=5.0, seed=7)
    d1 = _delta(emb, a, batch, step=4)
    d2 = _delta(emb, a, batch, step=4)
    d3 = _delta(emb, a, batch, step=5)
    assert torch.equal(d1, d2) and not torch.equal(d1, d3)
    a.remove()
    b = EmbeddingNoise(emb, neftune_alpha=5.0, seed=8)
    assert not torch.equal(_delta(emb, b, batch, step=4), d1)
    b.remove()
    # without a step, a counter of training forwards keys the noise; state_dict resumes it
    c = EmbeddingNoise(emb, neftune_alpha=5.0, seed=7)
    c.set_batch(batch)
    emb(batch["input_ids"])
    state = c.state_dict()
    want = _delta(emb, c, {"input_ids": batch["input_ids"]}, step=None)
    c.remove()
    d = EmbeddingNoise(emb, neftune_alpha=5.0, seed=0)
    d.load_state_dict(state)
    assert torch.equal(_delta(emb, d, batch, step=None), want)
    with pytest.raises(ValueError, match="state is neftune=5.0, this hook is gaussian=0.1"):
        EmbeddingNoise(torch.nn.Embedding(3, 2), gaussian_std=0.1).load_state_dict(state)


def test_errors():
    emb = _emb()
    with pytest.raises(ValueError, match="exactly one of neftune_alpha"):
        EmbeddingNoise(emb)
    with pytest.raises(ValueError, match="exactly one of neftune_alpha"):
        EmbeddingNoise(emb, neftune_alpha=1.0, gaussian_std=0.1)
    with pytest.raises(ValueError, match="neftune_alpha must be a finite number >= 0"):
        EmbeddingNoise(emb, neftune_alpha=-1.0)
    with pytest.raises(ValueError, match="gaussian_std must be a finite number"):
        EmbeddingNoise(emb, gaussian_std=float("inf"))
    with pytest.raises(TypeError, match="needs an nn.Embedding"):
        EmbeddingNoise(torch.nn.Linear(2, 2), neftune_alpha=1.0)
    with pytest.raises(ValueError, match="no input embedding found"):
        EmbeddingNoise.attach(torch.nn.Linear(2, 2), neftune_alpha=1.0)
    noise = EmbeddingNoise(emb, neftune_alpha=5.0)
    ids = torch.randint(0, 50, (2, 8))
    with pytest.raises(RuntimeError, match="call noise.set_batch\\(batch\\).*saw no batch"):
        emb(ids)
    noise.set_batch({"input_ids": ids})
    with pytest.raises(RuntimeError, match="a different input_ids tensor"):
        emb(ids.clone())
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        noise.set_batch({"input_ids": ids}, step=-1)
    with pytest.raises(ValueError, match="not both"):
        document_lengths(ids, cu_seqlens=_cu([16]), attention_mask=torch.ones_like(ids))


def test_on_a_tied_llama_packed_batch():
    from ftlib.models import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    keys = sorted(model.state_dict())
    noise = EmbeddingNoise.attach(model, neftune_alpha=5.0, seed=0)
    assert noise.embedding is model.model.embed_tokens
    ids = torch.randint(0, 64, (2, 10))
    cu = _cu([4, 6, 7, 3])
    batch = {"input_ids": ids, "cu_seqlens": cu}
    model.eval()
    with torch.no_grad():
        clean = model(ids, cu_seqlens=cu)
    model.train()
    noise.set_batch(batch, step=0)
    logits = model(ids, cu_seqlens=cu)
    assert not torch.allclose(logits, clean)
    logits.float().pow(2).mean().backward()
    assert model.model.embed_tokens.weight.grad is not None
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie and the keys are untouched
    assert sorted(model.state_dict()) == keys
