"""The memory calculator: exact parameter counts, per-rank bytes equal to a real FSDP2 run's, the
activation formula equal to what autograd saves, and the CLI.

No GPU here: the totals are not checked against ``torch.cuda.max_memory_allocated``.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dist_common import CASES, CFG, LORA

import ftlib.models.llama as llama_mod
from ftlib.distributed.memory import activation_bytes_per_token, estimate_memory
from ftlib.kernels.attention_ref import attention_ref
from ftlib.lora import LoRAConfig, NF4Linear, apply_lora
from ftlib.models import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
             "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}


@pytest.fixture
def llama3_8b(tmp_path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps(LLAMA3_8B))
    return f


def test_llama3_8b_counts(llama3_8b):
    full = estimate_memory(llama3_8b, method="full", gpus=8)
    assert full.n_params == full.n_trainable == 8_030_261_248  # Meta-Llama-3-8B
    lora = estimate_memory(llama3_8b, method="lora", gpus=1, lora_r=16)
    assert lora.n_trainable == 41_943_040  # r=16 on all seven projections (what PEFT reports)
    assert lora.params == 2 * 8_030_261_248 + 4 * 41_943_040  # bf16 base, fp32 adapters, one GPU
    one = estimate_memory(llama3_8b, method="full", gpus=1)  # fp32 masters and grads, two fp32 moments
    assert (one.params, one.grads, one.optimizer) == (4 * one.n_params, 4 * one.n_params, 8 * one.n_params)
    # sharding divides what is sharded (up to rounding the rows up) and nothing else
    for method in ("full", "lora", "qlora"):
        one, eight = (estimate_memory(llama3_8b, method=method, gpus=g) for g in (1, 8))
        for key in ("params", "grads", "optimizer"):
            assert abs(getattr(one, key) / 8 - getattr(eight, key)) <= 0.001 * getattr(one, key), (method, key)
        assert one.activations == eight.activations


def test_nf4_bytes_are_those_of_a_real_layer():
    lin = torch.nn.Linear(70, 100, bias=False)
    layer = NF4Linear.from_linear(lin, double_quant=True)
    real = sum(p.nbytes for p in layer.parameters())
    cfg = LlamaConfig(vocab_size=8, hidden_size=70, intermediate_size=100, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=34)
    lora, qlora = (estimate_memory(cfg, method=m, lora_r=1, lora_targets=["up_proj"], dtype=torch.float32)
                   for m in ("lora", "qlora"))
    assert lora.params - qlora.params == 4 * 70 * 100 - real  # up_proj [100, 70]: fp32 vs NF4 storage


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_per_rank_bytes_equal_a_two_rank_fsdp2_run(two_ranks, case):
    measured = json.loads((two_ranks / case / "records.json").read_text())["bytes"]
    c = CASES[case]
    method = "full" if c["lora"] is None else ("qlora" if c["lora"].get("quantize") else "lora")
    est = estimate_memory(LlamaConfig(**CFG, tie_word_embeddings=c.get("tie", False)), method=method, gpus=2,
                          lora_r=LORA["r"], use_dora=bool(c["lora"] and c["lora"].get("use_dora")),
                          dtype=torch.float32)
    rank0 = measured[0]
    assert (rank0["params"], rank0["grads"], rank0["optimizer"]) == (est.params, est.grads, est.optimizer)
    assert all(r["params"] <= rank0["params"] for r in measured)  # rank 0 is the busiest (rows rounded up)


class _FlashLike(torch.autograd.Function):
    """Saves for backward what flash-attn saves: q, k, v, the output and the fp32 log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        with torch.no_grad():
            o = attention_ref(q, k, v, causal=True, softmax_scale=scale)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)  # (B, Hq, T)
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover -- only the forward's saved tensors are measured
        raise NotImplementedError


def _saved_bytes(model, ids) -> int:
    """Bytes of the distinct storages autograd saves in one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(ids)
    return sum(seen.values())


@pytest.mark.parametrize("method,dropout", [("lora", 0.0), ("lora", 0.1), ("full", 0.0)])
def test_activation_formula_is_what_autograd_saves(monkeypatch, method, dropout):
    """bf16 model, flash-like attention: one decoder block's saved tensors (the 2-layer model's minus
    the 1-layer model's, parameters excluded) are the formula's bytes exactly.

    With LoRA dropout a 1-byte keep mask per adapted linear (``ftlib.lora.dropout``)."""
    monkeypatch.setattr(llama_mod, "attention", lambda q, k, v, *, softmax_scale, **kw: _FlashLike.apply(
        q, k, v, softmax_scale))
    t = 48
    ids = torch.randint(0, 61, (1, t), generator=torch.Generator().manual_seed(0))
    per_model = []
    for layers in (1, 2):
        torch.manual_seed(0)
        cfg = LlamaConfig(**dict(CFG, num_hidden_layers=layers, hidden_size=64, intermediate_size=96))
        model = LlamaForCausalLM(cfg)
        if method == "lora":
            apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules="all-linear", dropout=dropout), verbose=False)
        model.to(torch.bfloat16).train()
        per_model.append(_saved_bytes(model, ids))
    targets = {n: 64 for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")} | {"down_proj": 96}
    want = t * activation_bytes_per_token(cfg, lora_targets=targets if method == "lora" else None, lora_r=4,
                                          lora_dropout=dropout, train_norms=method == "full", act_bytes=2)
    assert per_model[1] - per_model[0] == want, (per_model, want)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ftlib.distributed", "memory", *args], capture_output=True,
                          text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_cli_prints_the_table_and_json(llama3_8b):
    r = _cli("--model", str(llama3_8b), "--gpus", "1", "8", "--lora-r", "16", "--qlora")
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("qlora")]
    assert [row[1] for row in rows] == ["1", "8"] and float(rows[1][-1]) < float(rows[0][-1])
    assert "8.03B parameters" in r.stdout
    r = _cli("--model", str(llama3_8b.parent), "--gpus", "4", "--json")  # the folder works too; all methods
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["method"] for x in lines] == ["full", "lora", "qlora"] and all(x["gpus"] == 4 for x in lines)
    for x in lines:  # the peak: the forward's gathered copies and the gradients are not alive together
        assert x["total"] == x["params"] + x["optimizer"] + x["activations"] + max(
            x["gathered_forward"], x["grads"] + x["gathered_backward"])


def test_cli_refuses_bad_input(tmp_path, llama3_8b):
    r = _cli("--model", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "no config.json" in r.stderr
    (tmp_path / "bad.json").write_text("{")
    r = _cli("--model", str(tmp_path / "bad.json"))
    assert r.returncode == 2 and "invalid JSON at line 1" in r.stderr
    r = _cli("--model", str(llama3_8b), "--gpus", "6", "--shard-size", "4")
    assert r.returncode == 2 and "shard_size must divide gpus=6" in r.stderr
