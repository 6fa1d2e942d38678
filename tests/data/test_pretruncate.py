"""Cutting over-long text before tokenizing: the kept tokens are those of the whole text."""


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.data import (
    FormatConfig,
    Formatter,
    SkipReport,
    pretruncate,
)
from ftlib.data.pairs import PairConfig, PairFormatter

WORDS = ("hello world the quick brown fox jumps over lazy dog because of Rayleigh scattering "
         "système über naïve café 42 3.14 (x) -- ! ?").split()


def _text(seed: int, n_chars: int) -> str:
    rng = np.random.default_rng(seed)
    out, n = [], 0
    while n < n_chars:
        w = str(rng.choice(WORDS)) + str(rng.choice([" ", " ", " ", "\n", ", "]))
        out.append(w)
        n += len(w)
    return "".join(out)


def _format(tokenizer, cfg, text):
    fmt = Formatter(tokenizer, cfg)
    doc = fmt({"text": text}, "f.jsonl:1", SkipReport())
    return doc, fmt.stats


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), max_length=st.integers(1, 48), over=st.floats(1.01, 3.0),
       truncation=st.sampled_from(["right", "prompt_left", "head_tail"]),
       head_tail=st.sampled_from([0.5, 0.0, 1.0, 0.3, 3]), add_bos=st.booleans(), sep=st.booleans())
def test_cut_text_gives_the_tokens_of_the_whole_text(tokenizer, seed, max_length, over, truncation, head_tail,
                                                     add_bos, sep):
    cfg = FormatConfig(kind="text", eos_token="</s>", bos_token="<s>", add_bos=add_bos, max_length=max_length,
                       truncation=truncation, head_tail=head_tail if truncation == "head_tail" else 0.5,
                       truncation_sep="<sep>" if sep and truncation == "head_tail" else None)
    bound = (max_length + 64) * pretruncate.CHARS_PER_TOKEN
    text = _text(seed, int(bound * over))
    doc, stats = _format(tokenizer, cfg, text)
    with pytest.MonkeyPatch.context() as m:  # the reference: the whole text tokenized
        m.setattr(pretruncate, "CHARS_PER_TOKEN", 10**9)
        ref, ref_stats = _format(tokenizer, cfg, text)
    assert "n_cut_before_tokenizing" not in ref_stats
    assert doc.input_ids.tolist() == ref.input_ids.tolist()
    assert doc.loss_mask.tolist() == ref.loss_mask.tolist()
    assert doc.truncated and ref.truncated
    assert len(text) > bound and stats["n_cut_before_tokenizing"] == 1
    assert stats["n_truncated"] == 1


@pytest.mark.parametrize("extra", [0, -1])
def test_text_within_the_bound_is_tokenized_whole(tokenizer, extra):
    """At or under the bound nothing changes: same tokens, same counters, nothing counted as cut."""
    cfg = FormatConfig(kind="text", eos_token="</s>", max_length=16, truncation="right")
    text = _text(0, 10_000)[: (16 + 64) * pretruncate.CHARS_PER_TOKEN + extra]
    doc, stats = _format(tokenizer, cfg, text)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert doc.input_ids.tolist() == ids[:16]
    assert stats == {"n_truncated": 1, "n_truncated_tokens": len(ids) + 1 - 16}


def test_no_max_length_means_no_cut(tokenizer):
    text = _text(1, 20_000)
    doc, stats = _format(tokenizer, FormatConfig(kind="text", eos_token="</s>"), text)
    assert doc.input_ids.tolist() == tokenizer.encode(text, add_special_tokens=False).ids + [tokenizer.token_to_id("</s>")]
    assert "n_cut_before_tokenizing" not in stats


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), max_length=st.integers(2, 40), prompt_len=st.sampled_from([None, 1, 0.5]),
       sizes=st.tuples(*[st.sampled_from([0.002, 0.5, 1.5, 3.0])] * 3), add_bos=st.booleans())
def test_pair_text_cut_gives_the_tokens_of_the_whole_text(tokenizer, seed, max_length, prompt_len, sizes, add_bos):
    """The pair formatter (kind='text') tokenizes only the prompt's tail and each response's head."""
    fp = None if prompt_len is None else max(1, min(max_length - 1, int(prompt_len * max_length)))
    cfg = PairConfig(kind="text", eos_token="</s>", bos_token="<s>", add_bos=add_bos, max_length=max_length,
                     max_prompt_length=fp)
    bound = (max_length + 64) * pretruncate.CHARS_PER_TOKEN
    rec = {f: _text(seed + k, max(8, int(bound * size))) for k, (f, size) in
           enumerate(zip(("prompt", "chosen", "rejected"), sizes))}

    def run():
        fmt = PairFormatter(tokenizer, cfg)
        rep = SkipReport(strict=False)
        return fmt(rec, "p.jsonl:1", rep), rep, fmt.stats

    doc, rep, stats = run()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pretruncate, "CHARS_PER_TOKEN", 10**9)
        ref, ref_rep, ref_stats = run()
    assert (doc is None) == (ref is None) and rep.to_dict() == ref_rep.to_dict()
    if doc is not None:
        assert doc.input_ids.tolist() == ref.input_ids.tolist() and doc.loss_mask.tolist() == ref.loss_mask.tolist()
        assert doc.extra == ref.extra and doc.truncated == ref.truncated
    assert stats.get("n_cut_before_tokenizing", 0) == sum(len(v) > bound for v in rec.values())


def test_long_text_is_cut_before_tokenizing(tmp_path, tokenizer):
    """A record far longer than max_length was tokenized whole before truncation (2.2 GB, 37 s for
    10 MB). Now the tokenizer sees a bounded prefix, the kept tokens are those of the whole text,
    and the cut is counted."""
    words = "hello world the quick brown fox jumps over the lazy dog".split()
    rng = np.random.default_rng(0)
    text = " ".join(rng.choice(words, 200_000))  # ~1 MB
    seen = []

    class Spy:  # the tokenizer, recording the longest text it was asked to encode
        def __init__(self, tok):
            self.tok = tok

        def encode(self, s, **kw):
            seen.append(len(s))
            return self.tok.encode(s, **kw)

        def __getattr__(self, name):
            return getattr(self.tok, name)

    cfg = FormatConfig(kind="text", eos_token="</s>", max_length=64, truncation="right")
    fmt = Formatter(Spy(tokenizer), cfg)
    doc = fmt({"text": text}, "big.jsonl:1", SkipReport())
    assert max(seen) <= (64 + 64) * 32 < len(text)
    assert doc.input_ids.tolist() == tokenizer.encode(text, add_special_tokens=False).ids[:64]
    assert doc.truncated and fmt.stats["n_cut_before_tokenizing"] == 1
    assert fmt.stats["n_cut_chars"] == len(text) - (64 + 64) * 32
