
import numpy as np
import pytest
from _chat_templates import TEMPLATES
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.data import (
    DataError,
    FormatConfig,
    Formatter,
    SkipReport,
    render_chat,
)

CONV = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "why is the sky blue"},
    {"role": "assistant", "content": "because of Rayleigh scattering"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": " the quick brown fox\n"},
]
CUSTOM = ("{% for message in messages %}{{ '[' + message['role'] + ']' }}{{ message['content'] }}"
          "{% if message['role'] == 'assistant' %}</s>{% endif %}\n{% endfor %}")


def _loss_chars(tok, text, doc):
    """Set of character positions of `text` covered by tokens that carry loss."""
    enc = tok.encode(text, add_special_tokens=False)
    assert enc.ids == doc.input_ids.tolist()  # the doc is exactly the encoding of the rendered text
    chars = set()
    for (a, b), m in zip(enc.offsets, doc.loss_mask.tolist()):
        if m:
            chars.update(range(a, b))
    return chars


def _expected_chars(text, pieces):
    """Positions of each (prefix, content+turn_end) found in order in `text`."""
    chars, pos = set(), 0
    for prefix, body in pieces:
        i = text.index(prefix + body, pos) + len(prefix)
        chars.update(range(i, i + len(body)))
        pos = i + len(body)
    return chars


@pytest.mark.parametrize("template,prefix,turn_end,strip", [
    ("chatml", "<|im_start|>assistant\n", "<|im_end|>", False),
    ("llama3", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>", True),
    (CUSTOM, "[assistant]", "</s>", False),
])
def test_chat_loss_mask_is_exactly_the_assistant_turns(tokenizer, template, prefix, turn_end, strip):
    cfg = FormatConfig(kind="chat", chat_template=template, bos_token="<s>", eos_token="</s>")
    doc = Formatter(tokenizer, cfg)({"messages": CONV}, "x:1", SkipReport())
    text = render_chat(CONV, template, bos_token="<s>", eos_token="</s>", add_generation_prompt=False)
    bodies = [(m["content"].strip() if strip else m["content"]) + turn_end for m in CONV if m["role"] == "assistant"]
    assert _loss_chars(tokenizer, text, doc) == _expected_chars(text, [(prefix, b) for b in bodies])
    # and read back as text: the loss tokens spell the assistant turns, nothing else
    decoded = tokenizer.decode([i for i, m in zip(doc.input_ids.tolist(), doc.loss_mask) if m], skip_special_tokens=False)
    assert decoded == "".join(bodies)


def test_loss_on_all_and_instruction_records(tokenizer):
    cfg = FormatConfig(kind="instruction", chat_template="chatml", prompt_field="q", response_field="a",
                       system_field="sys")
    rec = {"sys": "be brief", "q": "hello world", "a": "hi there"}
    doc = Formatter(tokenizer, cfg)(rec, "x:1", SkipReport())
    chat = Formatter(tokenizer, FormatConfig(kind="chat", chat_template="chatml"))(
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"},
                      {"role": "assistant", "content": "hi there"}]}, "x:1", SkipReport())
    assert np.array_equal(doc.input_ids, chat.input_ids) and np.array_equal(doc.loss_mask, chat.loss_mask)
    allcfg = FormatConfig(kind="instruction", chat_template="chatml", prompt_field="q", response_field="a",
                          system_field="sys", loss_on="all")
    assert Formatter(tokenizer, allcfg)(rec, "x:1", SkipReport()).loss_mask.all()


def test_text_kind_bos_eos(tokenizer):
    cfg = FormatConfig(kind="text", bos_token="<s>", eos_token="</s>", add_bos=True)
    doc = Formatter(tokenizer, cfg)({"text": "hello world"}, "x:1", SkipReport())
    body = tokenizer.encode("hello world", add_special_tokens=False).ids
    s, e = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    assert doc.input_ids.tolist() == [s, *body, e]
    assert doc.loss_mask.tolist() == [0] + [1] * len(body) + [1]
    with pytest.raises(ValueError, match="eos_token"):
        Formatter(tokenizer, FormatConfig(kind="text"))
    with pytest.raises(ValueError, match="not in the tokenizer vocabulary"):
        Formatter(tokenizer, FormatConfig(kind="text", eos_token="<nope>"))


