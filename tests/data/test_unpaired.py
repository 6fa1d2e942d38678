"""Unpaired (KTO) examples through the pair data path: the formatter, the pair cache, strict and lenient
reporting, and ``PairLoader``'s one-row batches, which are ``ftlib.rl.pack_kto``'s layout."""

import numpy as np
import pytest
import torch

from ftlib.data import DataError, PairConfig, PairLoader, build_pair_cache, collate_unpaired

CFG = PairConfig(chat_template="chatml", eos_token="</s>", unpaired=True, max_length=48)
TEXT = PairConfig(kind="text", eos_token="</s>", unpaired=True, max_length=48)


def _records(n=10):
    return [{"prompt": f"user asks why {i}", "completion": "because of scattering " * (i % 3 + 1),
             "label": i % 3 != 1} for i in range(n)]


def test_unpaired_cache_round_trip_strict_and_lenient(tmp_path, tokenizer, write_jsonl):
    recs = _records()
    recs[4] = {"prompt": "hi", "completion": "x", "label": "yes"}  # not a bool
    src = write_jsonl(tmp_path / "kto.jsonl", recs)
    with pytest.raises(DataError, match=r"^[^\n]*kto\.jsonl:5: bad_field: field 'label' must be true or false"):
        build_pair_cache(src, tokenizer, CFG, str(tmp_path / "strict"), progress=False)
    cache = build_pair_cache(src, tokenizer, CFG, str(tmp_path / "c"), strict=False, progress=False)
    kept = [r for i, r in enumerate(recs) if i != 4]
    assert len(cache) == 9 and cache.report.counts == {"bad_field": 1} and cache.unpaired
    assert cache.label.tolist() == [r["label"] for r in kept]
    for i, rec in enumerate(kept):
        prompt, (ids, mask), label = cache.example(i)
        assert label == rec["label"] and mask.sum() > 0
        text = tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
        assert rec["completion"].strip() in text and "user asks" in tokenizer.decode(prompt.tolist())
        side = "chosen_len" if rec["label"] else "rejected_len"
        other = "rejected_len" if rec["label"] else "chosen_len"
        assert getattr(cache, side)[i] == len(ids) and getattr(cache, other)[i] == 0
    # a pair config over the same file is a different cache (no completion field: missing_field)
    with pytest.raises(DataError, match=r"kto\.jsonl:1: missing_field: field 'chosen'"):
        build_pair_cache(src, tokenizer, PairConfig(chat_template="chatml", eos_token="</s>"), str(tmp_path / "p"),
                         progress=False)
    with pytest.raises(DataError, match=r"nolabel\.jsonl:1: missing_field: field 'label'"):
        build_pair_cache(write_jsonl(tmp_path / "nolabel.jsonl", [{"prompt": "a", "completion": "b"}]), tokenizer,
                         CFG, str(tmp_path / "n"), progress=False)


def test_conversational_unpaired_records(tmp_path, tokenizer, write_jsonl):
    conv = [{"prompt": [{"role": "user", "content": "why is the sky blue"}],
             "completion": [{"role": "assistant", "content": "scattering"}], "label": False}]
    plain = [{"prompt": "why is the sky blue", "completion": "scattering", "label": False}]
    a = build_pair_cache(write_jsonl(tmp_path / "a.jsonl", conv), tokenizer, CFG, str(tmp_path / "a"), progress=False)
    b = build_pair_cache(write_jsonl(tmp_path / "b.jsonl", plain), tokenizer, CFG, str(tmp_path / "b"), progress=False)
    (pa, (ca, ma), la), (pb, (cb, mb), lb) = a.example(0), b.example(0)
    assert la is lb is False and np.array_equal(pa, pb) and np.array_equal(ca, cb) and np.array_equal(ma, mb)


def test_loader_batch_is_pack_kto_and_logps_equal(tmp_path, tokenizer, write_jsonl):
    from ftlib.models import LlamaConfig, LlamaForCausalLM
    from ftlib.rl import kto_logps, pack_kto

    cache = build_pair_cache(write_jsonl(tmp_path / "k.jsonl", _records(9)), tokenizer, TEXT, str(tmp_path / "c"),
                             progress=False)
    loader = PairLoader(cache, batch_size=4, pad_id=0, seed=3)
    batch = next(iter(loader))
    ex = batch["example_ids"].tolist()
    assert len(ex) == 4 and batch["n_examples"] == 4 and batch["input_ids"].shape[0] == 1
    got = [cache.example(i) for i in ex]
    want = pack_kto([p.tolist() for p, _, _ in got], [c.tolist() for _, (c, _), _ in got], [lab for *_, lab in got])
    for k in ("input_ids", "labels", "position_ids", "cu_seqlens", "label"):
        assert torch.equal(batch[k], want[k]), k
    assert batch["max_seqlen"] == want["max_seqlen"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).double()
    with torch.no_grad():
        (a, akl), (b, bkl) = kto_logps(model, batch), kto_logps(model, want)
    assert torch.equal(a, b) and torch.equal(akl, bkl) and akl.shape == (4,)
    # every example once an epoch across two ranks, resumable like every PairLoader
    seen = [int(i) for r in range(2) for bt in PairLoader(cache, batch_size=2, pad_id=0, rank=r, world_size=2,
                                                          drop_last=False) for i in bt["example_ids"]]
    assert sorted(seen) == list(range(9))
    fresh = PairLoader(cache, batch_size=4, pad_id=0, seed=3)
    first = iter(fresh)
    next(first)
    state = fresh.state_dict()
    resumed = PairLoader(cache, batch_size=4, pad_id=0, seed=3)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))["input_ids"], next(first)["input_ids"])
    with pytest.raises(ValueError, match="unpaired"):
        PairLoader(cache, batch_size=2, pad_id=0, seq_len=64)


def test_filler_examples_carry_no_labels(tmp_path, tokenizer, write_jsonl):
    cache = build_pair_cache(write_jsonl(tmp_path / "k.jsonl", _records(3)), tokenizer, TEXT, str(tmp_path / "c"),
                             progress=False)
    b = collate_unpaired(cache, [0, 1, 2], loss=[True, True, False])
    assert b["n_examples"] == 2 and b["example_ids"].tolist() == [0, 1] and len(b["cu_seqlens"]) == 6
    tail = int(b["cu_seqlens"][4])
    assert (b["labels"][0, tail:] == -100).all() and (b["labels"][0, :tail] != -100).any()
