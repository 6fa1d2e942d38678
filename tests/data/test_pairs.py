"""Pair data: record conventions, response-only loss masks, the truncation policy, the pair cache."""

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.data import CacheError, DataError, FormatConfig, SkipReport, build_cache, render_chat
from ftlib.data.pairs import (
    CHOSEN_BIT,
    LOSS_BIT,
    REJECTED_BIT,
    PairCache,
    PairConfig,
    PairFormatter,
    build_pair_cache,
    open_pair_cache,
)

CFG = PairConfig(chat_template="chatml", eos_token="</s>")


def _fmt(tokenizer, cfg=CFG):
    return PairFormatter(tokenizer, cfg)


def _score(doc, name):
    """A score column of a PairDoc: float64 carried as its int64 bit pattern (the cache's columns are int64)."""
    return float(np.int64(doc.extra[name]).view(np.float64))


def _split(tokenizer, doc):
    """(prompt text, chosen text, chosen loss text, rejected text, rejected loss text) of a PairDoc."""
    ids, flags = doc.input_ids, doc.loss_mask
    dec = lambda sel: tokenizer.decode(ids[sel].tolist(), skip_special_tokens=False)
    return (dec(flags == 0), dec((flags & CHOSEN_BIT) != 0), dec(flags == CHOSEN_BIT | LOSS_BIT),
            dec((flags & REJECTED_BIT) != 0), dec(flags == REJECTED_BIT | LOSS_BIT))


def test_string_pair_chat_masks_only_the_response(tokenizer):
    doc = _fmt(tokenizer)({"prompt": "why is the sky blue", "chosen": "because of Rayleigh scattering",
                           "rejected": "hello world"}, "f.jsonl:1", SkipReport())
    prompt, chosen, chosen_loss, rejected, rejected_loss = _split(tokenizer, doc)
    # the prompt is exactly what generation would be given: the template's generation prompt
    assert prompt == render_chat([{"role": "user", "content": "why is the sky blue"}], "chatml",
                                 add_generation_prompt=True)
    assert chosen_loss == "because of Rayleigh scattering<|im_end|>" and chosen == chosen_loss + "\n"
    assert rejected_loss == "hello world<|im_end|>"
    e = doc.extra
    assert (e["prompt_len"], e["chosen_len"], e["rejected_len"]) == (
        int((doc.loss_mask == 0).sum()), int((doc.loss_mask & CHOSEN_BIT).astype(bool).sum()),
        int((doc.loss_mask & REJECTED_BIT).astype(bool).sum()))
    assert np.isnan(_score(doc, "reward_chosen")) and np.isnan(_score(doc, "margin")) and not doc.truncated
    assert sorted(e) == sorted(PairConfig.columns) and all(isinstance(v, int) for v in e.values())


def test_conventions_give_the_same_document(tokenizer):
    """prompt string, messages list, full conversations repeating the prompt, and the implicit-prompt
    convention (no prompt field) all describe the same pair."""
    user = {"role": "user", "content": "user asks why"}
    good, bad = {"role": "assistant", "content": "because of Rayleigh scattering"}, {"role": "assistant", "content": "hi"}
    records = [
        {"prompt": "user asks why", "chosen": good["content"], "rejected": "hi"},
        {"messages": [user], "chosen": [good], "rejected": [bad]},
        {"prompt": [user], "chosen": [user, good], "rejected": [user, bad]},
        {"chosen": [user, good], "rejected": [user, bad]},
    ]
    docs = [_fmt(tokenizer)(r, f"f:{i}", SkipReport()) for i, r in enumerate(records)]
    for d in docs[1:]:
        assert np.array_equal(d.input_ids, docs[0].input_ids) and np.array_equal(d.loss_mask, docs[0].loss_mask)


