"""On-policy pairs: never two equal sides, never a held-out prompt, every drop counted; the records go
through the pair pipeline into a pair cache; a reward model scores them as a score function."""

import json
import random
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.data.pairs import PairConfig, build_pair_cache
from ftlib.models import LlamaConfig, LlamaForCausalLM, PretrainedTokenizer
from ftlib.onpolicy import (
    OnPolicyConfig,
    build_onpolicy_pairs,
    generate_answers,
    prompt_key,
    reward_model_scorer,
    split_last_answer,
    write_pairs,
)

WORDS = "red blue green sun moon star".split()


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"],
                             show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator([" ".join(WORDS)] * 20 + ["<|im_start|>user\nname a word<|im_end|>\n"] * 5, tr)
    return PretrainedTokenizer(t, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>")


def _model(tok, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      eos_token_id=tok.eos_token_id)
    return LlamaForCausalLM(cfg).eval()


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[{"role": "user", "content": f"name a word {i} " + " ".join(rng.sample(WORDS, 2))}] for i in range(n)]


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 3), st.integers(0, 4), st.sampled_from([0.0, 0.5]),
       st.booleans(), st.sampled_from(["length", "hash", "constant", "random"]))
def test_pairs_never_have_equal_sides_or_held_out_prompts(tok, seed, new_tokens, samples, gap, use_ref, scorer):
    """Invariant, whatever the scores (ties, all equal, unrelated to the text): every pair's sides differ
    after whitespace normalisation, the chosen side scores more than the rejected one by more than
    min_gap, no pair's prompt is a held-out one (lenient mode), and every prompt is accounted for."""
    model = _model(tok, seed % 3)
    prompts = _prompts(10, seed)
    held = [prompts[1], [{"role": "system", "content": "be nice"}, {"role": "user", "content": prompts[4][0]["content"]
                                                                     + "  "}]]
    rng = random.Random(seed)
    score = {"length": lambda ps, a: [float(len(x.split())) for x in a],
             "hash": lambda ps, a: [float(zlib.crc32(x.encode()) % 3) for x in a],
             "constant": lambda ps, a: [1.0] * len(a),
             "random": lambda ps, a: [float(rng.randint(0, 2)) for _ in a]}[scorer]
    # references: often the model's own greedy answer in other whitespace (the same answer: never a pair
    # against itself, whatever its two scores), else a fixed text or none
    from ftlib.data import render_chat

    texts = [render_chat(p, "chatml", add_generation_prompt=True, bos_token="", eos_token="<|im_end|>") for p in prompts]
    greedy = generate_answers(model, tok, texts, max_new_tokens=new_tokens)
    refs = [None if i % 3 == 0 else (" " + greedy[i].replace(" ", "  ") + " " if i % 3 == 1 else "red blue")
            for i in range(len(prompts))]
    cfg = OnPolicyConfig(samples=samples, max_new_tokens=new_tokens, min_gap=gap, use_reference=use_ref,
                         max_pairs_per_prompt=3, seed=seed, batch_size=4)
    out = build_onpolicy_pairs(model, tok, prompts, score, chat_template="chatml", references=refs, exclude=held,
                               config=cfg, strict=False)
    norm = lambda s: " ".join(s.split())
    banned = {prompt_key(p) for p in held}
    for r in out.records:
        assert norm(r["chosen"]) != norm(r["rejected"]), r
        assert r["chosen"].strip() and r["rejected"].strip(), r
        assert r["reward_chosen"] > r["reward_rejected"] + gap, r
        assert prompt_key(r["messages"]) not in banned, r
        assert r["rejected_from"] in ("greedy", "sample") and r["chosen_from"] in ("greedy", "sample", "reference")
    s = out.stats
    assert s.excluded_prompts == 2 and s.prompts == 8
    assert s.candidates + s.empty_answers + s.repeated_answers == 8 * (1 + samples)
    assert s.pairs == len(out.records)
    with_pairs = len({json.dumps(r["messages"]) for r in out.records})
    assert with_pairs + s.no_pair == s.prompts
    if scorer == "constant" and not use_ref:
        assert out.records == [] and s.no_pair == s.prompts


