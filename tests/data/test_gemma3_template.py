"""Gemma-3's chat template (``_chat_templates.GEMMA3``, the hub file's text): the assistant-only loss mask.

The template folds a system turn into the first user turn (its text, a blank line, the user's text),
names assistant turns ``model``, trims every content and ends each turn with ``<end_of_turn>\\n``.
A token carries loss iff it is in an assistant turn's trimmed content or its ``<end_of_turn>``:
not the ``<start_of_turn>model\\n`` header, not the newline after the turn end (decoding stops at the
token), never the system text now inside a user turn. The mask is checked token by token against
one written out here from the rendered text, and the text against transformers' own rendering.
"""

import importlib.util
from pathlib import Path

import pytest
from _chat_templates import GEMMA3, TEMPLATES

from ftlib.data import FormatConfig, Formatter, SkipReport, render_chat

SYSTEM, U1, A1, U2, A2 = "be brief", "why is the sky blue", "  because of Rayleigh scattering\n", "and red", "at dusk"
CONV = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": U1}, {"role": "assistant", "content": A1},
        {"role": "user", "content": U2}, {"role": "assistant", "content": A2}]
RENDERED = (f"<bos><start_of_turn>user\n{SYSTEM}\n\n{U1}<end_of_turn>\n<start_of_turn>model\n{A1.strip()}<end_of_turn>\n"
            f"<start_of_turn>user\n{U2}<end_of_turn>\n<start_of_turn>model\n{A2}<end_of_turn>\n")


def _formatter(tokenizer):
    return Formatter(tokenizer, FormatConfig(kind="chat", chat_template=GEMMA3, bos_token="<bos>", eos_token="<eos>"))


def test_template_is_the_hub_file():
    """The text equals the original Gemma-3 template TRL ships for identity checks against the hub
    (``trl/chat_templates/gemma3.jinja``, kept equal to google/gemma-3-* by TRL's CI), when TRL is installed."""
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        pytest.skip("trl is not installed")
    shipped = Path(spec.origin).parent / "chat_templates" / "gemma3.jinja"
    assert GEMMA3 == shipped.read_text(encoding="utf-8")


def test_rendering_folds_the_system_turn_and_equals_transformers(tokenizer):
    text = render_chat(CONV, GEMMA3, bos_token="<bos>", eos_token="<eos>", add_generation_prompt=False)
    assert text == RENDERED
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>")
    assert hf.apply_chat_template(CONV, chat_template=GEMMA3, tokenize=False) == text


def test_assistant_mask_token_by_token(tokenizer):
    doc = _formatter(tokenizer)({"messages": CONV}, "x:1", SkipReport())
    enc = tokenizer.encode(RENDERED, add_special_tokens=False)
    assert doc.input_ids.tolist() == enc.ids
    loss_spans = []  # character ranges of RENDERED that must carry loss: each answer and its <end_of_turn>
    pos = 0
    for answer in (A1.strip(), A2):
        start = RENDERED.index("<start_of_turn>model\n" + answer, pos) + len("<start_of_turn>model\n")
        pos = start + len(answer + "<end_of_turn>")
        loss_spans.append((start, pos))
    want = [int(any(s < e0 and e > s0 for s0, e0 in loss_spans)) for s, e in enc.offsets]
    assert doc.loss_mask.tolist() == want
    trained = [tokenizer.id_to_token(i) for i, m in zip(enc.ids, want) if m]
    assert trained.count("<end_of_turn>") == 2 and trained[-1] == "<end_of_turn>"
    untrained = tokenizer.decode([i for i, m in zip(enc.ids, want) if not m], skip_special_tokens=False)
    assert f"user\n{SYSTEM}\n\n{U1}<end_of_turn>" in untrained  # the folded system text: a prompt
    assert tokenizer.decode([enc.ids[-1]]) == "\n" and want[-1] == 0  # after the turn end: never generated


def test_turn_end_is_found_in_the_template(tokenizer):
    assert _formatter(tokenizer).turn_end == "<end_of_turn>"
    assert TEMPLATES["gemma3"][0] is GEMMA3


def test_a_list_content_is_refused_by_name(tokenizer):
    """The hub template also renders content lists (text / image items); ftlib trains on text turns and
    says so for the message at fault, it does not render a part of the list silently."""
    conv = [CONV[1], {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]
    report = SkipReport(strict=False)
    assert _formatter(tokenizer)({"messages": conv}, "x:7", report) is None
    assert report.examples["bad_field"] == ["x:7: bad_field: message 1 needs string 'role' and 'content'"]