def test_multi_turn_prompt_assistant_turns_carry_no_loss(tokenizer):
    msgs = [{"role": "system", "content": "the quick brown fox"}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "why"}]
    cfg = PairConfig(chat_template="llama3", bos_token="<s>", eos_token="</s>")
    doc = _fmt(tokenizer, cfg)({"messages": msgs, "chosen": "because", "rejected": "hello world"}, "f:1", SkipReport())
    prompt, _, chosen_loss, _, rejected_loss = _split(tokenizer, doc)
    assert prompt.startswith("<s><|start_header_id|>system") and "hi there<|eot_id|>" in prompt
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert chosen_loss == "because<|eot_id|>" and rejected_loss == "hello world<|eot_id|>"
    assert doc.loss_mask[: doc.extra["prompt_len"]].max() == 0


def test_system_field_and_rewards(tokenizer):
    cfg = PairConfig(chat_template="chatml", eos_token="</s>", system_field="system",
                     reward_chosen_field="score_chosen", reward_rejected_field="score_rejected")
    doc = _fmt(tokenizer, cfg)({"system": "the quick brown fox", "prompt": "why", "chosen": "because",
                                "rejected": "hi", "score_chosen": 7, "score_rejected": 2.5, "margin": None},
                               "f:1", SkipReport())
    assert _split(tokenizer, doc)[0].startswith("<|im_start|>system\nthe quick brown fox<|im_end|>")
    assert _score(doc, "reward_chosen") == 7.0 and _score(doc, "reward_rejected") == 2.5
    assert np.isnan(_score(doc, "margin"))


def test_text_kind(tokenizer):
    cfg = PairConfig(kind="text", bos_token="<s>", eos_token="</s>", add_bos=True)
    doc = _fmt(tokenizer, cfg)({"prompt": "the sky is", "chosen": " blue", "rejected": " lazy"}, "f:1", SkipReport())
    prompt, chosen, chosen_loss, rejected, _ = _split(tokenizer, doc)
    assert prompt == "<s>the sky is" and chosen == chosen_loss == " blue</s>" and rejected == " lazy</s>"