def test_held_out_prompt_is_an_error_in_strict_mode(tok):
    prompts = _prompts(4)
    # the same user turn with another system prompt and other spacing is the same prompt
    held = [[{"role": "system", "content": "x"}, {"role": "user", "content": "  " + prompts[2][0]["content"]}]]
    with pytest.raises(ValueError, match="prompt 2 is a held-out prompt"):
        build_onpolicy_pairs(_model(tok), tok, prompts, lambda p, a: [0.0] * len(a), chat_template="chatml",
                             exclude=held, config=OnPolicyConfig(samples=1, max_new_tokens=2))


def test_reference_is_chosen_over_the_models_mistakes_and_greedy_is_rejected_first(tok):
    """A checker that only the reference answer satisfies: every pair prefers the reference, the greedy
    answer is the first rejected one, and the pair's rewards are the checker's scores."""
    prompts = _prompts(3, seed=5)
    right = ["moon star sun"] * 3
    check = lambda ps, ans: [1.0 if a == "moon star sun" else 0.0 for a in ans]
    model = _model(tok, 1)
    out = build_onpolicy_pairs(model, tok, prompts, check, chat_template="chatml", references=right,
                               config=OnPolicyConfig(samples=3, max_new_tokens=4, max_pairs_per_prompt=1))
    greedy = [a[0] for a in out.answers]
    assert len(out.records) == 3 and out.stats.reference_chosen == 3
    for r, g in zip(out.records, greedy):
        assert r["chosen"] == "moon star sun" and r["chosen_from"] == "reference"
        assert r["rejected"] == g and r["rejected_from"] == "greedy"
        assert (r["reward_chosen"], r["reward_rejected"]) == (1.0, 0.0)
    # the greedy answers are what generate_answers decodes at temperature 0
    from ftlib.data import render_chat

    texts = [render_chat(p, "chatml", add_generation_prompt=True, bos_token="", eos_token="<|im_end|>") for p in prompts]
    assert generate_answers(model, tok, texts, max_new_tokens=4) == greedy


def test_records_go_through_the_pair_pipeline(tok, tmp_path):
    prompts = _prompts(6, seed=2)
    out = build_onpolicy_pairs(_model(tok, 2), tok, prompts, lambda p, a: [float(len(x)) for x in a],
                               chat_template="chatml", references=["red"] * 6,
                               config=OnPolicyConfig(samples=3, max_new_tokens=3))
    assert out.records
    path = write_pairs(out.records, tmp_path / "pairs" / "onpolicy.jsonl")
    cache = build_pair_cache(str(path), tok.tokenizer, PairConfig(chat_template="chatml", eos_token="<|im_end|>"),
                             str(tmp_path / "cache"), progress=False)
    assert len(cache) == len(out.records) and cache.report.total == 0  # nothing skipped
    assert list(cache.reward_chosen) == [r["reward_chosen"] for r in out.records]
    assert list(cache.reward_rejected) == [r["reward_rejected"] for r in out.records]


def test_split_last_answer_and_config_errors(tok):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert split_last_answer(msgs) == ([{"role": "user", "content": "q"}], "a")
    with pytest.raises(ValueError, match="must end with an assistant turn"):
        split_last_answer(msgs[:1])
    with pytest.raises(ValueError, match="temperature > 0"):
        OnPolicyConfig(samples=2, temperature=0.0)
    with pytest.raises(ValueError, match="ending with a user turn"):
        build_onpolicy_pairs(_model(tok), tok, [msgs], lambda p, a: [0.0] * len(a), chat_template="chatml")
    with pytest.raises(ValueError, match="returned 0 scores"):
        build_onpolicy_pairs(_model(tok), tok, _prompts(2), lambda p, a: [], chat_template="chatml",
                             references=["red", "blue"], config=OnPolicyConfig(samples=1, max_new_tokens=2))


def test_reward_model_scorer_scores_the_rendered_conversation(tok):
    from ftlib.data import render_chat
    from ftlib.models import LlamaRewardModel, score

    torch.manual_seed(0)
    rm = LlamaRewardModel.from_causal_lm(_model(tok, 3)).eval()
    prompts, answers = _prompts(3), ["red", "blue sun", "moon"]
    got = reward_model_scorer(rm, tok, "chatml")(prompts, answers)
    docs = [tok.encode(render_chat(p + [{"role": "assistant", "content": a}], "chatml"), add_special_tokens=False)
            for p, a in zip(prompts, answers)]
    assert got == score(rm, docs).tolist() and len(set(got)) == 3