@pytest.mark.parametrize("rec,reason", [
    ({"txt": "a"}, "missing_field"),
    ({"text": "   "}, "empty_document"),
    ({"text": 3}, "bad_field"),
])
def test_bad_text_records(tokenizer, rec, reason):
    fmt = Formatter(tokenizer, FormatConfig(kind="text", eos_token="</s>"))
    with pytest.raises(DataError, match=f"f.jsonl:7: {reason}"):
        fmt(rec, "f.jsonl:7", SkipReport())
    rep = SkipReport(strict=False)
    assert fmt(rec, "f.jsonl:7", rep) is None and rep.counts == {reason: 1}


@pytest.mark.parametrize("rec,reason", [
    ({"msgs": []}, "missing_field"),
    ({"messages": "hi"}, "bad_field"),
    ({"messages": [{"role": "user"}]}, "bad_field"),
    ({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": " "}]}, "empty_document"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no_loss_tokens"),
])
def test_bad_chat_records(tokenizer, rec, reason):
    fmt = Formatter(tokenizer, FormatConfig(kind="chat", chat_template="chatml"))
    rep = SkipReport(strict=False)
    assert fmt(rec, "c.jsonl:3", rep) is None and rep.counts == {reason: 1}
    assert rep.examples[reason][0].startswith("c.jsonl:3")


def test_truncation_cuts_prompt_from_the_left_first(tokenizer):
    base = dict(kind="instruction", chat_template="chatml")
    rec = {"prompt": "the quick brown fox jumps over the lazy dog " * 3, "response": "because of Rayleigh scattering"}
    full = Formatter(tokenizer, FormatConfig(**base))(rec, "x:1", SkipReport())
    n_resp = int(full.loss_mask.sum())
    L = n_resp + 5
    fmt = Formatter(tokenizer, FormatConfig(**base, max_length=L))
    doc = fmt(rec, "x:1", SkipReport())
    assert doc.truncated and len(doc.input_ids) == L and fmt.n_truncated == 1
    # every response token survives; the prompt kept is the *last* 5 prompt tokens
    assert np.array_equal(doc.input_ids[doc.loss_mask == 1], full.input_ids[full.loss_mask == 1])
    assert np.array_equal(doc.input_ids[doc.loss_mask == 0], full.input_ids[full.loss_mask == 0][-5:])
    # a limit below the response length: prompt gone, response cut on the right
    short = Formatter(tokenizer, FormatConfig(**base, max_length=3))(rec, "x:1", SkipReport())
    assert short.loss_mask.all() and np.array_equal(short.input_ids, full.input_ids[full.loss_mask == 1][:3])
    right = Formatter(tokenizer, FormatConfig(**base, max_length=L, truncation="right"))(rec, "x:1", SkipReport())
    assert np.array_equal(right.input_ids, full.input_ids[:L])


@pytest.mark.filterwarnings("ignore:chat template")  # the probe for the turn end fails the same way
def test_template_is_sandboxed(tokenizer):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    fmt = Formatter(tokenizer, FormatConfig(kind="chat", chat_template=evil))
    with pytest.raises(DataError, match="template_error"):
        fmt({"messages": [{"role": "assistant", "content": "hi"}]}, "x:1", SkipReport())


def _is_window(part: np.ndarray, whole: np.ndarray) -> bool:
    n = len(part)
    return any(np.array_equal(whole[k : k + n], part) for k in range(len(whole) - n + 1))


@pytest.mark.parametrize("max_length", [12, 20, 26])
def test_truncating_a_multi_turn_chat_keeps_one_contiguous_window(tokenizer, max_length):
    """Cutting the prompt from the left never deletes tokens from the middle (a later user turn)."""
    rec = {"messages": [{"role": "user", "content": "why is the sky blue"},
                        {"role": "assistant", "content": "because of Rayleigh scattering"},
                        {"role": "user", "content": "the quick brown fox jumps over the lazy dog"},
                        {"role": "assistant", "content": "hello world"}]}
    cfg = dict(kind="chat", chat_template="chatml")
    full = Formatter(tokenizer, FormatConfig(**cfg))(rec, "x:1", SkipReport())
    lead = int(np.argmax(full.loss_mask))  # prompt tokens before the first response token
    assert len(full.input_ids) - max_length > lead  # cutting only the leading prompt is not enough
    doc = Formatter(tokenizer, FormatConfig(**cfg, max_length=max_length))(rec, "x:1", SkipReport())
    assert len(doc.input_ids) == max_length and _is_window(doc.input_ids, full.input_ids)
    # the leading prompt went first: the window starts at the first response token
    assert np.array_equal(doc.input_ids, full.input_ids[lead : lead + max_length])
    assert np.array_equal(doc.loss_mask, full.loss_mask[lead : lead + max_length])


@pytest.mark.parametrize("kind,rec", [
    ("chat", {"messages": [{"role": "user", "content": "why is the sky blue"}, {"role": "assistant", "content": ""}]}),
    ("instruction", {"prompt": "why is the sky blue", "response": "  \n"}),
])
def test_empty_response_is_reported_not_trained_on(tokenizer, kind, rec):
    """A blank answer would train the model to stop at once (only the turn end carries loss)."""
    fmt = Formatter(tokenizer, FormatConfig(kind=kind, chat_template="chatml"))
    with pytest.raises(DataError, match="r.jsonl:4: empty_response"):
        fmt(rec, "r.jsonl:4", SkipReport())
    rep = SkipReport(strict=False)
    assert fmt(rec, "r.jsonl:4", rep) is None and rep.counts == {"empty_response": 1}
    # with loss on every token the record still has something to teach
    assert Formatter(tokenizer, FormatConfig(kind=kind, chat_template="chatml", loss_on="all"))(
        rec, "r.jsonl:4", SkipReport()) is not None


def test_special_token_ids_outside_the_vocabulary_are_refused(tokenizer):
    """An int id past the vocabulary would wrap silently when stored as uint16 in the cache."""
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    with pytest.raises(ValueError, match=rf"FormatConfig.eos_token={n + 65536} is not a token id \(vocabulary of {n}\)"):
        Formatter(tokenizer, FormatConfig(kind="text", eos_token=n + 65536))
    with pytest.raises(ValueError, match="bos_token=-1"):
        Formatter(tokenizer, FormatConfig(kind="text", eos_token=3, bos_token=-1, add_bos=True))
    assert Formatter(tokenizer, FormatConfig(kind="text", eos_token=n - 1)).eos_id == n - 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=2, max_size=40), st.integers(1, 40), st.booleans())
