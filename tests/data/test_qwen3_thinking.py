"""Qwen3's chat template (``_chat_templates.QWEN3``, as shipped): thinking conversations.

The template splits an assistant content at ``</think>``, drops the reasoning of the turns before the
last user query, writes ``<think>\\n...\\n</think>\\n\\n`` before the answer of the turns after it (an
empty block for the last turn when it has none), and reads ``reasoning_content``. The oracle is
transformers' own rendering (``PreTrainedTokenizerFast.apply_chat_template``): ftlib's text must equal
it, and a token carries loss iff it overlaps what that text writes in an assistant turn, from right
after ``<|im_start|>assistant\\n`` through its ``<|im_end|>``: the kept ``<think>`` block, the answer,
any tool call and the turn end; an earlier turn whose reasoning the template drops trains on what is
rendered of it (its answer), never on the dropped reasoning. Each check is also run against
formatters broken on purpose (the think block cut off, the turn end left out) and must fail there.
"""

import re

import numpy as np
import pytest
from _chat_templates import _TOOL_SPECIALS, QWEN3
from tokenizers import Tokenizer

from ftlib.data import FormatConfig, Formatter, SkipReport
from ftlib.data import formatting as formatting_mod

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
U1, U2 = "why is the sky blue?", "and at sunset?"
THINK1 = "<think>\nthe user asks about the sky.\nRayleigh scattering.\n</think>\n\n"
THINK2 = "<think>\nlonger path through air\n</think>\n\n"
A1, A2 = "because of Rayleigh scattering", "red light is scattered less"


def _chat(a1, a2, **last):
    return {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": U1},
                         {"role": "assistant", "content": a1}, {"role": "user", "content": U2},
                         {"role": "assistant", "content": a2, **last}]}


RECORDS = {
    "think_both": _chat(THINK1 + A1, THINK2 + A2),
    "think_earlier_only": _chat(THINK1 + A1, A2),
    "think_last_only": _chat(A1, THINK2 + A2),
    "no_think": _chat(A1, A2),
    "think_without_open_tag": _chat("the sky.\n</think>\n\n" + A1, "air\n</think>" + A2),
    "reasoning_content": _chat(A1, A2, reasoning_content="longer path through air"),
    "reasoning_content_earlier": {"messages": [
        {"role": "user", "content": U1}, {"role": "assistant", "content": A1, "reasoning_content": "scattering"},
        {"role": "user", "content": U2}, {"role": "assistant", "content": A2}]},
    # after the last user query: every turn keeps its reasoning (the calling one too), a tool result between
    "tool_calls": {"messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "<think>\nI should call the tool.\n</think>\n\n", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call12345", "name": "get_weather"},
        {"role": "assistant", "content": "<think>\nit said sunny\n</think>\n\nIt is sunny."}], "tools": TOOLS},
    "tool_calls_with_content": {"messages": [
        {"role": "user", "content": U1}, {"role": "assistant", "content": THINK1 + A1},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "call the tool", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call12345", "name": "get_weather"},
        {"role": "assistant", "content": "It is sunny."}], "tools": TOOLS},
}


@pytest.fixture(scope="module")
def qwen3_tokenizer(tokenizer):
    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.add_special_tokens(_TOOL_SPECIALS)
    tok.add_tokens(["<think>", "</think>"])  # added, not special, as in Qwen3's tokenizer.json
    return tok


@pytest.fixture(scope="module")
def hf_tokenizer(qwen3_tokenizer):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=qwen3_tokenizer, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>", chat_template=QWEN3)


def _formatter(tok, **kw):
    return Formatter(tok, FormatConfig(kind="chat", chat_template=QWEN3, eos_token="<|im_end|>", **kw))


