"""ftlib.data.templates: one resolver for every --chat-template spec; ftlib.data.sharegpt: ShareGPT turns."""

import json

import pytest

from ftlib.data import (
    BUILTIN_TEMPLATES,
    FormatConfig,
    SkipReport,
)
from ftlib.data.sharegpt import chat_turns
from ftlib.data.templates import NoChatTemplate, read_template_file, resolve_chat_template

T = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


class Tok:
    chat_template = None
    source = "models/base"


def test_every_spec_form_resolves_to_the_template_text(tmp_path):
    (tmp_path / "t.jinja").write_text(T)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": T}]}))
    assert resolve_chat_template("chatml").text == BUILTIN_TEMPLATES["chatml"]
    assert resolve_chat_template(str(tmp_path / "t.jinja")).text == T
    assert resolve_chat_template(str(tmp_path / "tokenizer_config.json")).text == T
    assert resolve_chat_template(str(tmp_path)).text == T  # a model folder
    assert resolve_chat_template(T).source == "inline text"
    tok = Tok()
    tok.chat_template = T
    got = resolve_chat_template(None, tokenizer=tok)
    assert got.text == T and got.source == "tokenizer (models/base)"
    assert resolve_chat_template("llama3", tokenizer=tok).text == BUILTIN_TEMPLATES["llama3"]  # explicit wins


def test_no_template_is_refused_with_the_way_out(tmp_path):
    with pytest.raises(NoChatTemplate, match="models/base has no chat template.*--chat-template: a built-in name"):
        resolve_chat_template(None, tokenizer=Tok())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert read_template_file(tmp_path / "tokenizer_config.json") is None
    with pytest.raises(ValueError, match="holds no chat template"):
        resolve_chat_template(str(tmp_path / "tokenizer_config.json"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="did you mean 'llama3'"):
        resolve_chat_template("llama")
    (tmp_path / "named.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": T}]}))
    with pytest.raises(ValueError, match="no 'default' entry"):
        resolve_chat_template(str(tmp_path / "named.json"))


def test_sharegpt_conversations_read_as_chat_turns():
    rec = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                             {"from": "gpt", "value": "a"}]}
    field, turns = chat_turns(rec)
    assert field == "conversations"
    assert turns == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                     {"role": "assistant", "content": "a"}]
    msgs = {"messages": [{"role": "user", "content": "q"}]}
    assert chat_turns(msgs) == ("messages", msgs["messages"])  # role/content records pass unchanged
    with pytest.raises(ValueError, match="message 1: ShareGPT 'from' 'robot'"):
        chat_turns({"conversations": [{"from": "human", "value": "q"}, {"from": "robot", "value": "a"}]})
    with pytest.raises(KeyError):
        chat_turns({"text": "x"})


def test_sharegpt_record_formats_like_its_messages_twin(tokenizer):
    cfg = FormatConfig(kind="chat", chat_template="chatml", eos_token="</s>")
    fmt = cfg.formatter(tokenizer)
    share = {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello"}]}
    plain = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]}
    a, b = fmt(share, "x:1", SkipReport()), fmt(plain, "x:2", SkipReport())
    assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
    report = SkipReport(strict=False)
    assert fmt({"conversations": [{"from": "robot", "value": "?"}]}, "x:3", report) is None
    assert report.counts == {"bad_field": 1} and "x:3" in report.examples["bad_field"][0]


def test_the_template_names_scripts_import_are_public_at_ftlib_data():
    import ftlib.data
    from ftlib.data import sharegpt, templates

    for name, mod in (("ChatTemplate", templates), ("resolve_chat_template", templates), ("chat_turns", sharegpt)):
        assert name in ftlib.data.__all__ and getattr(ftlib.data, name) is getattr(mod, name), name


def test_misspelled_builtin_template_name_is_refused():
    with pytest.raises(ValueError, match=r"'chatlm' is neither a built-in name.*did you mean 'chatml'"):
        FormatConfig(kind="chat", chat_template="chatlm")