def test_prompt_left_truncation_invariants(tokenizer, loss, max_length, bos):
    """Invariants: one window after the BOS; the leading prompt goes before any loss token; fits the limit."""
    fmt = Formatter(tokenizer, FormatConfig(kind="text", eos_token="</s>", bos_token="<s>", max_length=max_length))
    ids = np.arange(100, 100 + len(loss), dtype=np.int64)
    mask = np.asarray(loss, dtype=np.uint8)
    if bos:
        ids[0], mask[0] = fmt.bos_id, 0
    if len(ids) <= max_length:
        return
    got, got_mask, _ = fmt._truncate(ids, mask)
    first = int(bos)
    assert len(got) == max_length and np.array_equal(got[:first], ids[:first])
    body = got[first:]
    if not len(body):  # max_length 1 keeps the BOS alone
        return
    k = int(body[0] - ids[first])  # window start (token values are positions)
    assert np.array_equal(body, ids[first + k : first + k + len(body)])
    assert np.array_equal(got_mask[first:], mask[first + k : first + k + len(body)])
    assert not mask[first : first + k].any()  # only no-loss tokens were cut on the left
    lead = int(np.argmax(mask[first:] != 0)) if mask[first:].any() else len(ids) - first
    if k < lead:  # the leading prompt was not used up: nothing was cut on the right
        assert first + k + len(body) == len(ids)


# ---- turn end ------------------------------------------------------------------------------------
def test_turn_end_is_read_from_any_template(tokenizer):
    from _chat_templates import TEMPLATES

    from ftlib.data import detect_turn_end

    for name, (template, bos, eos, _, turn_end, _) in TEMPLATES.items():
        found, rendered = detect_turn_end(template, tokenizer, bos or "", eos or "")
        assert found == turn_end, (name, found, rendered)
    # the newline after <|im_end|> is never generated (decoding stops at the token): no loss on it
    assert detect_turn_end("chatml", tokenizer) == ("<|im_end|>", "<|im_end|>\n")
    # every token the template writes before the next turn, up to the last special one, is the turn end
    two = "{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] }}<|end|>\n{{ eos_token }}\n{% endfor %}"
    assert detect_turn_end(two, tokenizer, eos_token="</s>") == ("<|end|>\n</s>", "<|end|>\n</s>\n")


