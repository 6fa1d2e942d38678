"""ftlib.train.export: a merged model in HF's layout with the base's tokenizer files beside it."""

import pytest
import torch

from ftlib.lora import LoRAConfig, apply_lora
from ftlib.models import LlamaConfig, LlamaForCausalLM, load_pretrained
from ftlib.train import TOKENIZER_FILES, copy_tokenizer_files, save_merged


def _tokenizer_dir(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    (path / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    return path


def test_copy_tokenizer_files_copies_what_exists_and_refuses_a_folder_without_a_tokenizer(tmp_path):
    src = _tokenizer_dir(tmp_path / "base")
    got = copy_tokenizer_files(src, tmp_path / "out")
    assert [p.name for p in got] == ["tokenizer.json", "tokenizer_config.json"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes()
    assert "special_tokens_map.json" in TOKENIZER_FILES and not (tmp_path / "out" / "special_tokens_map.json").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: no tokenizer.json"):
        copy_tokenizer_files(tmp_path / "empty", tmp_path / "out2")


def test_save_merged_writes_the_adapted_model_and_its_tokenizer(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    apply_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.0, target_modules="all-linear"), verbose=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = torch.randint(0, 67, (2, 9))
    with torch.no_grad():
        want = model.eval()(ids)
    out = save_merged(model, tmp_path / "merged", tokenizer_from=_tokenizer_dir(tmp_path / "base"), dtype=None)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(out).eval()(ids), want, atol=1e-5, rtol=1e-5)
