"""Rewards (errors name the function and sample; lenient mode skips and counts; built-ins), rollouts
(groups, stop tokens kept, dropout off, the sampler RNG replays), packed layout, min-p."""

from __future__ import annotations

import math

import pytest
import torch

from ftlib.models import LlamaConfig, LlamaForCausalLM
from ftlib.models.generate import sample_next
from ftlib.rl import (
    ModelGenerator,
    RewardError,
    SamplingConfig,
    boxed_answer,
    compute_rewards,
    exact_answer_reward,
    format_reward,
    group_advantages,
    last_number,
    pack_rollouts,
    policy_logprobs,
    rollout,
)


def test_builtin_extractors():
    assert last_number("so 12 + 30 = 1,042.") == "1042"
    assert last_number("no digits") is None
    assert boxed_answer(r"thus \boxed{\frac{1}{2}} and \boxed{7}") == "7"
    assert boxed_answer(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    f = exact_answer_reward()
    assert f(["q"] * 3, ["it is 4.0", "4", "5"], answer=["4", "4", "4"]) == [1.0, 1.0, 0.0]
    g = exact_answer_reward(extract=r"Answer: (\w+)")
    assert g(["q"] * 2, ["Answer: cat. Answer: dog", "cat"], answer=["dog", "cat"]) == [1.0, 0.0]
    assert format_reward(r"<think>.*</think>.*")(["q"] * 2, ["<think>x</think> 4", "4"]) == [1.0, 0.0]


def test_rewards_weighted_sum_and_stats():
    def one(prompts, completions, **_):
        return [1.0] * len(completions)

    def length(prompts, completions, **_):
        return [float(len(c)) for c in completions]

    r = compute_rewards([one, length], ["p", "p"], ["ab", "abcd"], weights=[2.0, 0.5])
    assert r.total.tolist() == [3.0, 4.0] and r.names == ["one", "length"]
    s = r.stats()
    assert s["rewards/length/mean"] == 3.0 and s["reward"] == 3.5


def test_bad_reward_names_function_and_sample():
    def broken(prompts, completions, **_):
        return [1.0, None]

    def raises(prompts, completions, **_):
        raise RuntimeError("checker crashed")

    with pytest.raises(RewardError, match=r"'broken' returned None .* sample 1: prompt 'q2', completion 'b'"):
        compute_rewards(broken, ["q1", "q2"], ["a", "b"])
    with pytest.raises(RewardError, match="'raises' raised RuntimeError: checker crashed"):
        compute_rewards(raises, ["q1", "q2"], ["a", "b"])
    with pytest.raises(RewardError, match="not a finite number"):
        compute_rewards(lambda p, c, **_: [float("nan"), 1.0], ["q1", "q2"], ["a", "b"])
    r = compute_rewards([broken, raises], ["q1", "q2"], ["a", "b"], lenient=True)
    assert r.skipped == {"broken": 1, "raises": 2}
    assert r.total[0] == 1.0 and math.isnan(float(r.total[1]))  # unscorable: every function skipped it
    adv = group_advantages(r.total, 2)
    assert adv.advantages.tolist() == [0.0, 0.0] and adv.stats["unscorable"] == 1


def _tiny(dropout_probe=False):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


class _Tok:
    def decode(self, ids):
        return " ".join(f"t{i}" for i in ids)


def test_rollout_groups_stops_and_rng_replay():
    model = _tiny().train()
    modes = []
    model.model.register_forward_pre_hook(lambda m, a: modes.append(m.training))
    gen = ModelGenerator(model, pad_token_id=0)
    sampling = SamplingConfig(temperature=1.0, top_k=20, min_p=0.01, max_new_tokens=6, stop_tokens=(3, 4))
    prompts = [[5, 6, 7], [8, 9]]
    rng = torch.Generator().manual_seed(1)
    state = rng.get_state()
    a = rollout(gen, _Tok(), prompts, group_size=4, sampling=sampling, rng=rng, fields={"answer": ["x", "y"]})
    assert model.training and modes and not any(modes)  # eval while decoding, restored after
    assert len(a) == 8 and a.prompt_ids[:4] == [prompts[0]] * 4 and a.fields["answer"] == ["x"] * 4 + ["y"] * 4
    for c, t in zip(a.completion_ids, a.truncated):
        stop_at = [j for j, x in enumerate(c) if x in (3, 4)]
        assert stop_at in ([], [len(c) - 1])  # the stop token kept, nothing after
        assert t == (not stop_at and len(c) == 6)
    rng.set_state(state)
    b = rollout(gen, _Tok(), prompts, group_size=4, sampling=sampling, rng=rng)
    assert b.completion_ids == a.completion_ids  # the saved sampler state replays the rollouts


def test_stop_strings_cut_the_completion():
    def fake(prompt_ids, sampling, rng):
        return [[10, 11, 12, 13] for _ in prompt_ids]

    ro = rollout(fake, _Tok(), [[1]], group_size=2, sampling=SamplingConfig(max_new_tokens=4, stop_strings=("t11",)),
                 rng=torch.Generator())
    assert ro.completion_ids == [[10, 11]] * 2 and ro.truncated == [False, False]


def _first_prefix_holding(tok, ids, stop):
    return next((k for k in range(len(ids)) if stop in tok.decode(ids[:k + 1])), None)


def test_model_generator_halts_at_stop_strings():
    """The rollout sampler stops each row at the token completing a stop string (one spanning two tokens'
    text here) and decoding ends when every row has: fewer forwards than max_new_tokens."""
    model, tok = _tiny(), _Tok()
    calls = []
    model.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    prompts = [[5, 6, 7]]

    def run(**kw):
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=12, **kw)
        calls.clear()
        return rollout(ModelGenerator(model, pad_token_id=0, tokenizer=tok), tok, prompts, group_size=2,
                       sampling=sampling, rng=torch.Generator().manual_seed(2))

    free = run().completion_ids
    assert len(calls) == 12 and all(len(c) == 12 for c in free)
    # the last digit of new token 3 and the first of token 4, across their separating space
    stops = tuple(f"{str(c[3])[-1]} t{str(c[4])[0]}" for c in free)
    cuts = [min(k for k in (_first_prefix_holding(tok, c, s) for s in stops) if k is not None) for c in free]
    assert all(stop not in tok.decode(c[k:k + 1]) for c, k in zip(free, cuts) for stop in stops)
    ro = run(stop_strings=stops)
    assert ro.completion_ids == [c[:k + 1] for c, k in zip(free, cuts)] and ro.truncated == [False, False]
    assert max(cuts) <= 4 and len(calls) == max(cuts) + 1 < 12  # decoding ended early
    assert ro.completions == [tok.decode(c[:k + 1]) for c, k in zip(free, cuts)]
    with pytest.raises(ValueError, match="stop_strings needs ModelGenerator"):
        ModelGenerator(model, pad_token_id=0)(prompts, SamplingConfig(stop_strings=("x",)), torch.Generator())


