"""Record layouts read as conversations (Alpaca, TRL conversational, ShareGPT with a system prompt),
and the rule for every layout: a field the format does not read that looks like content is reported."""

import json
import warnings

import pytest

from ftlib.data import FormatConfig, Formatter, SkipReport, build_cache, render_chat

CHAT = FormatConfig(kind="chat", chat_template="chatml")


def _text(tokenizer, cfg, rec):
    fmt = Formatter(tokenizer, cfg)
    doc = fmt(rec, "x:1", SkipReport(strict=True))
    return tokenizer.decode(doc.input_ids.tolist(), skip_special_tokens=False), doc


def _rendered(msgs):
    return render_chat(msgs, "chatml")


@pytest.mark.parametrize("kind", ["chat", "instruction"])
def test_alpaca_input_is_joined_to_the_instruction(tokenizer, kind):
    cfg = FormatConfig(kind=kind, chat_template="chatml")
    rec = {"instruction": "Translate to French", "input": "the sky is blue", "output": "le ciel est bleu"}
    text, doc = _text(tokenizer, cfg, rec)
    assert text == _rendered([{"role": "user", "content": "Translate to French\n\nthe sky is blue"},
                              {"role": "assistant", "content": "le ciel est bleu"}])
    hist = _text(tokenizer, cfg, {**rec, "history": [["hi there", "hello you"]]})[0]
    assert hist.startswith(_rendered([{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello you"}]))
    no_input = _text(tokenizer, cfg, {**rec, "input": ""})[0]
    assert "the sky" not in no_input and "Translate to French<|im_end|>" in no_input


def test_sharegpt_top_level_system_is_kept(tokenizer):
    rec = {"system": "You are terse.", "conversations": [{"from": "human", "value": "hi"},
                                                         {"from": "gpt", "value": "hello"}]}
    text, _ = _text(tokenizer, CHAT, rec)
    assert text == _rendered([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "hello"}])


def test_sharegpt_function_call_and_observation_turns_are_tool_turns(tokenizer):
    from ftlib.data.sharegpt import chat_turns

    rec = {"conversations": [{"from": "human", "value": "weather?"},
                             {"from": "function_call", "value": '{"name": "w", "arguments": {"c": 1}}'},
                             {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "sunny"}]}
    _, turns = chat_turns(rec)
    assert turns[1] == {"role": "assistant", "content": "",
                        "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"c": 1}}}]}
    assert turns[2] == {"role": "tool", "content": "sunny"}


@pytest.mark.parametrize("kind", ["chat", "instruction"])
def test_trl_conversational_prompt_completion_is_one_conversation(tokenizer, kind):
    cfg = FormatConfig(kind=kind, chat_template="chatml")
    rec = {"prompt": [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hello"},
                      {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "why blue"}],
           "completion": [{"role": "assistant", "content": "Rayleigh scattering"}]}
    text, doc = _text(tokenizer, cfg, rec)
    assert text == _rendered(rec["prompt"] + rec["completion"])
    trained = tokenizer.decode([i for i, m in zip(doc.input_ids, doc.loss_mask) if m], skip_special_tokens=False)
    assert trained == "Rayleigh scattering<|im_end|>"  # the prompt's assistant turn is context, as in TRL


def test_instruction_reads_trl_completion_for_the_response(tokenizer):
    cfg = FormatConfig(kind="instruction", chat_template="chatml")
    text, _ = _text(tokenizer, cfg, {"prompt": "why blue", "completion": "scattering"})
    assert "scattering<|im_end|>" in text


def test_unread_content_fields_are_reported_once_per_source(tmp_path, tokenizer, write_jsonl):
    cfg = FormatConfig(kind="instruction", chat_template="chatml")
    recs = [{"prompt": "why", "response": "blue", "input": f"the sky {i}", "id": "r1", "category": "open_qa"}
            for i in range(3)]
    src = write_jsonl(tmp_path / "a.jsonl", recs)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        c = build_cache(src, tokenizer, cfg, str(tmp_path / "c"), progress=False)
    said = [str(x.message) for x in w if "does not read" in str(x.message)]
    assert len(said) == 1 and "'input' in 3 record(s), first at" in said[0] and "a.jsonl:1" in said[0]
    assert "'id'" not in said[0] and "'category'" not in said[0]  # ids and labels are not content
    assert "--ignore-fields input" in str(c.report) and len(c) == 3  # nothing dropped: reported in the report too
    quiet = FormatConfig(kind="instruction", chat_template="chatml", ignore_fields=("input",))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        c = build_cache(src, tokenizer, quiet, str(tmp_path / "c2"), progress=False)
    assert not [x for x in w if "does not read" in str(x.message)] and "does not read" not in str(c.report)


def test_unread_fields_are_reported_for_every_layout(tokenizer):
    recs = {"messages": {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                         "notes": "a long note here"},
            "sharegpt": {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
                         "history": [["earlier question", "earlier answer"]]},  # Alpaca's field, not ShareGPT's
            "alpaca": {"instruction": "q", "output": "a", "context": "some context text"}}
    for name, rec in recs.items():
        report = SkipReport(strict=True)
        assert Formatter(tokenizer, CHAT)(rec, "f:1", report) is not None
        assert list(report.unread) == [{"messages": "notes", "sharegpt": "history", "alpaca": "context"}[name]]


def test_looks_like_content():
    from ftlib.data.layouts import looks_like_content

    assert looks_like_content("two words") and looks_like_content(["a b"]) and looks_like_content({"x": "a\nb"})
    assert not any(looks_like_content(v) for v in ("abc123", 5, None, ["x", "y"], "en"))


def test_build_cli_with_a_tool_call_jsonl_and_a_real_template(tmp_path, tokenizer, capsys):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from _chat_templates import _TOOL_SPECIALS, QWEN25_TOOLS
    from test_tool_calls import _record
    from tokenizers import Tokenizer

    from ftlib.data.__main__ import main

    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.add_special_tokens(_TOOL_SPECIALS)
    model = tmp_path / "model"
    model.mkdir()
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN25_TOOLS, "eos_token": "<|im_end|>"}))
    data = tmp_path / "calls.jsonl"
    data.write_text("".join(json.dumps(_record(c)) + "\n" for c in ("", None, "Let me check.")))
    assert main(["build", "--source", str(data), "--tokenizer", str(model), "--out", str(tmp_path / "c"),
                 "--num-proc", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "3 documents" in out and "no records skipped" in out
    from ftlib.data import open_cache

    c = open_cache(str(tmp_path / "c"))
    ids, mask = c[0]
    trained = tok.decode([int(i) for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in trained
