"""ftlib.evaluation: packed held-out loss equals the per-document loss; exact match via generate."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers

from ftlib.data import TokenLoader
from ftlib.evaluation import evaluate, exact_match
from ftlib.models import LlamaConfig, LlamaForCausalLM, PretrainedTokenizer, generate

CFG = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)


class _Docs:
    def __init__(self, docs):
        self.docs = docs
        self.lengths = np.array([len(d[0]) for d in docs])

    def __getitem__(self, i):
        return self.docs[i]


def _docs(seed=0, n=9):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        L = int(rng.integers(3, 20))
        ids = rng.integers(1, CFG.vocab_size, L)
        mask = (rng.random(L) < 0.7).astype(np.uint8)  # some tokens carry no loss
        out.append((ids, mask))
    return out


def test_packed_eval_loss_is_the_token_weighted_mean_over_documents():
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG).double()
    docs = _docs()
    loader = TokenLoader(_Docs(docs), batch_size=2, seq_len=24, pad_id=0, packing=True, shuffle=False, drop_last=False)
    model.train()
    res = evaluate(model, loader)
    assert model.training and all(p.grad is None for p in model.parameters())
    total, n = 0.0, 0
    with torch.no_grad():
        model.eval()
        for ids, mask in docs:  # each document alone, full logits, the loss's shift by hand
            ids_t = torch.as_tensor(ids)[None]
            logits = model(ids_t)[0, :-1]
            keep = torch.as_tensor(mask[1:], dtype=torch.bool)
            total += F.cross_entropy(logits[keep], ids_t[0, 1:][keep], reduction="sum").item()
            n += int(keep.sum())
    assert res.tokens == n
    assert res.loss == pytest.approx(total / n, rel=1e-10)
    assert res.perplexity == pytest.approx(math.exp(total / n), rel=1e-10)
    assert res.to_dict() == {"eval_loss": res.loss, "eval_ppl": res.perplexity, "eval_tokens": n}
    assert evaluate(model, loader, max_batches=1).batches == 1


def test_eval_without_targets_is_refused():
    model = LlamaForCausalLM(CFG)
    docs = [(np.arange(1, 6), np.zeros(5, np.uint8))]
    loader = TokenLoader(_Docs(docs), batch_size=1, seq_len=8, pad_id=0, packing=True, shuffle=False)
    with pytest.raises(ValueError, match="no target token"):
        evaluate(model, loader)


def _tokenizer():
    words = ["<pad>", "<eos>"] + [f"w{i}" for i in range(CFG.vocab_size - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PretrainedTokenizer(tok, eos_token="<eos>", pad_token="<pad>")


def test_exact_match_agrees_with_unbatched_greedy_generation():
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG).eval()
    tok = _tokenizer()
    rng = np.random.default_rng(1)
    prompts = [" ".join(f"w{i}" for i in rng.integers(0, 30, int(rng.integers(1, 7)))) for _ in range(7)]
    singles = []
    for p in prompts:
        new = generate(model, torch.tensor([tok.encode(p)]), max_new_tokens=4, stop_tokens=[1])[0].tolist()
        singles.append(tok.decode(new[: new.index(1)] if 1 in new else new))
    refs = [s if i % 2 == 0 else s + " w0" for i, s in enumerate(singles)]  # every other one wrong
    em = exact_match(model, tok, prompts, refs, max_new_tokens=4, batch_size=3)
    assert em.predictions == singles  # left-padded batches decode exactly as one prompt alone
    assert em.hits == [i % 2 == 0 for i in range(7)] and (em.correct, em.total) == (4, 7)
    assert em.accuracy == pytest.approx(4 / 7)
    loose = exact_match(model, tok, prompts, [f"  {s} " for s in singles], max_new_tokens=4)
    assert loose.accuracy == 1.0  # whitespace is normalised
    with pytest.raises(ValueError, match="2 prompts but 1 references"):
        exact_match(model, tok, prompts[:2], refs[:1])


def test_heldout_report_has_loss_and_exact_match_as_their_functions_give_them():
    from ftlib.evaluation import heldout_report

    torch.manual_seed(0)
    model, tok = LlamaForCausalLM(CFG).eval(), _tokenizer()
    loader = TokenLoader(_Docs(_docs()), batch_size=2, seq_len=24, pad_id=0, packing=True, shuffle=False, drop_last=False)
    prompts, refs = ["w3 w4", "w5"], ["w6", "w7"]
    rep = heldout_report(model, tok, loader, prompts, refs, max_new_tokens=2)
    em = exact_match(model, tok, prompts, refs, max_new_tokens=2)
    assert rep == {**evaluate(model, loader).to_dict(), "exact_match": em.accuracy, "exact_match_correct": em.correct,
                   "exact_match_total": 2, "predictions": em.predictions}
    assert heldout_report(model, loader=loader, losses={"eval_loss": 1.0}) == {"eval_loss": 1.0}  # just measured
    assert heldout_report(model) == {}


def test_before_after_table_rows_and_verdicts():
    from ftlib.evaluation import before_after_table

    before = {"eval_loss": 7.5, "eval_ppl": 1808.04, "exact_match": 0.0, "exact_match_correct": 0,
              "exact_match_total": 2, "predictions": ["x", "y"]}
    after = {"eval_loss": 0.01, "eval_ppl": 1.01, "exact_match": 0.5, "exact_match_correct": 1,
             "exact_match_total": 2, "predictions": ["b a", "c"]}
    lines = before_after_table(before, after, questions=["rev a b", "rev c d"], references=["b a", "d c"], steps=10,
                               wall_s=12.0, train_s=10.0, tokens=5000)
    assert lines[1] == "held-out evaluation (2 questions not in the training data):"
    rows = {ln.split("  ")[1].strip(): ln.split()[-2:] for ln in lines[3:6]}
    assert rows["held-out loss"] == ["7.5000", "0.0100"] and rows["held-out perplexity"] == ["1808.04", "1.01"]
    assert lines[5].split()[-6:] == ["0/2", "=", "0.0%", "1/2", "=", "50.0%"]
    assert lines[6] == "  10 steps, wall time 12 s (training 10 s), 500 tokens/s"
    assert lines[7].endswith("-> 'b a' (right)") and lines[8].endswith("-> 'c' (wrong, want 'd c')")
    assert lines[9] == "  (before training, the first answer was 'x')"
    dup = before_after_table({}, {"eval_loss": 1.0, "eval_ppl": 2.72}, steps=1, wall_s=1, train_s=1, tokens=1,
                             overlap=3, n_heldout=9)
    assert "3 of 9 held-out documents are also in the training data" in dup[1] and "nan" in dup[3]
    assert before_after_table({}, {}, steps=1, wall_s=1, train_s=1, tokens=1) == []