@pytest.mark.parametrize("record, reason, detail", [
    ({"prompt": "hi", "rejected": "no"}, "missing_field", "'chosen'"),
    ({"prompt": "hi", "chosen": 3, "rejected": "no"}, "bad_field", "'chosen' must be a string"),
    ({"chosen": "a", "rejected": "b"}, "bad_field", "needs a prompt field"),
    ({"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "y"}, {"role": "assistant", "content": "b"}]}, "missing_field", "no prompt"),
    ({"prompt": "hi", "chosen": "same", "rejected": "same"}, "identical_responses", ""),
    ({"prompt": "hi", "chosen": "  ", "rejected": "no"}, "empty_response", "chosen"),
    ({"prompt": "hi", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, "bad_field",
     "chosen must start with an assistant turn"),
    ({"prompt": "hi", "chosen": "a", "rejected": "b", "reward_chosen": 1.0}, "bad_field", "must be given together"),
    ({"prompt": "hi", "chosen": "a", "rejected": "b", "margin": "big"}, "bad_field", "'margin' must be a finite number"),
    ({"prompt": "hi", "chosen": "a", "rejected": "b", "reward_chosen": True, "reward_rejected": 0}, "bad_field",
     "'reward_chosen' must be a finite number"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "chosen": "a",
      "rejected": "b"}, "bad_field", "ends with an assistant turn"),
    # the messages are checked by the SFT formatter's validator (check_messages), naming the field
    ({"prompt": "hi", "chosen": [{"role": "assistant"}], "rejected": "b"}, "bad_field",
     "field 'chosen': message 0 needs string 'role' and 'content'"),
    ({"prompt": "hi", "chosen": "a", "rejected": [{"role": "assistant", "content": "b\ue001"}]}, "bad_field",
     "field 'rejected': message 0 contains reserved code points U+E000..U+E005"),
    ({"prompt": "hi", "chosen": [{"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]}],
      "rejected": "b"}, "bad_field", "field 'chosen': message 0: 'tool_calls' must be a list of calls"),
])
def test_bad_records_name_location_and_reason(tokenizer, record, reason, detail):
    with pytest.raises(DataError, match=f"pairs.jsonl:7: {reason}") as e:
        _fmt(tokenizer)(record, "pairs.jsonl:7", SkipReport(strict=True))
    assert detail in str(e.value)
    report = SkipReport(strict=False)
    assert _fmt(tokenizer)(record, "pairs.jsonl:7", report) is None and report.counts == {reason: 1}


def _truncate_case(tokenizer, p, c, r, max_length, max_prompt_length):
    cfg = PairConfig(chat_template="chatml", bos_token="<s>", eos_token="</s>", max_length=max_length,
                     max_prompt_length=max_prompt_length)
    f = _fmt(tokenizer, cfg)
    prompt = np.concatenate([[f.fmt.bos_id], np.arange(10, 10 + p - 1)]).astype(np.int64)
    chosen = (np.arange(100, 100 + c), np.ones(c, np.uint8))
    rejected = (np.arange(200, 200 + r), np.ones(r, np.uint8))
    return f, prompt, chosen, rejected


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60), st.integers(1, 60), st.integers(1, 60), st.integers(2, 80), st.one_of(st.none(), st.integers(1, 79)))
def test_truncation_policy(tokenizer, p, c, r, max_length, max_prompt_length):
    """The stated policy as a formula: p1 = min(p, max_prompt_length); if p1 + R > L the prompt is cut to
    min(p1, max(L - R, min(p1, floor))), floor = max_prompt_length or L // 2; then both responses to
    L - p'. Structure: the prompt keeps its BOS and a suffix of itself, the responses keep prefixes, each
    side fits max_length, and nothing is cut when everything fits."""
    if max_prompt_length is not None and max_prompt_length >= max_length:
        with pytest.raises(ValueError, match="leaves no room"):
            _truncate_case(tokenizer, p, c, r, max_length, max_prompt_length)
        return
    f, prompt, chosen, rejected = _truncate_case(tokenizer, p, c, r, max_length, max_prompt_length)
    P, C, R, cut = f._truncate(prompt, chosen, rejected)
    L, Fp = max_length, max_prompt_length
    p1 = min(p, Fp) if Fp is not None else p
    floor = Fp if Fp is not None else L // 2
    p2 = min(p1, max(L - max(c, r), min(p1, floor))) if p1 + max(c, r) > L else p1
    budget = L - p2
    assert (len(P), len(C[0]), len(R[0])) == (p2, min(c, budget), min(r, budget))
    assert cut == (p2 < p or c > budget or r > budget)
    assert len(P) + len(C[0]) <= L and len(P) + len(R[0]) <= L
    assert P[0] == prompt[0] and np.array_equal(P[1:], prompt[len(prompt) - len(P) + 1 :])  # BOS + a suffix
    assert np.array_equal(C[0], chosen[0][: len(C[0])]) and np.array_equal(R[0], rejected[0][: len(R[0])])
    assert np.array_equal(C[1], chosen[1][: len(C[0])])
    if p + max(c, r) <= L and (Fp is None or p <= Fp):
        assert not cut


def test_truncated_pairs_counted_and_identical_tails_reported(tokenizer):
    cfg = PairConfig(chat_template="chatml", eos_token="</s>", max_length=20)
    f = _fmt(tokenizer, cfg)
    rec = {"prompt": "the quick brown fox jumps over the lazy dog " * 3, "chosen": "hello world the sky",
           "rejected": "hello world the dog"}
    doc = f(rec, "f:1", SkipReport())
    assert doc.truncated and f.n_truncated == 1 == f.stats["n_truncated"]
    assert len(doc.input_ids) - doc.extra["rejected_len"] <= 20
    rec = {"prompt": "why", "chosen": "hello " * 30 + "world", "rejected": "hello " * 30 + "dog"}
    with pytest.raises(DataError, match="identical_after_truncation: the responses differ only after max_length=20"):
        f(rec, "f:2", SkipReport())


def test_pair_cache_round_trip_and_reuse(tmp_path, tokenizer, write_jsonl):
    recs = [{"prompt": f"user asks why {i}", "chosen": "because of Rayleigh scattering " * (i % 3 + 1),
             "rejected": "hello world", "reward_chosen": i, "reward_rejected": 0.5} for i in range(12)]
    recs[3] = {"prompt": "hi", "chosen": "x", "rejected": "x"}  # identical: skipped in lenient mode
    recs[5].update(margin=9.0)
    src = write_jsonl(tmp_path / "pairs.jsonl", recs)
    cfg = PairConfig(chat_template="chatml", eos_token="</s>", max_length=40)
    with pytest.raises(DataError, match=r"pairs.jsonl:4: identical_responses"):
        build_pair_cache(src, tokenizer, cfg, str(tmp_path / "strict"), progress=False)
    cache = build_pair_cache(src, tokenizer, cfg, str(tmp_path / "c"), strict=False, progress=False, num_proc=2)
    assert len(cache) == 11 and cache.report.counts == {"identical_responses": 1}
    assert set(PairConfig.columns) <= set(cache.tokens.columns) and cache.tokens.columns["margin"].dtype == np.int64
    fmt = PairFormatter(tokenizer, cfg)
    kept = [r for i, r in enumerate(recs) if i != 3]
    for i, rec in enumerate(kept):
        doc = fmt(rec, "x", SkipReport())
        ids, flags = cache.tokens[i]
        assert np.array_equal(ids, doc.input_ids) and np.array_equal(flags, doc.loss_mask)
        prompt, (c, cl), (r, rl) = cache.pair(i)
        assert len(prompt) == doc.extra["prompt_len"] and cl.max() == 1 and rl.max() == 1
        seq, mask = cache.sequence(i, "chosen")
        assert seq.dtype == np.int64 and np.array_equal(seq, np.concatenate([prompt, c]))
        assert mask[: len(prompt)].sum() == 0 and np.array_equal(mask[len(prompt):], cl)
    assert cache.reward_chosen[[0, 3]].tolist() == [0.0, 4.0] and cache.margin[4] == 9.0
    want = np.array([r.get("margin", r["reward_chosen"] - 0.5) for r in kept])
    assert np.array_equal(cache.effective_margin, want)
    again = build_pair_cache(src, tokenizer, cfg, str(tmp_path / "c"), strict=False, progress=False)
    assert again.tokens.n_built == 0 and len(again) == 11
    # an SFT cache over the same folder layout is not a pair cache
    sft = build_cache(write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}]), tokenizer,
                      FormatConfig(eos_token="</s>"), str(tmp_path / "sft"), progress=False)
    with pytest.raises(CacheError, match="not a pair cache"):
        PairCache(sft)
    assert open_pair_cache(str(tmp_path / "c")).fingerprint() == cache.fingerprint()


