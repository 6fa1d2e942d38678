"""Reward model: pooling in every batch layout, score(), Bradley-Terry loss, transformers parity both ways."""

import json
import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.losses import bradley_terry_loss
from ftlib.models import (
    LlamaForCausalLM,
    LlamaRewardModel,
    load_reward_model,
    pairwise_accuracy,
    save_pretrained,
    save_reward_model,
    score,
)
from ftlib.models.reward import last_token_index

PAD = 0


def packed_row(docs):
    """``docs`` as one packed row (one cu_seqlens segment each), the layout score() builds."""
    n = [len(d) for d in docs]
    cu = torch.tensor([0] + n).cumsum(0).to(torch.int32)
    return {"input_ids": torch.tensor([t for d in docs for t in d])[None],
            "position_ids": torch.cat([torch.arange(k) for k in n])[None], "cu_seqlens": cu, "max_seqlen": max(n)}


def reward_model(make_config, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = make_config(pad_token_id=PAD, **kw)
    rm = LlamaRewardModel(cfg)
    with torch.no_grad():
        rm.score.weight.normal_()  # a head of a useful scale: scores differ visibly between documents
    return rm.eval()


def docs(seed=0, n=5):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 9, 1, 6, 12, 7, 2][:n]
    return [torch.randint(1, 128, (k,), generator=g).tolist() for k in lengths]


def one_by_one(rm, ds):
    with torch.no_grad():
        return torch.stack([rm(torch.tensor([d]))[0] for d in ds]).float()


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_padded_packed_and_plain_layouts_score_alike(make_config, model_type):
    """Each document's score is its last token's, whatever the layout: alone, right- or left-padded, packed."""
    rm = reward_model(make_config, model_type=model_type)
    ds = docs()
    want = one_by_one(rm, ds)
    t = max(map(len, ds))
    for side in ("right", "left"):
        ids = torch.full((len(ds), t), PAD)
        mask = torch.zeros(len(ds), t, dtype=torch.long)
        for i, d in enumerate(ds):
            sl = slice(0, len(d)) if side == "right" else slice(t - len(d), t)
            ids[i, sl], mask[i, sl] = torch.tensor(d), 1
        with torch.no_grad():
            torch.testing.assert_close(rm(ids, attention_mask=mask).float(), want, atol=1e-5, rtol=1e-5)
    b = packed_row(ds)
    with torch.no_grad():
        got = rm(b["input_ids"], position_ids=b["position_ids"], cu_seqlens=b["cu_seqlens"], max_seqlen=b["max_seqlen"])
    torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(score(rm, ds), want, atol=1e-5, rtol=1e-5)


def test_score_keeps_order_whatever_the_row_budget(make_config):
    rm = reward_model(make_config)
    ds = docs(n=7)
    want = one_by_one(rm, ds)
    rm.train()
    for budget in (1, 10, 13, 10_000):  # 1: a row per document; 13: uneven rows
        torch.testing.assert_close(score(rm, ds, max_tokens=budget), want, atol=1e-5, rtol=1e-5)
    assert rm.training  # mode restored
    with pytest.raises(ValueError, match="document 2 is empty"):
        score(rm, [[1, 2], [3], []])


def test_score_index_leaves_out_padding_segments(make_config):
    """A packed row with a padding tail (as ftlib.data packs): score_index picks the documents' last tokens."""
    rm = reward_model(make_config)
    ds = docs(n=3)
    want = one_by_one(rm, ds)
    b = packed_row(ds + [[PAD] * 4])  # the tail as its own segment
    idx = last_token_index(b["input_ids"], cu_seqlens=b["cu_seqlens"])[:3]
    with torch.no_grad():
        got = rm(b["input_ids"], cu_seqlens=b["cu_seqlens"], score_index=idx)
    torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="score_index must lie in"):
        rm(b["input_ids"], cu_seqlens=b["cu_seqlens"], score_index=torch.tensor([99]))
    with pytest.raises(ValueError, match="rows without a real token"):
        rm(torch.ones(2, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 0], [0, 0, 0]]))


# ---- Bradley-Terry --------------------------------------------------------------------------------

finite = st.floats(-50, 50, allow_nan=False)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(finite, finite, st.floats(0, 5)), min_size=1, max_size=12))
def test_bradley_terry_closed_form_and_gradient(rows):
    """Invariants: loss_sum = sum log(1 + exp(-(d - m))) >= 0; d/dr_c = -sigmoid(-(d - m)) = -d/dr_r."""
    c = torch.tensor([r[0] for r in rows], dtype=torch.float64, requires_grad=True)
    r = torch.tensor([r[1] for r in rows], dtype=torch.float64, requires_grad=True)
    m = torch.tensor([r[2] for r in rows], dtype=torch.float64)
    loss, n = bradley_terry_loss(c, r, margin=m)
    want = sum(math.log1p(math.exp(-(a - b - mm))) for a, b, mm in rows)
    assert int(n) == len(rows) and float(loss.detach()) >= 0
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12, abs=1e-12)
    loss.backward()
    sig = torch.sigmoid(-(c.detach() - r.detach() - m))
    torch.testing.assert_close(c.grad, -sig)
    torch.testing.assert_close(r.grad, sig)


