"""load_tokenizer: tokenizer.json + special tokens + sandboxed chat template."""

import json

import jinja2
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import ftlib.models
from ftlib.data import render_chat
from ftlib.models import load_tokenizer

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _write_tokenizer(path, config=None, special_map=None):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    tok.train_from_iterator(["hello world", "the quick brown fox", "jumps over the lazy dog"] * 20, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (path / "special_tokens_map.json").write_text(json.dumps(special_map))
    return tok


def test_load_and_render(tmp_path):
    tok = _write_tokenizer(tmp_path, config={
        "bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}, "chat_template": TEMPLATE,
    }, special_map={"pad_token": "<pad>", "bos_token": "<ignored-when-config-has-it>"})
    t = load_tokenizer(tmp_path)
    assert (t.bos_token, t.eos_token, t.pad_token, t.unk_token) == ("<s>", "</s>", "<pad>", None)
    assert (t.bos_token_id, t.eos_token_id, t.pad_token_id) == (1, 2, 3)
    assert t.encode("hello world") == tok.encode("hello world").ids
    assert t.decode(t.encode("the lazy dog")) == "the lazy dog"
    msgs = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "hello"}]
    assert t.apply_chat_template(msgs) == "<s><|user|>hi</s>\n<|assistant|>hello</s>\n"
    assert t.apply_chat_template(msgs[:1], add_generation_prompt=True) == "<s><|user|>hi</s>\n<|assistant|>"
    with pytest.raises(jinja2.TemplateError, match="bad role tool"):
        t.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_list_jinja_file_and_helpers(tmp_path):
    _write_tokenizer(tmp_path, config={"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ messages | tojson }}"}]})
    t = load_tokenizer(tmp_path)
    assert t.apply_chat_template([{"role": "user", "content": "é<b>"}]) == '[{"role": "user", "content": "é<b>"}]'
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}{% endfor %}"
        "{{ strftime_now('%Y') | length }}")
    assert load_tokenizer(tmp_path).apply_chat_template([{"content": "a"}, {"content": "b"}]) == "a4"


def test_template_is_sandboxed(tmp_path):
    # A template from a checkpoint must not reach Python internals nor mutate the caller's objects.
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat([], "{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat([], "{{ messages.append(1) }}")


def test_missing_tokenizer_json_and_bad_files(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json: not found"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{\"version\": 1}")
    with pytest.raises(ValueError, match=r"tokenizer.json: cannot be read"):
        load_tokenizer(tmp_path)
    _write_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"tokenizer_config.json: invalid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": 5}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json: eos_token must be a string"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no chat_template"):
        load_tokenizer(tmp_path).apply_chat_template([])


MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_one_chat_renderer_for_models_and_data(tmp_path):
    """A built-in name renders, a misspelled one is refused, and a tokenizer's own template renders
    through the same ``render_chat`` (``ftlib.models`` has no renderer of its own)."""
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    assert render_chat(MSGS, "chatml") == want
    with pytest.raises(ValueError, match="did you mean 'chatml'"):
        render_chat(MSGS, "chatmll")
    assert not hasattr(ftlib.models, "render_chat_template")
    _write_tokenizer(tmp_path, config={"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE})
    t = load_tokenizer(tmp_path)
    assert t.apply_chat_template(MSGS, add_generation_prompt=True) == render_chat(
        MSGS, TEMPLATE, add_generation_prompt=True, bos_token="<s>", eos_token="</s>", pad_token=None, unk_token=None)


def test_apply_chat_template_is_bounded(tmp_path):
    """A tokenizer's template is code from a checkpoint: it cannot loop for ever or fill the memory."""
    from ftlib.data import TemplateLimitError

    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages }}"
    _write_tokenizer(tmp_path, config={"chat_template": loop})
    with pytest.raises(TemplateLimitError, match=r"exceeded max_seconds=0\.2"):
        load_tokenizer(tmp_path).apply_chat_template(MSGS, max_seconds=0.2)
    _write_tokenizer(tmp_path, config={"chat_template": "{{ 'x' * 10**12 }}"})
    with pytest.raises(TemplateLimitError, match="over max_chars=4000000"):
        load_tokenizer(tmp_path).apply_chat_template(MSGS)


@pytest.mark.parametrize("config,want", [
    ({"pad_token": "<pad>", "eos_token": "</s>"}, "<pad>"),  # its own pad token
    ({"eos_token": "</s>"}, "</s>"),  # none (Llama-3, Mistral): padded with EOS, as transformers does
    ({}, None),  # neither: id 0
])
def test_pad_id_is_pad_else_eos_else_zero(tmp_path, config, want):
    tok = _write_tokenizer(tmp_path / "t", config=config)
    loaded = load_tokenizer(tmp_path / "t")
    assert loaded.pad_id == (tok.token_to_id(want) if want else 0)
    assert want is None or loaded.pad_id != 0
