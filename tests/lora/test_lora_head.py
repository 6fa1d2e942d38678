"""A LoRA-adapted ``lm_head`` trains through the chunked losses.

The chunked losses multiply the hidden states by the head's weight themselves, so they read
``head_weight(lm_head)``: the adapted ``W + s B A`` (DoRA: rows scaled by m / ||W + s B A||).
Invariant: the loss and every adapter gradient equal those of the model's own forward (which calls
the LoRA layer on the hidden states) in float64, for LoRA, DoRA, tied embeddings and an NF4 head.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

from ftlib.lora import LoRAConfig, LoRALinear, apply_lora
from ftlib.losses import causal_lm_loss, head_weight
from ftlib.models import LlamaConfig, LlamaForCausalLM
from ftlib.preference import sequence_logprobs


def _model(tied=False, dora=False, dtype=torch.float64):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    apply_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"],
                                 use_dora=dora), verbose=False)
    model.to(dtype)  # adapters too (they are created in fp32)
    with torch.no_grad():  # B = 0 at init: make the head's adapter count
        for name, p in model.named_parameters():
            if "lora_B" in name or "magnitude" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("tied,dora", [(False, False), (True, False), (False, True)])
def test_chunked_loss_with_a_lora_head_equals_the_full_forward(tied, dora):
    model = _model(tied, dora)
    assert isinstance(model.lm_head, LoRALinear)
    ids = torch.randint(0, 67, (2, 11))
    labels = ids.clone()
    labels[:, :3] = -100
    batch = {"input_ids": ids, "labels": labels}

    logits = model(ids)  # the LoRA head applied as a layer
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 67), labels[:, 1:].reshape(-1), reduction="sum")
    want.backward()
    g_want = _grads(model)
    model.zero_grad()

    loss, n = causal_lm_loss(model, batch)
    loss.backward()
    g_got = _grads(model)
    assert int(n) == 2 * 8  # targets: positions 1..10, of which 1 and 2 are prompt
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    head = [k for k in g_want if k.startswith("lm_head.")]
    assert head and all(g_want[k].abs().max() > 0 for k in head)  # the head's adapter is trained
    for k in g_want:
        torch.testing.assert_close(g_got[k], g_want[k], rtol=1e-10, atol=1e-12, msg=k)


def test_sequence_logprobs_read_the_adapted_head():
    model = _model()
    ids = torch.randint(0, 67, (1, 9))
    hidden = model.model(ids)
    logp = torch.log_softmax(model(ids)[0, :-1], -1).gather(-1, ids[0, 1:, None]).sum()
    got = sequence_logprobs(hidden, head_weight(model.lm_head), ids)
    torch.testing.assert_close(got.sum[0] if hasattr(got, "sum") else got[0], logp, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # the plain weight would miss the adapter
        plain = torch.log_softmax(hidden[0, :-1] @ model.lm_head.base_layer.weight.T, -1).gather(-1, ids[0, 1:, None])
    assert (plain.sum() - logp).abs() > 1e-3


def test_nf4_head_and_disabled_adapter_and_dropout_warning():
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    apply_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.1, target_modules=["lm_head"], quantize="nf4"), verbose=False)
    head = model.lm_head
    x = torch.randn(5, 64)
    with torch.no_grad():
        head.lora_B.weight.normal_()
    head.eval()
    torch.testing.assert_close(x @ head.effective_weight().T, head(x), rtol=1e-5, atol=1e-5)
    head.disabled = True
    torch.testing.assert_close(head.effective_weight(), head.base_weight())
    head.disabled = False
    head.train()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        head.effective_weight()
        head.effective_weight()
    assert sum("dropout is not applied" in str(m.message) for m in w) == 1  # once per layer


def test_head_weight_refuses_a_biased_head():
    with pytest.raises(ValueError, match="bias"):
        head_weight(torch.nn.Linear(4, 5, bias=True))
    assert head_weight(torch.nn.Linear(4, 5, bias=False)).shape == (5, 4)