def test_no_turn_end_warns_once_and_explicit_turn_end_wins(tokenizer):
    bare = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.warns(UserWarning, match="no turn end found.*will not learn to stop"):
        fmt = Formatter(tokenizer, FormatConfig(kind="chat", chat_template=bare))
    assert fmt.turn_end is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # add_eos gives the answer an end: no warning
        Formatter(tokenizer, FormatConfig(kind="chat", chat_template=bare, eos_token="</s>", add_eos=True))
    # an explicit turn end that the template does write: it gets loss
    tmpl = "{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}<|end|>\n{% endfor %}"
    fmt = Formatter(tokenizer, FormatConfig(kind="chat", chat_template=tmpl, turn_end="<|end|>\n"))
    doc = fmt({"messages": CONV[1:3]}, "x:1", SkipReport())
    loss = tokenizer.decode([i for i, m in zip(doc.input_ids.tolist(), doc.loss_mask) if m], skip_special_tokens=False)
    assert loss == CONV[2]["content"] + "<|end|>\n"
    with pytest.warns(UserWarning, match="does not follow the assistant's content"):
        Formatter(tokenizer, FormatConfig(kind="chat", chat_template=tmpl, turn_end="<|im_end|>"))


def test_a_template_without_jinja_tags_is_refused(tokenizer):
    with pytest.raises(ValueError, match="neither a built-in name"):
        render_chat(CONV, "llama-3")
    with pytest.raises(ValueError, match=r"did you mean 'llama3'"):
        FormatConfig(kind="instruction", chat_template="llama_3")


# ---- head + tail truncation ----------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(st.integers(2, 60), st.integers(1, 40), st.booleans(), st.booleans(),
       st.one_of(st.floats(0, 1), st.integers(0, 45)), st.lists(st.booleans(), min_size=60, max_size=60))
def test_head_tail_truncation_properties(tokenizer, n, max_length, bos, sep, head_tail, loss):
    """Length bound; the first h and last t tokens kept in place; masks aligned with the kept tokens;
    the separator and the first token after the cut carry no loss."""
    cfg = FormatConfig(kind="text", eos_token="</s>", bos_token="<s>", max_length=max_length, truncation="head_tail",
                       head_tail=head_tail, truncation_sep="<sep>" if sep else None)
    fmt = Formatter(tokenizer, cfg)
    ids = np.arange(100, 100 + n, dtype=np.int64)  # token values are positions + 100
    mask = np.asarray(loss[:n], dtype=np.uint8)
    if bos:
        ids[0], mask[0] = fmt.bos_id, 0
    if n <= max_length:
        return
    got, got_mask, n_sep = fmt._truncate(ids, mask)
    assert len(got) == max_length == len(got_mask)  # the bound, met exactly
    first = int(bos)
    assert np.array_equal(got[:first], ids[:first])
    body, bmask = got[first:], got_mask[first:]
    is_sep = body == fmt.sep_id
    assert n_sep == int(is_sep.sum()) <= 1
    orig = np.where(is_sep, -1, body - 100)  # position of each kept token in the original
    kept = orig[~is_sep]
    assert (np.diff(kept) > 0).all()  # order kept, nothing duplicated
    gaps = np.flatnonzero(np.diff(kept) > 1)
    assert len(gaps) <= 1  # one cut: a head and a tail
    head = kept[: gaps[0] + 1] if len(gaps) else kept
    tail = kept[gaps[0] + 1 :] if len(gaps) else kept[:0]
    if len(kept):
        assert head[0] == first or (not len(tail) and kept[-1] == n - 1)  # a head starts at the start...
    if len(tail):
        assert tail[-1] == n - 1  # ...and a tail ends at the end
        region = max_length - first - n_sep
        h = round(region * head_tail) if isinstance(head_tail, float) else min(head_tail, region)
        assert len(head) == h and len(tail) == region - h
    if n_sep:
        assert len(tail) and np.flatnonzero(is_sep)[0] == len(head)  # the separator sits in the gap
    # masks: each kept token keeps its mask, except the separator and the first token after the cut
    j = np.flatnonzero(~is_sep)
    want = mask[kept].copy()
    if len(tail):
        want[len(head)] = 0
    assert np.array_equal(bmask[j], want) and not bmask[is_sep].any()


