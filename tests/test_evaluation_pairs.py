"""ftlib.evaluation on preference pairs: a reward model's held-out metrics and scored records equal the
scores of exactly the cached sequences, in either loader layout (``ftlib.models.pair_rewards``); a policy's
reward accuracy / margin / log-prob accuracy equal the loss's own numbers over every pair; the
before/after table; ``PairPolicy`` is ``pair_logps`` as a module; the demo builders' splits."""

from __future__ import annotations

import json

import pytest
import torch

from ftlib.data import PairConfig, PairLoader, build_pair_cache
from ftlib.evaluation import (
    pair_exact_match,
    pair_metrics,
    pair_metrics_table,
    reward_pair_metrics,
    score_pairs,
)
from ftlib.lora import LoRAConfig, apply_lora, lora_layers
from ftlib.losses import bradley_terry_loss
from ftlib.models import (
    load_pretrained,
    load_reward_model,
    load_tokenizer,
    pair_rewards,
    pairwise_accuracy,
    score,
)
from ftlib.preference import PairLogps, PairPolicy, PreferenceLoss, pair_logps, reference_pair_logps
from ftlib.train.demo import arithmetic_pairs, make_demo_assets, prompt_records, reward_demo_pairs


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    make_demo_assets(root / "demo")
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_pairs(7, seed=3)))
    tok = load_tokenizer(root / "demo" / "base")
    cfg = PairConfig(kind="chat", chat_template=tok.chat_template, eos_token=tok.eos_token)
    cache = build_pair_cache(str(pairs), tok.tokenizer, cfg, str(root / "cache"), progress=False)
    return root, tok, cfg, cache, pairs


def _sequences(cache):
    return [cache.sequence(i, side)[0].tolist() for i in range(len(cache)) for side in ("chosen", "rejected")]


def test_reward_metrics_and_scored_records_are_the_scores_of_the_cached_sequences(demo):
    root, tok, cfg, cache, pairs = demo
    torch.manual_seed(0)
    rm = load_reward_model(root / "demo" / "base")
    want = score(rm, _sequences(cache))  # chosen, rejected, chosen, ... one by one
    c, r = want[0::2], want[1::2]
    for packing in (False, True):  # each side its own padded row, or its own packed segment
        loader = PairLoader(cache, batch_size=3, seq_len=256, pad_id=tok.pad_token_id, packing=packing, shuffle=False,
                            drop_last=False, rank=0, world_size=1)
        got_c, got_r = [], []
        with torch.no_grad():
            for batch in loader:
                gc, gr = pair_rewards(rm, batch)
                got_c.append(gc)
                got_r.append(gr)
        order = torch.cat([b["pair_ids"] for b in loader])
        torch.testing.assert_close(torch.cat(got_c), c[order], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.cat(got_r), r[order], atol=1e-5, rtol=1e-5)
    m = reward_pair_metrics(rm, cache, pad_id=tok.pad_token_id)
    loss, n = bradley_terry_loss(c, r)
    assert m["eval_loss"] == pytest.approx(float(loss) / float(n), abs=1e-5)
    assert m["eval_accuracy"] == pytest.approx(pairwise_accuracy(c, r))
    recs = score_pairs(rm, tok, str(pairs), cfg)
    src = [json.loads(line) for line in pairs.read_text().splitlines()]
    assert [{k: x[k] for k in s} for x, s in zip(recs, src)] == src  # every field kept, in order
    torch.testing.assert_close(torch.tensor([x["reward_chosen"] for x in recs]), c, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor([x["reward_rejected"] for x in recs]), r, atol=1e-5, rtol=1e-5)


def test_policy_pair_metrics_are_the_losses_numbers_over_every_pair(demo):
    root, tok, cfg, cache, _ = demo
    torch.manual_seed(0)
    model = load_pretrained(root / "demo" / "base")
    apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules="all-linear"), verbose=False)
    loss_fn = PreferenceLoss("sigmoid", beta=0.5)
    start = pair_metrics(model, cache, loss_fn=loss_fn, pad_id=tok.pad_token_id, seq_len=256)
    assert start["pairs"] == len(cache) and start["reward_margin"] == 0 and start["reward_accuracy"] == 0
    with torch.no_grad():  # move the policy off the reference
        for _, layer in lora_layers(model):
            layer.lora_B.weight.normal_(0, 0.5)
    got = pair_metrics(model, cache, loss_fn=loss_fn, pad_id=tok.pad_token_id, seq_len=256)
    batch = next(iter(PairLoader(cache, batch_size=len(cache), pad_id=tok.pad_token_id, packing=False, shuffle=False,
                                 drop_last=False, rank=0, world_size=1)))
    with torch.no_grad():
        policy = pair_logps(model, batch)
        res = loss_fn(policy, reference_pair_logps(model, batch))
        as_module = PairLogps(*PairPolicy(model)(batch))
    for name in ("chosen", "rejected", "chosen_n", "rejected_n"):
        assert torch.equal(getattr(as_module, name), getattr(policy, name)), name
    assert got["reward_margin"] != 0
    assert got["reward_margin"] == pytest.approx(float(res.margins.mean()), abs=1e-4)
    assert got["reward_accuracy"] == pytest.approx(float(res.accuracies.mean()))
    assert got["logp_accuracy"] == pytest.approx(float((policy.chosen > policy.rejected).float().mean()))
    em = pair_exact_match(model, tok, str(demo[4]), cfg, limit=3, stop_tokens=[tok.eos_token_id])
    assert em["generated"] == 3 and 0 <= em["exact_match"] <= 1 and len(em["examples"]) == 3
    assert pair_exact_match(model, tok, str(demo[4]), cfg, limit=0, stop_tokens=[tok.eos_token_id]) == {}


def test_pair_metrics_table_rows():
    after = {"pairs": 4, "reward_accuracy": 0.75, "reward_margin": 0.5, "logp_accuracy": 1.0, "exact_match": 0.5,
             "generated": 2, "examples": ["'a' -> 'a'"]}
    text = pair_metrics_table(None, after)
    assert text.splitlines()[0].startswith("held-out (4 pairs, 2 prompts generated)")
    assert "exact match" in text and "n/a" in text and "0.750" in text and "after, e.g.: 'a' -> 'a'" in text
    before = {k: (0.25 if isinstance(v, float) else v) for k, v in after.items()}
    row = next(line for line in pair_metrics_table(before, after).splitlines() if line.startswith("reward accuracy"))
    assert row.split()[-2:] == ["0.250", "0.750"]


def test_reward_demo_pairs_split_by_the_rejected_answer(tmp_path):
    train, held = reward_demo_pairs(tmp_path, n_prompts=6, seed=0)
    t = [json.loads(line) for line in train.read_text().splitlines()]
    h = [json.loads(line) for line in held.read_text().splitlines()]
    key = lambda r: (json.dumps(r["messages"]), r["rejected"])
    assert t and h and not {key(r) for r in t} & {key(r) for r in h}
    assert {json.dumps(r["messages"]) for r in t} | {json.dumps(r["messages"]) for r in h} == {
        json.dumps(r["messages"]) for r in t + h} and len({json.dumps(r["messages"]) for r in t + h}) == 6
    before = train.read_text()
    assert reward_demo_pairs(tmp_path, n_prompts=6, seed=1) == (train, held) and train.read_text() == before


def test_prompt_records_answer_is_the_reversed_list():
    rec = {"messages": [{"role": "user", "content": "Reverse the words: a b c"}, {"role": "assistant", "content": "c b a"}]}
    assert prompt_records([rec]) == [{"prompt": "Reverse the words: a b c", "answer": "c b a"}]