def check(tok, hf, fmt, rec):
    """ftlib's document is transformers' rendering, tokenized; its loss tokens are exactly those overlapping
    an assistant turn's rendered text (after its header, through <|im_end|>)."""
    text = hf.apply_chat_template(rec["messages"], tools=rec.get("tools"), tokenize=False)
    doc = fmt(rec, "x:1", SkipReport(strict=True))
    assert doc is not None
    enc = tok.encode(text, add_special_tokens=False)
    assert doc.input_ids.tolist() == enc.ids, "ftlib's rendering differs from transformers'"
    turns = [(m.start(1), m.end(1)) for m in re.finditer(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", text, re.S)]
    assert len(turns) == sum(m["role"] == "assistant" for m in rec["messages"])
    want = np.zeros(len(enc.ids), np.uint8)
    for s, e in turns:
        want |= np.array([a < e and b > s for a, b in enc.offsets], np.uint8)
    if not np.array_equal(doc.loss_mask, want):
        def runs(m):
            return [tok.decode([i for i, k in zip(enc.ids, m) if k], skip_special_tokens=False)]
        raise AssertionError(f"trained {runs(doc.loss_mask)}, expected {runs(want)}")
    return text, [text[s:e] for s, e in turns]


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_qwen3_mask_covers_each_rendered_assistant_turn(qwen3_tokenizer, hf_tokenizer, name):
    check(qwen3_tokenizer, hf_tokenizer, _formatter(qwen3_tokenizer), RECORDS[name])


def test_earlier_reasoning_is_dropped_and_the_last_kept(qwen3_tokenizer, hf_tokenizer):
    text, trained = check(qwen3_tokenizer, hf_tokenizer, _formatter(qwen3_tokenizer), RECORDS["think_both"])
    assert "Rayleigh scattering.\n" not in text  # the earlier turn's reasoning is not in the sequence
    assert trained == [A1 + "<|im_end|>", THINK2 + A2 + "<|im_end|>"]
    _, trained = check(qwen3_tokenizer, hf_tokenizer, _formatter(qwen3_tokenizer), RECORDS["no_think"])
    assert trained == [A1 + "<|im_end|>", "<think>\n\n</think>\n\n" + A2 + "<|im_end|>"]


def test_a_batch_formats_as_each_record_alone(qwen3_tokenizer, hf_tokenizer):
    """format_batch (the build path) gives each record the document it gets alone: none is refused."""
    fmt = _formatter(qwen3_tokenizer)
    report = SkipReport(strict=True)
    docs = fmt.format_batch([(r, f"x:{i}") for i, r in enumerate(RECORDS.values())], report)
    assert all(d is not None for _, d in docs)
    for (_, d), rec in zip(docs, RECORDS.values()):
        single = fmt(rec, "y", SkipReport(strict=True))
        assert d.input_ids.tolist() == single.input_ids.tolist() and d.loss_mask.tolist() == single.loss_mask.tolist()


def _cut_think(real):
    def broken(self, msgs, events, plain, *rest):  # the <think> block left out of the span, on purpose
        spans = real(self, msgs, events, plain, *rest)
        out = []
        for s, e in spans:
            i = plain.find("</think>\n\n", s, e)
            out.append((i + len("</think>\n\n"), e) if i >= 0 else (s, e))
        return out
    return broken


def _no_turn_end(real):
    def broken(self, msgs, events, plain, *rest):  # the turn end left out of the span, on purpose
        return [(s, e - len("<|im_end|>")) if plain.endswith("<|im_end|>", s, e) else (s, e)
                for s, e in real(self, msgs, events, plain, *rest)]
    return broken


@pytest.mark.parametrize("breaker", [_cut_think, _no_turn_end], ids=["think_cut", "no_turn_end"])
@pytest.mark.parametrize("name", ["think_both", "tool_calls", "reasoning_content"])
def test_the_check_fails_on_a_broken_mask(qwen3_tokenizer, hf_tokenizer, monkeypatch, breaker, name):
    monkeypatch.setattr(formatting_mod.Formatter, "_turn_spans", breaker(formatting_mod.Formatter._turn_spans))
    with pytest.raises(AssertionError):
        check(qwen3_tokenizer, hf_tokenizer, _formatter(qwen3_tokenizer), RECORDS[name])


def test_the_check_fails_without_the_turn_header(qwen3_tokenizer, hf_tokenizer, monkeypatch):
    """Without the header probe a turn whose content start the template cut away cannot be placed: the
    record is refused (it was, with 'hides assistant spans', before the probe existed)."""
    monkeypatch.setattr(formatting_mod.Formatter, "_answer_header", lambda self: "")
    with pytest.raises(Exception, match="cuts the start of an assistant content"):
        check(qwen3_tokenizer, hf_tokenizer, _formatter(qwen3_tokenizer), RECORDS["think_both"])


def test_build_cli_on_thinking_conversations(qwen3_tokenizer, hf_tokenizer, write_jsonl, tmp_path):
    """``python -m ftlib.data build`` with Qwen3's template read from the tokenizer folder: every record
    is kept, and each cached document has the tokens and loss mask of the check above."""
    import json

    from ftlib.data import open_cache
    from ftlib.data.__main__ import main as data_main

    folder = tmp_path / "qwen3"
    folder.mkdir()
    qwen3_tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN3, "eos_token": "<|im_end|>",
                                                               "bos_token": None}))
    recs = list(RECORDS.values())
    src = write_jsonl(tmp_path / "think.jsonl", recs)
    assert data_main(["build", "--source", src, "--tokenizer", str(folder), "--out", str(tmp_path / "cache"),
                      "--kind", "chat", "--num-proc", "1", "--no-progress"]) == 0
    off, ids, mask = open_cache(str(tmp_path / "cache")).shard_arrays()[0]
    assert len(off) - 1 == len(recs)
    fmt = _formatter(qwen3_tokenizer)
    for d, rec in enumerate(recs):
        check(qwen3_tokenizer, hf_tokenizer, fmt, rec)
        want = fmt(rec, "y", SkipReport(strict=True))
        a, b = int(off[d]), int(off[d + 1])
        assert np.asarray(ids[a:b]).tolist() == want.input_ids.tolist()
        assert np.asarray(mask[a:b]).tolist() == want.loss_mask.tolist()