def test_head_tail_keeps_the_response_of_a_chat_record(tokenizer):
    """For chat the middle of an over-long prompt goes; the response stays whole; stats count it."""
    rec = {"prompt": "the quick brown fox jumps over the lazy dog " * 4, "response": "because of Rayleigh scattering"}
    base = dict(kind="instruction", chat_template="chatml")
    full = Formatter(tokenizer, FormatConfig(**base))(rec, "x:1", SkipReport())
    lead = int(np.argmax(full.loss_mask))
    L = len(full.input_ids) - lead // 2
    fmt = Formatter(tokenizer, FormatConfig(**base, max_length=L, truncation="head_tail", head_tail=6,
                                            truncation_sep="<sep>"))
    doc = fmt(rec, "x:1", SkipReport())
    sep = tokenizer.token_to_id("<sep>")
    assert len(doc.input_ids) == L and doc.truncated
    i = doc.input_ids.tolist().index(sep)
    assert i == 6 and np.array_equal(doc.input_ids[:6], full.input_ids[:6])  # the head: 6 tokens
    n_tail = L - 7
    assert np.array_equal(doc.input_ids[7:], full.input_ids[-n_tail:])  # the prompt's end + the whole response
    assert np.array_equal(doc.loss_mask[7:], full.loss_mask[-n_tail:]) and doc.loss_mask[i] == 0
    assert fmt.stats == {"n_truncated": 1, "n_truncated_tokens": len(full.input_ids) - (L - 1)}
    # a limit the prompt cannot absorb: as prompt_left (prompt gone, response cut on the right)
    short = Formatter(tokenizer, FormatConfig(**base, max_length=3, truncation="head_tail"))(rec, "x:1", SkipReport())
    assert np.array_equal(short.input_ids, full.input_ids[full.loss_mask == 1][:3])


def test_head_tail_settings_are_checked(tokenizer):
    with pytest.raises(ValueError, match="head_tail must be"):
        FormatConfig(kind="text", truncation="head_tail", head_tail=1.5)
    with pytest.raises(ValueError, match="head_tail must be"):
        FormatConfig(kind="text", truncation="head_tail", head_tail=True)
    with pytest.raises(ValueError, match="truncation_sep applies to truncation='head_tail'"):
        FormatConfig(kind="text", truncation_sep="<sep>")
    with pytest.raises(ValueError, match="truncation_sep='<nope>' is not in the tokenizer vocabulary"):
        Formatter(tokenizer, FormatConfig(kind="text", eos_token="</s>", truncation="head_tail", truncation_sep="<nope>"))


# ---- chat roles (unknown refused or counted; tool / function where the template shows them) -------
def test_unknown_role_is_refused_in_strict_mode_and_counted_in_lenient_mode(tokenizer):
    """A misspelled role ("usr") used to be rendered and trained as if it were a real turn."""
    fmt = Formatter(tokenizer, FormatConfig(kind="chat", chat_template="chatml"))
    rec = {"messages": [{"role": "usr", "content": "hello world"}, {"role": "assistant", "content": "hi there"}]}
    with pytest.raises(DataError, match=r"f\.jsonl:7: unknown_role: message 0 has role 'usr', not one of system, "
                                        r"user, assistant, tool, function \(FormatConfig.roles\)"):
        fmt(rec, "f.jsonl:7", SkipReport())
    report = SkipReport(strict=False)
    assert fmt(rec, "f.jsonl:7", report) is None
    assert report.counts == {"unknown_role": 1} and "message 0 has role 'usr'" in report.examples["unknown_role"][0]
    # a role the data legitimately uses can be allowed explicitly
    custom = Formatter(tokenizer, FormatConfig(kind="chat", chat_template="chatml", roles=("usr", "assistant")))
    assert custom(rec, "f.jsonl:7", SkipReport()) is not None
    with pytest.raises(ValueError, match="must include 'assistant'"):
        FormatConfig(kind="chat", chat_template="chatml", roles=("user",))


