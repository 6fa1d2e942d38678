"""``benchmarks/bench_train.py --family qwen3``: the job's model is Qwen3-shaped in both libraries.

The row compares like with like only if transformers builds the same model from the same files: a
``Qwen3ForCausalLM`` with per-head q/k norms, head_dim 128 (not hidden / heads = 64) and the head
tied to the embeddings, whose logits with the job's PEFT adapter equal ftlib's.
"""

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _bench_train():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py"
    spec = importlib.util.spec_from_file_location("bench_train_family_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_qwen3_job_is_the_same_qwen3_model_in_both_libraries(tmp_path):
    from ftlib.lora import load_adapter
    from ftlib.models import load_pretrained

    bench = _bench_train()
    args = argparse.Namespace(family="qwen3", gpu_1b=False, layers=1, device="cpu", bf16=False)
    base, adapter = bench.make_initial_weights(str(tmp_path), 256, args)
    assert base.endswith("-qwen3") and bench.shape_tag(args) == "6x512-qwen3"
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="sdpa").eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    assert hf.config.head_dim == 128 and hf.config.tie_word_embeddings
    assert hf.model.layers[0].self_attn.q_proj.out_features == 8 * 128
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ours = load_pretrained(base)
    assert ours.config.qk_norm == "head" and ours.lm_head.weight is ours.model.embed_tokens.weight
    load_adapter(ours, adapter, check_base=False)
    pm = peft.PeftModel.from_pretrained(hf, adapter).eval()
    with torch.no_grad():  # q/k norms drawn away from 1 on both sides alike: the logits depend on them
        for m in (ours, pm):
            for name, p in m.named_parameters():
                if "q_norm" in name or "k_norm" in name:
                    p.copy_(torch.linspace(0.5, 1.5, p.numel()))
        ids = torch.randint(1, 256, (2, 33), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(ours(ids), pm(ids).logits, atol=1e-5, rtol=1e-5)


def test_llama_job_is_unchanged_and_gpu_shape_refuses_another_family(capsys):
    bench = _bench_train()
    assert "model_type" not in bench.model_shape({}) and bench.shape_tag(argparse.Namespace()) == "6x512"
    assert bench.model_shape({"family": "qwen3", "layers": 2})["num_hidden_layers"] == 2
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--gpu-1b", "--family", "qwen3"])
    assert e.value.code == 2 and "--gpu-1b is Llama-3.2-1B's shape" in capsys.readouterr().err