def test_pack_rollouts_layout_and_logprobs():
    model = _tiny().double()

    def fake(prompt_ids, sampling, rng):
        return [[20 + i] * (1 + i % 3) for i in range(len(prompt_ids))]

    ro = rollout(fake, _Tok(), [[5, 6, 7], [8, 9]], group_size=3, sampling=SamplingConfig(max_new_tokens=3),
                 rng=torch.Generator())
    batches = pack_rollouts(ro, max_tokens=12)
    assert sorted(i for b in batches for i in b["sample_index"].tolist()) == list(range(6))
    for b in batches:
        n = b["input_ids"].shape[1]
        assert int(b["cu_seqlens"][-1]) == n == b["n_tokens"] <= 12  # no padding at all
        lp = policy_logprobs(model, b).logp
        for local, s in enumerate(b["sample_index"].tolist()):  # each sample's log-probs alone, unpacked
            ids = torch.tensor([ro.prompt_ids[s] + ro.completion_ids[s]])
            logits = model(ids)[0, :-1].log_softmax(-1)
            k = len(ro.completion_ids[s])
            want = logits[-k:].gather(1, ids[0, -k:, None])[:, 0]
            torch.testing.assert_close(lp[b["token_seq"] == local], want, rtol=0, atol=1e-12)
    masked = pack_rollouts(ro, indices=[0, 2])
    assert sorted(masked[0]["sample_index"].tolist()) == [0, 2]


def test_min_p_filters_relative_to_the_top_token():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    seen = {int(sample_next(logits, temperature=1.0, min_p=0.25, generator=g)) for _ in range(200)}
    assert seen == {0, 1, 2}  # 0.05 < 0.25 * 0.5
