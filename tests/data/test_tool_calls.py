"""Tool-calling conversations: per-record tools reach the template, each call is trained whole.

Checked token by token with the templates of Qwen2.5, Qwen3, Llama-3.1/3.2 (JSON tool calls),
Mistral v0.3 (``[TOOL_CALLS]``) and Hermes-2-Pro (``<tool_call>``), as shipped
(``_chat_templates.TOOL_TEMPLATES``). The oracle is written by hand per template: the exact text
of each trained stretch (the call, its arguments, the turn end; the final answer); a token carries
loss iff it overlaps one of them. Each check is also run against a formatter whose call spans were
dropped on purpose, and must fail there.
"""

import json

import numpy as np
import pytest
from _chat_templates import _TOOL_SPECIALS, TOOL_TEMPLATES
from tokenizers import Tokenizer

from ftlib.data import DataError, FormatConfig, Formatter, SkipReport, render_chat
from ftlib.data import formatting as formatting_mod

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def _record(content=""):
    call = {"role": "assistant", "tool_calls": [CALL]}
    if content is not None:
        call["content"] = content
    return {"messages": [{"role": "user", "content": "What is the weather in Paris?"}, call,
                         {"role": "tool", "content": "sunny", "tool_call_id": "call12345", "name": "get_weather"},
                         {"role": "assistant", "content": "It is sunny."}], "tools": TOOLS}