def test_tool_results_are_rendered_where_the_template_shows_them(tokenizer):
    conv = [{"role": "user", "content": "why is the sky blue"}, {"role": "assistant", "content": "hello world"},
            {"role": "tool", "content": "Rayleigh scattering"}, {"role": "assistant", "content": "because of it"}]
    doc = Formatter(tokenizer, FormatConfig(kind="chat", chat_template="chatml"))({"messages": conv}, "x:1",
                                                                                  SkipReport())
    text = render_chat(conv, "chatml")
    assert "<|im_start|>tool\nRayleigh scattering<|im_end|>" in text
    assert tokenizer.decode(doc.input_ids.tolist(), skip_special_tokens=False) == text
    loss = tokenizer.decode([i for i, m in zip(doc.input_ids.tolist(), doc.loss_mask) if m], skip_special_tokens=False)
    assert loss == "hello world<|im_end|>because of it<|im_end|>"  # the tool result is context, not a target
    # a template with only user / assistant branches would drop the tool result silently: refused instead
    drops = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
             "{% elif m['role'] == 'assistant' %} {{ m['content'] }}</s>{% endif %}{% endfor %}")
    fmt = Formatter(tokenizer, FormatConfig(kind="chat", chat_template=drops))
    with pytest.raises(DataError, match=r"unsupported_role: the chat template shows 0 of the 1 tool/function "
                                        r"results \(first: message 2, role 'tool'\)"):
        fmt({"messages": conv}, "x:1", SkipReport())
    report = SkipReport(strict=False)
    assert fmt({"messages": conv}, "x:1", report) is None and report.counts == {"unsupported_role": 1}
    assert fmt({"messages": [conv[0], conv[1]]}, "x:1", report) is not None  # without a tool turn: fine


# ---- rendering bounds (time, size) and reasons ----------------------------------------------------
LOOP_ON_DEMAND = ("{% if messages[0]['content'] == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}x"
                  "{% endfor %}{% endfor %}{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")


def test_a_looping_template_is_stopped_per_record_and_says_why(tokenizer):
    cfg = FormatConfig(kind="chat", chat_template=LOOP_ON_DEMAND, template_max_seconds=0.3)
    fmt = Formatter(tokenizer, cfg)
    rec = {"messages": [{"role": "user", "content": "loop"}, {"role": "assistant", "content": "hi"}]}
    with pytest.raises(DataError, match=r"f\.jsonl:3: template_error: TemplateLimitError: chat template rendering "
                                        r"exceeded max_seconds=0\.3"):
        fmt(rec, "f.jsonl:3", SkipReport())
    report = SkipReport(strict=False)
    assert fmt(rec, "f.jsonl:3", report) is None and report.counts == {"template_error": 1}
    ok = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}
    assert fmt(ok, "f.jsonl:4", report) is not None
    # a template that loops on every conversation is refused when the formatter is built
    from ftlib.data import TemplateLimitError

    forever = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + CUSTOM
    with pytest.raises(TemplateLimitError, match="probe conversation: .*max_seconds=0.2"):
        Formatter(tokenizer, FormatConfig(kind="chat", chat_template=forever, template_max_seconds=0.2))


@pytest.mark.parametrize("template,what", [
    ("{{ 'x' * 10**10 }}", r"'\*' would build 10000000000 characters"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "'~' would build 131072 characters"),
    ("{% set s = 'x' * 60000 %}{{ ([s] * 100) | join }}", r"'\*' would build 6000100 characters"),
    ("{{ 'x' | center(10**9) }}", "filter 'center': argument 1000000000 is over max_chars"),
    ("{{ 'x'.ljust(10**9) }}", "argument 1000000000 is over max_chars"),
    ("{{ '%0999999999d' % 1 }}", "format width 0999999999"),
    ("{{ '{:>999999999}'.format(1) }}", "format width 999999999"),
    ("{% set s = 'x' * 60000 %}{{ s.replace('x', 'yyyy') }}", "str.replace would build 240000 characters"),
    ("{{ 10 ** 100000000 }}", r"'\*\*' would build an integer"),
    ("{% for i in range(100) %}{{ 'x' * 5000 }}{% endfor %}", "output would build 105000 characters"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s %}{{ ns.s }}{{ ns.s }}{% endset %}"
     "{% endfor %}", "'{% set %}' block would build 131072 characters"),
    ("{% set ns = namespace(s=['ab']) %}{% for i in range(40) %}{% set ns.s = [ns.s, ns.s] %}{% endfor %}",
     "'{% set %}' would build 1"),
])
def test_templates_cannot_build_huge_values(template, what):
    """Each of these would allocate gigabytes (or run for minutes); refused before it allocates more
    than a few times max_chars."""
    from ftlib.data import TemplateLimitError

    with pytest.raises(TemplateLimitError, match=what):
        render_chat(CONV, template, max_chars=100_000)


