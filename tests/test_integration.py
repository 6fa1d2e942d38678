"""Across modules, on ftlib's own model: adapters saved by ftlib load in peft on the transformers
twin of the model, and a merged QLoRA export written by ftlib's save_pretrained loads in
transformers with the merged outputs. Skipped without transformers / peft (dev extras)."""

import pytest
import torch

from ftlib.lora import LoRAConfig, apply_lora, merge_and_unload, save_adapter, trainable_params
from ftlib.models import LlamaConfig, LlamaForCausalLM, save_pretrained

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

IDS = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8], [8, 9, 7, 9, 3, 2, 38, 4]])


def _base(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    save_pretrained(model, tmp_path / "base")
    return model


def _train_like(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainable_params(model).values():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_ftlib_model_adapter_loads_in_peft(tmp_path, use_dora):
    model = _base(tmp_path)
    apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules="all-linear", use_dora=use_dora), verbose=False)
    _train_like(model)
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    with torch.no_grad():
        want = model(IDS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = hf(input_ids=IDS).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_merged_qlora_export_loads_in_transformers(tmp_path):
    model = _base(tmp_path)
    apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules="all-linear", quantize="nf4", double_quant=True),
               verbose=False)
    _train_like(model)
    with torch.no_grad():
        adapted = model(IDS)  # NF4 base + adapters, fp32 compute
    merged = merge_and_unload(model, dtype=torch.bfloat16)
    assert not any("lora" in n or "codes" in n for n, _ in merged.named_parameters())
    save_pretrained(merged, tmp_path / "merged")
    with torch.no_grad():
        want = merged.float()(IDS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(input_ids=IDS).logits
    # Weights are bf16 on both sides, computed in fp32: the same numbers.
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # And the export is the adapted model, up to rounding the merged weights to bf16.
    err = (want - adapted).abs().max() / adapted.abs().max()
    assert err < 2e-2, float(err)
