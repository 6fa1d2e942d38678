"""config.json and tokenizer_config.json fields of the wrong type or range are refused, naming file and field."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from ftlib.models import LlamaConfig, load_config, load_tokenizer

BASE = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4}


@pytest.mark.parametrize("key,value,expected", [
    ("tie_word_embeddings", "false", "a boolean"),  # bool("false") is True
    ("attention_bias", "true", "a boolean"),
    ("mlp_bias", 1, "a boolean"),
    ("max_position_embeddings", "abc", "a positive integer"),
    ("max_position_embeddings", -5, "a positive integer"),
    ("vocab_size", 64.0, "a positive integer"),
    ("num_key_value_heads", "2", "a positive integer"),
    ("head_dim", 0, "a positive integer"),
    ("rms_norm_eps", "abc", "a finite number > 0"),
    ("rms_norm_eps", 0, "a finite number > 0"),
    ("rope_theta", None, "a finite number > 0"),
    ("rope_theta", "10000", "a finite number > 0"),
    ("initializer_range", "0.02", "a finite number >= 0"),
    ("hidden_act", 3, "a string"),
    ("eos_token_id", "2", "an integer or a non-empty list"),
    ("eos_token_id", [2, "3"], "item 1"),
    ("pad_token_id", 0.5, "an integer"),
    ("rope_scaling", "linear", "an object"),
    ("rope_parameters", 5, "an object"),
])
def test_config_json_field_types(tmp_path, key, value, expected):
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, **{key: value})))
    with pytest.raises(ValueError, match=expected) as e:
        load_config(tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'config.json'}: ") and key in msg, msg
    assert repr(value) in msg or "item 1 is '3'" in msg, msg  # what was found


@pytest.mark.parametrize("scaling,expected", [
    ({"rope_type": "linear", "factor": "4"}, "factor must be a finite number > 0"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": "1", "high_freq_factor": 4.0}, "low_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": "8192"}, "original_max_position_embeddings must be a positive integer"),
    ({"rope_type": 3}, "rope_type must be a string"),
])
def test_rope_scaling_subfields(scaling, expected):
    with pytest.raises(ValueError, match=expected) as e:
        LlamaConfig.from_hf_dict(dict(BASE, rope_scaling=scaling), source="ckpt/config.json")
    assert str(e.value).startswith("ckpt/config.json: rope_scaling: field ")


def test_sliding_window_type_is_checked_where_it_is_used():
    d = dict(BASE, model_type="mistral", sliding_window="4096")
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        LlamaConfig.from_hf_dict(d, source="config.json")
    qwen = dict(BASE, model_type="qwen2", use_sliding_window="false", sliding_window=4096)
    with pytest.raises(ValueError, match="use_sliding_window must be a boolean"):
        LlamaConfig.from_hf_dict(qwen, source="config.json")


def test_well_typed_values_are_taken_as_written():
    d = dict(BASE, tie_word_embeddings=False, rope_theta=500000, rms_norm_eps=1e-5, eos_token_id=[1, 2],
             max_position_embeddings=4096, pad_token_id=None, rope_scaling=None)
    cfg = LlamaConfig.from_hf_dict(d)
    assert cfg.tie_word_embeddings is False and cfg.rope_theta == 500000.0 and isinstance(cfg.rope_theta, float)
    assert cfg.eos_token_id == [1, 2] and cfg.max_position_embeddings == 4096 and cfg.pad_token_id is None
    assert LlamaConfig.from_hf_dict(dict(BASE, tie_word_embeddings=True)).tie_word_embeddings is True


def _tokenizer_dir(path, config):
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("config,expected", [
    ({"eos_token": 2}, "eos_token must be a string or an object"),
    ({"bos_token": {"content": 1}}, "bos_token must be a string or an object"),
    ({"chat_template": 5}, "field chat_template must be a string or a list"),
    ({"chat_template": ["{{ x }}", {"name": "default", "template": "x"}]}, r"chat_template\[0\] must be an object"),
    ({"chat_template": [{"name": "default", "template": 5}]}, r"chat_template\[0\]: field template must be a string"),
    ({"chat_template": [{"name": None, "template": "x"}]}, r"chat_template\[0\]: field name must be a string"),
])
def test_tokenizer_config_field_types(tmp_path, config, expected):
    root = _tokenizer_dir(tmp_path / "tok", config)
    with pytest.raises(ValueError, match=expected) as e:
        load_tokenizer(root)
    assert str(root / "tokenizer_config.json") in str(e.value)
