"""Sharded loading (``ftlib.distributed.load_sharded`` / ``init_sharded``) under torchrun, gloo on CPU.

- equality: tiny checkpoints (fp32 / bf16-stored, tied / untied, LoRA, QLoRA with double
  quantization, a config alone) loaded on 2 and 4 ranks (1-D and HSDP 2 x 2) equal the
  one-process ``load_pretrained`` / ``LlamaForCausalLM(config)`` + ``apply_lora`` for the same
  seed: every full tensor and the logits, bit for bit; each rank reads only its rows' bytes.
- memory: a ~250 MB fp32 model loaded on 1, 2 and 4 ranks (plain, QLoRA, and resuming a
  sharded checkpoint): each rank's peak RSS above its baseline stays within its 1/world share
  + 2 layers + ALLOWANCE_MB, and the logits equal the one-process ones.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from ftlib.lora import LoRAConfig, apply_lora
from ftlib.models import LlamaConfig, LlamaForCausalLM, load_pretrained, save_pretrained

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _torchrun import torchrun  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _sharded_load_worker import prepare_memory_dir  # noqa: E402

WORKER = Path(__file__).with_name("_sharded_load_worker.py")
TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
# ~250 MB fp32: 4 layers of 11.3 M parameters (45 MB) and an untied 8192 x 1024 embedding and head
BIG = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
           num_key_value_heads=4)
# interpreter/gloo/allocator noise of one rank above its share + 2 layers (page cache is not RSS)
ALLOWANCE_MB = 48.0
LORA = {
    "lora": dict(r=3, alpha=8, target_modules="all-linear"),
    "qlora": dict(r=3, alpha=8, target_modules="all-linear", quantize="nf4", double_quant=True),
    "qlora_single": dict(r=3, alpha=8, target_modules=["q_proj", "down_proj"], quantize="nf4", init="gaussian"),
}
CASES = [
    dict(name="plain", source="checkpoint", store="float32", tie=False, dtype="float32", lora=None, seed=0),
    dict(name="tied_bf16", source="checkpoint", store="bfloat16", tie=True, dtype="float32", lora=None, seed=0),
    dict(name="lora", source="checkpoint", store="float32", tie=False, dtype="float32", lora="lora", seed=7),
    dict(name="qlora", source="checkpoint", store="float32", tie=True, dtype="float32", lora="qlora", seed=3),
    dict(name="qlora_bf16", source="checkpoint", store="bfloat16", tie=False, dtype="bfloat16", lora="qlora_single",
         seed=4),
    dict(name="config", source="config", tie=False, dtype="float32", lora=None, seed=5),
    dict(name="config_tied_lora", source="config", tie=True, dtype="float32", lora="lora", seed=11),
    dict(name="config_qlora", source="config", tie=False, dtype="float32", lora="qlora", seed=12),
    # other families: Phi-3's fused projections under QLoRA, Gemma-2's norms, window and soft-caps
    dict(name="phi3_qlora", source="checkpoint", store="float32", tie=False, dtype="float32", lora="qlora", seed=13,
         arch=dict(model_type="phi3", partial_rotary_factor=0.5)),
    dict(name="gemma2", source="checkpoint", store="float32", tie=True, dtype="float32", lora="lora", seed=14,
         arch=dict(model_type="gemma2", hidden_act="gelu_pytorch_tanh", sliding_window=4, query_pre_attn_scalar=8.0,
                   attn_logit_softcapping=5.0, final_logit_softcapping=5.0,
                   layer_types=["sliding_attention", "full_attention"])),
]
IDS = torch.tensor([[3, 17, 5, 40, 2, 9, 33, 11]])


def _reference(case: dict, root: Path) -> None:
    """Write the checkpoint (checkpoint cases) and the one-process tensors and logits of ``case``."""
    cfg = dict(TINY, tie_word_embeddings=case["tie"], **case.get("arch", {}))
    dtype = getattr(torch, case["dtype"])
    if case["source"] == "checkpoint":
        torch.manual_seed(1000 + len(case["name"]))
        src = LlamaForCausalLM(LlamaConfig(**cfg)).to(getattr(torch, case["store"]))
        save_pretrained(src, root / case["name"], max_shard_size="20KB")  # several files + an index
        case["bytes"] = sum(t.numel() * t.element_size() for t in src.state_dict().values()) - (
            src.lm_head.weight.numel() * src.lm_head.weight.element_size() if case["tie"] else 0)
        torch.manual_seed(case["seed"])
        model = load_pretrained(root / case["name"], dtype=dtype)
    else:
        case["config"] = cfg
        torch.manual_seed(case["seed"])
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype)
    if case["lora"]:
        apply_lora(model, LoRAConfig(**LORA[case["lora"]]), verbose=False)
    with torch.no_grad():
        logits = model(IDS)
    torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "logits": logits},
               root / f"{case['name']}.pt")


@pytest.mark.parametrize("nproc", [2, 4])
def test_sharded_load_and_meta_init_equal_one_process(tmp_path, nproc):
    root = tmp_path / "ckpts"
    root.mkdir()
    cases = [dict(c) for c in CASES]
    for case in cases:
        _reference(case, root)
    (root / "cases.json").write_text(json.dumps(cases))
    out = tmp_path / "out"
    out.mkdir()
    torchrun(WORKER, str(out), "equal", str(root), nproc=nproc, timeout=300)
    assert (out / "ok").read_text() == "ok"


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    return prepare_memory_dir(tmp_path_factory.mktemp("big"), BIG)


def run_memory(root: Path, out: Path, nproc: int, *extra: str) -> list[dict]:
    """Run the memory phases on ``nproc`` ranks; return each rank's record (and the bounds)."""
    out.mkdir(parents=True, exist_ok=True)
    # a fixed mmap threshold: freed tensors go back to the OS at once, so a baseline is not inflated
    # by an earlier phase's free heap and a peak is not hidden in it
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    torchrun(WORKER, str(out), "memory", str(root), *extra, nproc=nproc, timeout=600)
    recs = [json.loads((out / f"mem-{r}.json").read_text()) for r in range(nproc)]
    for rec in recs:
        share, two = rec["model_mb"] / nproc, 2 * rec["layer_mb"]
        rec["bound_mb"] = share + two + ALLOWANCE_MB
        rec["qlora_bound_mb"] = rec["nf4_mb"] / nproc + two + ALLOWANCE_MB
    return recs


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_sharded_load_peak_rss_per_rank(big_model, tmp_path, nproc):
    for rec in run_memory(big_model, tmp_path / "out", nproc):
        print(rec)
        assert rec["plain_maxdiff"] == 0.0 and rec["qlora_maxdiff"] == 0.0 and rec["resume_maxdiff"] == 0.0, rec
        assert rec["plain_peak_mb"] <= rec["bound_mb"], rec
        assert rec["qlora_peak_mb"] <= rec["qlora_bound_mb"], rec
        assert rec["resume_peak_mb"] <= rec["bound_mb"], rec
