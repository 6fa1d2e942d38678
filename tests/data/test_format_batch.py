"""Batched chat formatting: one render per record where the template allows it, one encode_batch per chunk.

The documents, masks and skip reports must be those of the two-render, per-record path."""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib._jinja import content_passthrough, template_text
from ftlib.data import DataError, FormatConfig, Formatter, SkipReport

GENERATION = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
              "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
              "{{ '\\n' }}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}")
CUSTOM = ("{% for message in messages %}{{ '[' + message['role'] + ']' }}{{ message['content'] }}"
          "{% if message['role'] == 'assistant' %}</s>{% endif %}\n{% endfor %}")
LOOP = "{% for m in messages %}"


@pytest.mark.parametrize("template,expected", [
    ("chatml", True),
    (GENERATION, True),
    (CUSTOM, True),
    (LOOP + "{% if loop.first and m.role == 'system' %}S{% endif %}{{ m.content }}{% endfor %}", True),
    ("llama3", False),  # | trim
    (LOOP + "{% if m.content %}{{ m.content }}{% endif %}{% endfor %}", False),  # a test on the content
    (LOOP + "{{ m.content ~ '!' }}{% endfor %}", False),
    (LOOP + "{{ m.get('content') }}{% endfor %}", False),
    (LOOP + "{{ m }}{% endfor %}", False),
    (LOOP + "{{ loop.previtem.content if loop.previtem }}{{ m.content }}{% endfor %}", False),
    (LOOP + "{% filter upper %}{{ m.content }}{% endfilter %}{% endfor %}", False),
    (LOOP + "{% set x %}{{ m.content }}{% endset %}{{ x }}{% endfor %}", False),
    (LOOP + "{% set m = {'content': 'x'} %}{{ m.content }}{% endfor %}", False),
    ("{{ messages[0].content }}" + LOOP + "{{ m.content }}{% endfor %}", False),
    ("{% if messages | length %}" + LOOP + "{{ m.content }}{% endfor %}{% endif %}", False),
    ("{% macro f(m) %}{{ m.content }}{% endmacro %}" + LOOP + "{{ f(m) }}{% endfor %}", False),
])
def test_content_passthrough_is_conservative(template, expected):
    assert content_passthrough(template) is expected


def _docs(fmt, recs, report):
    return [(w, d) for w, d in fmt.format_batch(((r, f"x:{i + 1}") for i, r in enumerate(recs)), report)]


def _same(a, b):
    assert [w for w, _ in a] == [w for w, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.input_ids.dtype == y.input_ids.dtype == np.int64 and x.loss_mask.dtype == y.loss_mask.dtype
            assert x.input_ids.tolist() == y.input_ids.tolist() and x.loss_mask.tolist() == y.loss_mask.tolist()


WORDS = ["hello", "world", " ", "\n", "  sky", "blue ", "naïve", "café", "<|im_end|>", "</s>", "fox", "", "é"]
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                 "content": st.lists(st.sampled_from(WORDS), max_size=6).map("".join)})


@settings(max_examples=60, deadline=None)
@given(convs=st.lists(st.lists(message, min_size=1, max_size=5), min_size=1, max_size=6),
       template=st.sampled_from(["chatml", GENERATION, CUSTOM]), loss_on=st.sampled_from(["assistant", "all"]),
       max_length=st.sampled_from([None, 9]))
def test_one_render_and_batches_give_the_two_render_documents(tokenizer, convs, template, loss_on, max_length):
    # the same template behind a use of `messages` outside its loop: not passthrough, so rendered twice
    twice = "{% if messages | length > 0 %}" + template_text(template) + "{% endif %}"
    assert content_passthrough(template) and not content_passthrough(twice)
    recs = [{"messages": c} for c in convs] + [{"messages": "oops"}, {"nope": 1}]
    out = {}
    for t in (template, twice):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = FormatConfig(kind="chat", chat_template=t, loss_on=loss_on, max_length=max_length,
                               eos_token="</s>", add_eos=max_length is not None)
            per_record, batched = Formatter(tokenizer, cfg), Formatter(tokenizer, cfg)
        r1, r2 = SkipReport(strict=False), SkipReport(strict=False)
        one = [(f"x:{i + 1}", per_record(r, f"x:{i + 1}", r1)) for i, r in enumerate(recs)]
        many = _docs(batched, recs, r2)
        _same(one, many)
        assert r1.to_dict() == r2.to_dict() and per_record.stats == batched.stats
        out[t] = (many, r2.to_dict())
    _same(out[template][0], out[twice][0])
    assert out[template][1] == out[twice][1]


def test_strict_batches_raise_the_first_problem_in_record_order(tokenizer):
    # the third message (an assistant turn) is not shown: record 2 has no loss tokens, found only after encoding
    shows_two = ("{% for m in messages %}{% if loop.index0 < 2 %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endif %}{% endfor %}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fmt = Formatter(tokenizer, FormatConfig(kind="chat", chat_template=shows_two))
    good = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]}
    no_loss = {"messages": [{"role": "user", "content": "hello"}, {"role": "user", "content": "sky"},
                            {"role": "assistant", "content": "blue"}]}
    bad = {"messages": [{"role": "user"}]}
    with pytest.raises(DataError, match=r"^x:2: no_loss_tokens"):
        _docs(fmt, [good, no_loss, bad], SkipReport(strict=True))
    with pytest.raises(DataError, match=r"^x:2: bad_field"):
        _docs(fmt, [good, bad, no_loss], SkipReport(strict=True))
    report = SkipReport(strict=False)
    docs = _docs(fmt, [good, no_loss, bad, good], report)
    assert [d is None for _, d in docs] == [False, True, True, False]
    assert report.counts == {"no_loss_tokens": 1, "bad_field": 1}