# the trained stretches, in order, per template (content "" and content "Let me check.")
EXPECTED = {
    "qwen2.5": (['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                 "It is sunny.<|im_end|>"],
                ['Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                 "<|im_end|>", "It is sunny.<|im_end|>"]),
    # Qwen3 writes an (empty) <think> block before the last turn's answer: the model writes it too
    "qwen3": (['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
               "<think>\n\n</think>\n\nIt is sunny.<|im_end|>"],
              ['Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
               "<|im_end|>", "<think>\n\n</think>\n\nIt is sunny.<|im_end|>"]),
    # Llama-3.1/3.2 and Hermes write no content beside a call: the call is the whole turn
    "llama3.1": (['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is sunny.<|eot_id|>"],) * 2,
    "llama3.2": (['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is sunny.<|eot_id|>"],) * 2,
    "mistral-v0.3": (['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call12345"}]</s>',
                      "It is sunny.</s>"],) * 2,
    "hermes-2-pro": (['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                      "It is sunny.<|im_end|>"],) * 2,
}
TOOLS_SHOWN = {"qwen2.5": "# Tools", "qwen3": "# Tools", "llama3.1": "Given the following functions",
               "llama3.2": "Given the following functions", "mistral-v0.3": "[AVAILABLE_TOOLS]",
               "hermes-2-pro": '"description": "Weather of a city"'}


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer):
    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.add_special_tokens(_TOOL_SPECIALS)
    return tok


def _formatter(tok, name):
    template, bos, eos = TOOL_TEMPLATES[name]
    return Formatter(tok, FormatConfig(kind="chat", chat_template=template, bos_token=bos, eos_token=eos))


def check_mask(tok, fmt, name, rec, expected):
    """The document is the tokenized rendering; its loss tokens are exactly those overlapping ``expected``."""
    template, bos, eos = TOOL_TEMPLATES[name]
    msgs = [dict(m, content=m.get("content") or "") for m in rec["messages"]]
    text = render_chat(msgs, template, bos_token=bos or "", eos_token=eos or "", tools=rec.get("tools"))
    assert TOOLS_SHOWN[name] in text  # the record's tools reached the template
    doc = fmt(rec, "x:1", SkipReport(strict=True))
    assert doc is not None
    enc = tok.encode(text, add_special_tokens=False)
    assert doc.input_ids.tolist() == enc.ids
    want, pos = np.zeros(len(enc.ids), np.uint8), 0
    for piece in expected:
        s = text.index(piece, pos)
        pos = s + len(piece)
        want |= np.array([a < pos and b > s for a, b in enc.offsets], np.uint8)
    got = doc.loss_mask
    if not np.array_equal(got, want):
        def runs(m):
            return [tok.decode([i for i, k in zip(enc.ids, m) if k], skip_special_tokens=False)]
        raise AssertionError(f"{name}: trained {runs(got)}, expected {runs(want)}")


@pytest.mark.parametrize("content", ["", None, "Let me check."], ids=["empty", "missing", "with_content"])
@pytest.mark.parametrize("name", sorted(TOOL_TEMPLATES))
def test_tool_call_turns_are_trained_whole(tool_tokenizer, name, content):
    fmt = _formatter(tool_tokenizer, name)
    check_mask(tool_tokenizer, fmt, name, _record(content), EXPECTED[name][content == "Let me check."])


@pytest.mark.parametrize("name", sorted(TOOL_TEMPLATES))
def test_the_mask_check_fails_when_the_call_tokens_are_dropped(tool_tokenizer, name, monkeypatch):
    fmt = _formatter(tool_tokenizer, name)
    real = formatting_mod.Formatter._turn_spans

    def drop_calls(self, msgs, events, plain, *rest):  # the spans of turns with tool calls, dropped on purpose
        spans = real(self, msgs, events, plain, *rest)
        return [(s, e) for s, e in spans if "get_weather" not in plain[s:e]]

    monkeypatch.setattr(formatting_mod.Formatter, "_turn_spans", drop_calls)
    with pytest.raises(AssertionError):
        check_mask(tool_tokenizer, fmt, name, _record(""), EXPECTED[name][0])


def test_tools_given_as_json_text_and_ids_and_names_reach_the_template(tool_tokenizer):
    seen = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_call_id %}[{{ m.tool_call_id }}|"
            "{{ m.name }}]{% endif %}{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}"
            "{{ c.function.arguments | tojson }}</call>{% endfor %}<|im_end|>{% endfor %}"
            "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}")
    fmt = Formatter(tool_tokenizer, FormatConfig(kind="chat", chat_template=seen))
    rec = _record("")
    rec["tools"] = json.dumps(TOOLS)
    text, spans = fmt._prepare(rec, "x:1", SkipReport())
    assert "[call12345|get_weather]" in text and text.endswith("get_weather")
    assert any('<call>get_weather{"city": "Paris"}</call>' in text[s:e] for s, e in spans)


def test_a_template_that_does_not_render_tool_calls_is_reported(tool_tokenizer):
    fmt = Formatter(tool_tokenizer, FormatConfig(kind="chat", chat_template="chatml"))
    with pytest.raises(DataError, match="tool calls"):
        fmt(_record("Calling."), "x:1", SkipReport(strict=True))


def test_malformed_tool_calls_are_named(tool_tokenizer):
    fmt = _formatter(tool_tokenizer, "qwen2.5")
    rec = _record("")
    rec["messages"][1]["tool_calls"] = [{"function": {"arguments": {}}}]
    with pytest.raises(DataError, match="x:1: bad_field: message 1: 'tool_calls'"):
        fmt(rec, "x:1", SkipReport(strict=True))


def _call(i, city):
    return {"id": f"call{i:05d}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


@pytest.mark.parametrize("name", sorted(TOOL_TEMPLATES))
def test_consecutive_and_parallel_calls_are_each_trained(tool_tokenizer, name):
    """Two calling turns in a row (call, result, call, result, answer), the second with two calls at once
    (Llama-3.1/3.2 take one call per turn: there the second turn has one)."""
    two = [_call(2, "Rome")] if name.startswith("llama") else [_call(2, "Rome"), _call(3, "Oslo")]
    rec = {"messages": [{"role": "user", "content": "Weather in Paris, then Rome and Oslo?"},
                        {"role": "assistant", "content": "", "tool_calls": [_call(1, "Paris")]},
                        {"role": "tool", "content": "sunny", "tool_call_id": "call00001", "name": "get_weather"},
                        {"role": "assistant", "content": "", "tool_calls": two}]
           + [{"role": "tool", "content": w, "tool_call_id": c["id"], "name": "get_weather"}
              for c, w in zip(two, ("rain", "snow"))]
           + [{"role": "assistant", "content": "Sunny, then rain and snow."}], "tools": TOOLS}
    fmt = _formatter(tool_tokenizer, name)
    text, spans = fmt._prepare(rec, "x:1", SkipReport(strict=True))
    trained = [text[s:e] for s, e in spans]
    assert len(trained) == 3
    assert "Paris" in trained[0] and "sunny" not in trained[0]
    assert all(c["function"]["arguments"]["city"] in trained[1] for c in two) and "rain" not in trained[1]
    # Qwen3 writes an empty <think> block before the last answer: it is the model's to write
    assert trained[2].removeprefix("<think>\n\n</think>\n\n" if name == "qwen3" else "").startswith("Sunny,")
    for t in trained[:2]:  # each calling turn from the call's first character to its turn end
        assert t.startswith(("<tool_call>", '{"name"', "[TOOL_CALLS]")), t
        assert t.endswith(TOOL_TEMPLATES[name][2]), t