def test_pair_cache_from_messages_files(tmp_path, tokenizer):
    """A Parquet-free sanity check of the JSONL path with message lists, read back by PairCache."""
    path = tmp_path / "m.jsonl"
    rows = [{"messages": [{"role": "user", "content": "why"}], "chosen": [{"role": "assistant", "content": "because"}],
             "rejected": [{"role": "assistant", "content": "hi"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = build_pair_cache(str(path), tokenizer, CFG, str(tmp_path / "c"), progress=False)
    assert len(cache) == 1 and cache.chosen_len[0] > 0 and cache.prompt_len[0] > 0


def test_pair_files_go_through_the_one_reader_core(tmp_path, tokenizer):
    """Pair data is read by ftlib.data.readers like SFT data: a leading BOM is stripped, a link
    loop is read once, an over-long record is refused and counted, empty files are reported."""
    from ftlib.data import ReadLimits

    d = tmp_path / "pairs"
    d.mkdir()
    row = {"prompt": "why", "chosen": "because of Rayleigh scattering", "rejected": "hello world"}
    big = dict(row, prompt="why " * 100)
    (d / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(row).encode() + b"\n" + json.dumps(big).encode() + b"\n")
    (d / "b.jsonl").write_bytes(b"\n")
    os.symlink(".", d / "loop")
    with pytest.warns(UserWarning, match=r"loop -> \. \(a directory read already\)"):
        cache = build_pair_cache(str(d), tokenizer, CFG, str(tmp_path / "c"), strict=False, progress=False,
                                 limits=ReadLimits(max_record_bytes=300))
    assert len(cache) == 1
    assert cache.report.counts == {"record_too_large": 1} and cache.report.notes == {"empty_file": 1}
    assert cache.report.examples["record_too_large"][0].startswith(f"{d / 'a.jsonl'}:2: record_too_large")
