"""adapter_config.json fields of the wrong type or range are refused, naming file and field."""

import json

import pytest
import torch
from torch import nn

from ftlib.lora import LoRAConfig, apply_lora, load_adapter, lora_layers, save_adapter

GOOD = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "lora_dropout": 0.0}


@pytest.mark.parametrize("key,value,expected", [
    ("use_rslora", "false", "a boolean"),  # bool("false") is True
    ("use_dora", 0, "a boolean"),
    ("ensure_weight_tying", "no", "a boolean"),
    ("modules_to_save", "lm_head", "a list of strings"),  # list("lm_head") is its characters
    ("modules_to_save", ["lm_head", 3], "item 1"),
    ("lora_alpha", "16", "a finite number > 0"),
    ("lora_alpha", None, "a finite number > 0"),
    ("lora_dropout", "0.1", r"a finite number >= 0 and < 1"),
    ("lora_dropout", 1.0, r"a finite number >= 0 and < 1"),
    ("r", "8", "a positive integer"),
    ("r", 8.0, "a positive integer"),
    ("target_modules", 5, "a string or a list of strings"),
    ("exclude_modules", {"q": 1}, "a string or a list of strings"),
    ("rank_pattern", {"q_proj": "2"}, r"rank_pattern\['q_proj'\] is '2'"),
    ("rank_pattern", ["q_proj"], "an object of integers"),
    ("alpha_pattern", {"q_proj": -1}, r"alpha_pattern\['q_proj'\] is -1"),
    ("peft_type", 1, "a string"),
    ("bias", False, "a string"),
    ("init_lora_weights", 1, "a boolean or a string"),
])
def test_adapter_config_field_types(key, value, expected):
    with pytest.raises(ValueError, match=expected) as e:
        LoRAConfig.from_peft_dict(dict(GOOD, **{key: value}), source="run/adapter/adapter_config.json")
    msg = str(e.value)
    assert msg.startswith("run/adapter/adapter_config.json: ") and key in msg, msg


def test_well_typed_adapter_config_is_taken_as_written():
    cfg = LoRAConfig.from_peft_dict(dict(GOOD, use_rslora=False, modules_to_save=["lm_head"], lora_alpha=16,
                                         lora_dropout=0.1, rank_pattern={"q_proj": 2}, alpha_pattern=None))
    assert cfg.use_rslora is False and cfg.modules_to_save == ["lm_head"] and cfg.alpha == 16
    assert cfg.dropout == 0.1 and cfg.rank_pattern == {"q_proj": 2} and cfg.alpha_pattern == {}
    assert LoRAConfig.from_peft_dict(dict(GOOD, use_rslora=True)).use_rslora is True
    assert LoRAConfig.from_peft_dict(dict(GOOD, lora_dropout=None, modules_to_save=None)).dropout == 0.0


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(8, 8)


def test_load_adapter_names_the_file(tmp_path):
    torch.manual_seed(0)
    save_adapter(apply_lora(nn.Sequential(_Attn()), LoRAConfig(r=4, alpha=8, target_modules=["q_proj"])), tmp_path)
    conf = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(dict(conf, use_rslora="false")))
    plain = nn.Sequential(_Attn())
    with pytest.raises(ValueError, match="use_rslora must be a boolean") as e:
        load_adapter(plain, tmp_path)
    assert str(tmp_path / "adapter_config.json") in str(e.value)
    assert not list(lora_layers(plain))
    (tmp_path / "adapter_config.json").write_text(json.dumps(dict(conf, base_model_name_or_path=5)))
    with pytest.raises(ValueError, match="base_model_name_or_path must be a string"):
        load_adapter(nn.Sequential(_Attn()), tmp_path)


def test_python_config_numbers_are_checked():
    with pytest.raises(ValueError, match="LoRAConfig.alpha must be a number"):
        LoRAConfig(alpha="16")
    with pytest.raises(ValueError, match="LoRAConfig.dropout must be a number"):
        LoRAConfig(dropout="0.1")


def test_loading_into_a_differently_adapted_model_names_each_difference(tmp_path):
    torch.manual_seed(0)
    save_adapter(apply_lora(nn.Sequential(_Attn()), LoRAConfig(r=4, alpha=8, target_modules=["q_proj"])), tmp_path)
    other = apply_lora(nn.Sequential(_Attn()), LoRAConfig(r=8, alpha=8, target_modules=["q_proj"], use_rslora=True))
    with pytest.raises(ValueError) as e:
        load_adapter(other, tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "adapter_config.json") in msg
    assert "r: 8 -> 4" in msg and "use_rslora: True -> False" in msg and "alpha" not in msg, msg