_TEXTS = ["red blue", " red  blue", "red\tblue ", "sun", "sun ", "", "  ", "moon star"]


@settings(max_examples=200, deadline=None)
@given(st.data(), st.integers(0, 4), st.sampled_from([0.0, 1.0]), st.booleans())
def test_pairs_from_any_answers_and_scores(tok, data, samples, gap, use_ref):
    """Invariant over arbitrary decoded answers (repeats in other whitespace, empty ones) and arbitrary
    scores (ties, a reference scored apart from the same text answered by the model): no pair has two
    equal sides or an empty side, chosen beats rejected by more than min_gap, every answer is counted."""
    n = 5
    answers = data.draw(st.lists(st.sampled_from(_TEXTS), min_size=n * (1 + samples), max_size=n * (1 + samples)))
    refs = data.draw(st.lists(st.one_of(st.none(), st.sampled_from(_TEXTS)), min_size=n, max_size=n))
    table = data.draw(st.lists(st.integers(0, 3), min_size=64, max_size=64))
    calls = iter(range(10_000))
    score = lambda ps, a: [float(table[next(calls) % 64]) for _ in a]  # unrelated to the text
    with pytest.MonkeyPatch.context() as mp:
        _fake_answers(mp, answers[:n], answers[n:])
        out = build_onpolicy_pairs(None, tok, _prompts(n), score, chat_template="chatml", references=refs,
                                   config=OnPolicyConfig(samples=samples, min_gap=gap, use_reference=use_ref,
                                                         max_pairs_per_prompt=5), device="cpu")
    norm = lambda s: " ".join(s.split())
    for r in out.records:
        assert norm(r["chosen"]) != norm(r["rejected"]) and norm(r["chosen"]) and norm(r["rejected"]), r
        assert r["reward_chosen"] > r["reward_rejected"] + gap, r
    s = out.stats
    assert s.candidates + s.empty_answers + s.repeated_answers == len(answers)
    assert s.empty_answers == sum(not a.strip() for a in answers)


def _fake_answers(mp, greedy, sampled):
    """Replace decoding by given answers: the greedy ones (temperature 0), then the sampled ones."""
    import ftlib.onpolicy as onpolicy

    def fake(model, tokenizer, prompts, *, temperature=0.0, **kw):
        src = greedy if temperature == 0 else sampled
        assert len(prompts) == len(src)
        return [a.strip() for a in src]

    mp.setattr(onpolicy, "generate_answers", fake)


def test_nan_scores_are_counted_as_nan_never_as_prompts_that_all_score_the_same(tok, monkeypatch):
    """Issue 34, item 6: a scorer returning NaN (a diverged reward model) ranks nothing. Before, every
    comparison with NaN was False, so such prompts were counted as ``no_pair`` ("all score the same")."""
    # prompt 0: every answer NaN; prompt 1: one NaN answer beside two scored ones; prompt 2: no NaN
    _fake_answers(monkeypatch, ["a0", "b0", "c0"], ["a1", "b1", "c1", "d1", "e1", "f1"])
    table = {"a0": float("nan"), "a1": float("nan"), "b1": float("nan"),
             "b0": 1.0, "c1": float("nan"), "d1": 0.0,
             "c0": 1.0, "e1": 0.0, "f1": 2.0}
    score = lambda ps, answers: [table[a] for a in answers]
    out = build_onpolicy_pairs(None, tok, _prompts(3), score, chat_template="chatml",
                               config=OnPolicyConfig(samples=2, max_pairs_per_prompt=5), device="cpu")
    s = out.stats
    assert (s.nan_prompts, s.nan_scores, s.no_pair) == (1, 4, 0), s
    assert sorted((r["chosen"], r["rejected"]) for r in out.records) == [("b0", "d1"), ("f1", "c0"), ("f1", "e1")]
    assert all(r["reward_chosen"] == r["reward_chosen"] for r in out.records)  # no NaN reaches a record