def test_bradley_terry_is_stable_far_out_and_takes_a_scalar_margin():
    c = torch.tensor([1000.0, -1000.0, 0.0], dtype=torch.bfloat16)
    r = torch.zeros(3, dtype=torch.bfloat16)
    loss, n = bradley_terry_loss(c, r)
    assert loss.dtype == torch.float32 and float(loss) == pytest.approx(1000.0 + math.log(2.0))
    assert float(bradley_terry_loss(torch.zeros(2), torch.zeros(2), margin=1.0)[0]) == pytest.approx(
        2 * float(F.softplus(torch.tensor(1.0))))
    with pytest.raises(ValueError, match="one shape"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="margin must be"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(3), margin=torch.zeros(2))
    assert pairwise_accuracy(torch.tensor([1.0, 0.0, 2.0, 1.0]), torch.tensor([0.0, 1.0, 2.0, 0.0])) == 0.625


# ---- files ---------------------------------------------------------------------------------------


def _padded(ds):
    t = max(map(len, ds))
    ids = torch.full((len(ds), t), PAD)
    mask = torch.zeros(len(ds), t, dtype=torch.long)
    for i, d in enumerate(ds):
        ids[i, : len(d)], mask[i, : len(d)] = torch.tensor(d), 1
    return ids, mask


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_saved_reward_model_loads_in_transformers_with_equal_scores(make_config, model_type, tmp_path):
    transformers = pytest.importorskip("transformers")
    rm = reward_model(make_config, model_type=model_type)
    save_reward_model(rm, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"][0].endswith("ForSequenceClassification") and cfg["pad_token_id"] == PAD
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == cfg["architectures"][0] and hf.config.num_labels == 1
    ids, mask = _padded(docs())
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        torch.testing.assert_close(rm(ids, attention_mask=mask), want, atol=1e-5, rtol=1e-5)
    # and back: transformers' files load in ftlib with the same scores
    hf.save_pretrained(tmp_path / "hf")
    back = load_reward_model(tmp_path / "hf").eval()
    torch.testing.assert_close(score(back, docs()), want, atol=1e-5, rtol=1e-5)


def test_causal_lm_checkpoint_gives_the_decoder_and_a_fresh_head(make_model, tmp_path, caplog):
    lm = make_model()
    save_pretrained(lm, tmp_path)
    with caplog.at_level(logging.WARNING, logger="ftlib.models"):
        rm = load_reward_model(tmp_path)
    assert any("newly initialised" in r.getMessage() for r in caplog.records)
    for name, p in lm.model.state_dict().items():
        assert torch.equal(rm.model.state_dict()[name], p), name
    std = float(rm.score.weight.detach().std())
    assert 0.005 < std < 0.05  # N(0, initializer_range = 0.02)
    shared = LlamaRewardModel.from_causal_lm(lm)
    assert shared.model is lm.model and not hasattr(shared, "lm_head")


def test_bad_files_are_refused(make_config, tmp_path):
    rm = reward_model(make_config)
    save_reward_model(rm, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["id2label"] = {"0": "a", "1": "b"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="2 labels; a reward model has one"):
        load_reward_model(tmp_path)
    with pytest.raises(TypeError, match="merge LoRA adapters first"):
        save_reward_model(LlamaForCausalLM(make_config()), tmp_path / "x")


EOS = 2


def test_pad_equal_to_eos_warns_at_save(make_config, tmp_path):
    torch.manual_seed(0)
    rm = LlamaRewardModel(make_config(pad_token_id=EOS, eos_token_id=[7, EOS]))
    ended = [d + [EOS] for d in docs()]  # documents ending in EOS, as chat templates write them
    with pytest.warns(UserWarning, match="pad_token_id 2 is also the EOS id"):
        save_reward_model(rm, tmp_path / "same")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dedicated pad id: no warning
        save_reward_model(rm, tmp_path / "dedicated", pad_token_id=PAD)
    transformers = pytest.importorskip("transformers")
    ours = score(rm, ended)
    for name, differs in (("same", True), ("dedicated", False)):
        hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / name).eval()
        with torch.no_grad():  # one document per row: no padding, only the pooling rule differs
            theirs = torch.stack([hf(input_ids=torch.tensor([d])).logits.reshape(()) for d in ended])
        # what the warning is about: transformers pools at the token before the trailing EOS
        assert (not torch.allclose(theirs, ours, atol=1e-5)) == differs, name
