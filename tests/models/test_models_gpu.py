"""The model on a CUDA device: loading straight to the GPU, bf16 training step, cached decoding."""

import pytest
import torch

from ftlib.models import KVCache, generate, load_pretrained, save_pretrained

pytestmark = pytest.mark.gpu


def test_load_to_gpu_matches_cpu(make_model, tmp_path):
    model = make_model("qwen2")
    save_pretrained(model, tmp_path)
    gpu = load_pretrained(tmp_path, device="cuda")
    assert all(p.is_cuda for p in gpu.parameters())
    assert gpu.lm_head.weight is gpu.model.embed_tokens.weight
    ids = torch.randint(0, 128, (2, 33))
    torch.testing.assert_close(gpu(ids.cuda()).cpu(), model(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("part", ["block", "attn", "mlp"])
def test_bf16_training_step_on_gpu(make_model, tmp_path, part):
    save_pretrained(make_model("llama"), tmp_path)
    model = load_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda")
    model.set_gradient_checkpointing(every=1, part=part)
    ids = torch.randint(0, 128, (4, 64), device="cuda")
    cu = torch.tensor([0, 50, 64, 200, 256], dtype=torch.int32, device="cuda")
    logits = model(ids, cu_seqlens=cu)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, 128), ids[:, 1:].reshape(-1))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_cached_greedy_decoding_on_gpu(make_model):
    model = make_model("mistral").double().cuda()  # float64: argmax ties cannot flip between kernels
    ids = torch.randint(1, 128, (2, 7), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    out = generate(model, ids * mask, attention_mask=mask, max_new_tokens=6,
                   kv_cache=KVCache.for_model(model, 2, 13))
    seq, m = ids * mask, mask
    for step in range(6):
        nxt = model(seq, attention_mask=m)[:, -1].argmax(-1)
        assert torch.equal(nxt, out[:, step])
        seq, m = torch.cat([seq, nxt[:, None]], 1), torch.cat([m, torch.ones_like(m[:, :1])], 1)