def test_a_template_error_always_says_why(tokenizer):
    """A MemoryError has an empty message: the record's reason used to be empty."""
    from ftlib.data import TemplateLimitError

    def boom():
        raise MemoryError

    with pytest.raises(TemplateLimitError, match="chat template ran out of memory while rendering"):
        render_chat(CONV, "{{ boom() }}", boom=boom)
    tmpl = "{% if messages[0]['content'] == 'boom' %}{{ raise_exception('') }}{% endif %}" + CUSTOM
    fmt = Formatter(tokenizer, FormatConfig(kind="chat", chat_template=tmpl))
    report = SkipReport(strict=False)
    fmt({"messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "hi"}]}, "f:1", report)
    assert report.examples["template_error"] == ["f:1: template_error: TemplateError"]


TEXT = FormatConfig(kind="text", eos_token="</s>")


TURNS = [
    {"role": "user", "content": "why is the sky blue"},
    {"role": "assistant", "content": "because of Rayleigh scattering"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the quick brown fox"},
]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_turn_end_carries_loss_with_template_text(tokenizer, name):
    """The template as text (tokenizer_config.json), not a built-in name: the end-of-turn token after
    each answer must be in the loss, else the model never learns to stop."""
    template, bos, eos, prefix, turn_end, strip = TEMPLATES[name]
    fmt = Formatter(tokenizer, FormatConfig(kind="chat", chat_template=template, bos_token=bos, eos_token=eos))
    doc = fmt({"messages": TURNS}, "x:1", SkipReport())
    got = tokenizer.decode([i for i, m in zip(doc.input_ids.tolist(), doc.loss_mask) if m], skip_special_tokens=False)
    print(name, repr(got))
    # expected: the tokens that overlap "content + turn end" of each answer in the rendered text
    from ftlib.data import render_chat

    text = render_chat(TURNS, template, bos_token=bos or "", eos_token=eos or "", add_generation_prompt=False)
    enc = tokenizer.encode(text, add_special_tokens=False)
    assert enc.ids == doc.input_ids.tolist()
    want, pos = np.zeros(len(enc.ids), np.uint8), 0
    for m in TURNS:
        if m["role"] == "assistant":
            body = (m["content"].strip() if strip else m["content"]) + turn_end
            a = text.index(prefix + body, pos) + len(prefix)
            pos = a + len(body)
            want |= np.array([s < pos and e > a for s, e in enc.offsets], np.uint8)
    assert doc.loss_mask.tolist() == want.tolist()
    assert got.count(turn_end) == 2 and got.endswith(turn_end)


def test_tokenizer_builtin_truncation_does_not_cut_documents(tokenizer):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.enable_truncation(max_length=4)
    text = {"text": "the quick brown fox jumps over the lazy dog"}
    full = Formatter(tokenizer, TEXT)(text, "x:1", SkipReport())
    with pytest.warns(UserWarning, match="truncation"):
        fmt = Formatter(tok, TEXT)
    assert fmt(text, "x:1", SkipReport()).input_ids.tolist() == full.input_ids.tolist()


def test_one_empty_assistant_turn_among_others_is_reported(tokenizer):
    rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello world"},
                        {"role": "user", "content": "why"}, {"role": "assistant", "content": ""}]}
    fmt = Formatter(tokenizer, FormatConfig(kind="chat", chat_template="chatml"))
    with pytest.raises(DataError, match="x:3: empty_response"):
        fmt(rec, "x:3", SkipReport())


def test_instruction_field_of_the_wrong_type_is_named(tokenizer):
    """An instruction record with prompt: 5 blamed "message 0"."""
    fmt = Formatter(tokenizer, FormatConfig(kind="instruction", chat_template="chatml"))
    with pytest.raises(DataError, match=r"d\.jsonl:3: bad_field: field 'prompt' is int, not a string"):
        fmt({"prompt": 5, "response": "hi"}, "d.jsonl:3", SkipReport())
    rep = SkipReport(strict=False)
    assert fmt({"prompt": "hi", "response": ["a"]}, "d.jsonl:4", rep) is None
    assert rep.examples["bad_field"] == ["d.jsonl:4: bad_field: field 'response' is list, not a string"]
