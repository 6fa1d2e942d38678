"""Exports from a 2-rank FSDP2 run: the adapter (PEFT format) and the merged model (Hugging Face format).

The exported adapter must equal the one-process adapter to fp32 rounding and load in peft; the
merged export written at step SAVE_AT must be, file for file and bit for bit, what
``save_pretrained(merge_and_unload(...))`` writes in one process from the same weights (the
sharded checkpoint of that step, loaded here).
"""

import json

import pytest
import torch
from _dist_common import CFG, SAVE_AT, build
from conftest import reference
from safetensors.torch import load_file

from ftlib.checkpoint import CheckpointWarning, load_checkpoint, step_dir_name
from ftlib.lora import load_adapter, merge_and_unload, save_adapter
from ftlib.models import LlamaConfig, LlamaForCausalLM, load_pretrained, save_pretrained

pytestmark = pytest.mark.distributed
IDS = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8], [8, 9, 7, 9, 3, 2, 38, 4]])


def _same_tensors(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("case", ["lora", "qlora"])
def test_exported_adapter_equals_the_one_process_adapter(two_ranks, case, tmp_path):
    module, _, _ = reference(case)
    save_adapter(module.model, tmp_path)
    got, want = load_file(two_ranks / case / "adapter" / "adapter_model.safetensors"), load_file(
        tmp_path / "adapter_model.safetensors")
    assert set(got) == set(want) and len(want) > 0
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert json.loads((two_ranks / case / "adapter" / "adapter_config.json").read_text()) == json.loads(
        (tmp_path / "adapter_config.json").read_text())


def test_exported_adapter_loads_in_peft(two_ranks, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)  # the base build() adapts
    save_pretrained(LlamaForCausalLM(LlamaConfig(**CFG)), tmp_path / "base")
    adapter = two_ranks / "lora" / "adapter"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, adapter).eval()
    ours = load_adapter(load_pretrained(tmp_path / "base"), adapter, check_base=False).eval()
    trained, _, _ = reference("lora")
    with torch.no_grad():
        want = trained.model.eval()(IDS)
        torch.testing.assert_close(hf(input_ids=IDS).logits, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours(IDS), want, atol=1e-5, rtol=1e-5)
        assert (load_pretrained(tmp_path / "base")(IDS) - want).abs().max() > 1e-3, "the adapter changes nothing"
    trained.model.train()


@pytest.mark.parametrize("case", ["qlora", "full_tied"])
def test_exported_merged_model_is_the_one_process_merge(two_ranks, case, tmp_path):
    module = build(case)
    with pytest.warns(CheckpointWarning):
        load_checkpoint(two_ranks / case / "ckpt" / step_dir_name(SAVE_AT), model=module)
    with torch.no_grad():
        adapted = module.model.eval()(IDS)
    merged = merge_and_unload(module.model, dtype=torch.float32) if case == "qlora" else module.model
    save_pretrained(merged, tmp_path, max_shard_size="24KB")
    got_dir = two_ranks / case / "merged_k"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert sorted(p.name for p in got_dir.iterdir()) == names and len(names) > 3, names  # several shards + index
    for name in names:
        if name.endswith(".json"):
            assert json.loads((got_dir / name).read_text()) == json.loads((tmp_path / name).read_text()), name
        else:
            assert _same_tensors(load_file(got_dir / name), load_file(tmp_path / name)), name
    with torch.no_grad():  # and it is the adapted model, merged (NF4 base dequantized, DoRA folded in)
        torch.testing.assert_close(load_pretrained(got_dir).eval()(IDS), adapted, atol=2e-5, rtol=2e-5)


def test_merged_qlora_export_loads_in_transformers(two_ranks):
    transformers = pytest.importorskip("transformers")
    got_dir = two_ranks / "qlora" / "merged_k"
    hf = transformers.AutoModelForCausalLM.from_pretrained(got_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=IDS).logits, load_pretrained(got_dir).eval()(IDS), atol=1e-4,
                                   rtol=1e-4)
