"""Pair batches: packed layout bookkeeping, padded layout, loader order/resume, margin filtering."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.data.packing import pack
from ftlib.data.pair_batches import (
    MarginFilter,
    PairLoader,
    collate_pairs_packed,
    collate_pairs_padded,
    pair_tokens,
    select_pairs,
)
from ftlib.data.pairs import PairConfig, build_pair_cache


class FakePairs:
    """A PairCache stand-in with explicit token lists; tokens encode (pair, side, position)."""

    def __init__(self, shapes, margins=None, reference=False):
        self.shapes = shapes
        self.prompt_len = np.array([p for p, _, _ in shapes])
        self.chosen_len = np.array([c for _, c, _ in shapes])
        self.rejected_len = np.array([r for _, _, r in shapes])
        self.effective_margin = np.full(len(shapes), np.nan) if margins is None else np.asarray(margins, float)
        self.reference = None
        if reference:
            self.reference = {"chosen": -np.arange(len(shapes), dtype=float), "rejected": -10 - np.arange(len(shapes))}
        self.path = "<fake>"

    def __len__(self):
        return len(self.shapes)

    @property
    def side_lengths(self):
        return self.prompt_len + self.chosen_len, self.prompt_len + self.rejected_len

    def sequence(self, i, side):
        p, c, r = self.shapes[i]
        n = c if side == "chosen" else r
        code = 1 if side == "chosen" else 2
        ids = np.concatenate([1000 * i + np.arange(p), 1000 * i + 100 * code + np.arange(n)]).astype(np.int64)
        mask = np.concatenate([np.zeros(p, np.uint8), np.ones(n, np.uint8)])
        return ids, mask


def _segments(batch):
    flat = batch["input_ids"].reshape(-1)
    cu = batch["cu_seqlens"].tolist()
    return [flat[cu[k] : cu[k + 1]] for k in range(len(cu) - 1)], cu


# prompts may be empty here (the formatter never makes one): the first token of a segment still gets no label
shapes_st = st.lists(st.tuples(st.integers(0, 9), st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(shapes_st, st.integers(0, 30))
def test_packed_pairs_bookkeeping(shapes, extra):
    """Invariants: every pair appears once; its chosen_index / rejected_index segments hold exactly
    prompt+chosen and prompt+rejected, adjacent in the same row; labels are -100 off the responses and on
    each segment's first token; positions restart per segment; padding tails are unnamed segments."""
    pairs = FakePairs(shapes, reference=True)
    sc, sr = pairs.side_lengths
    T = int((sc + sr).max()) + extra
    plan = pack(sc + sr, T, "truncate")
    batch = collate_pairs_packed(pairs, plan, list(range(plan.n_rows)), pad_id=7)
    segs, cu = _segments(batch)
    assert cu[0] == 0 and cu[-1] == batch["input_ids"].numel() and batch["max_seqlen"] == max(np.diff(cu))
    assert sorted(batch["pair_ids"].tolist()) == list(range(len(shapes)))
    labels, pos = batch["labels"].reshape(-1), batch["position_ids"].reshape(-1)
    named = set()
    for k, d in enumerate(batch["pair_ids"].tolist()):
        ci, ri = int(batch["chosen_index"][k]), int(batch["rejected_index"][k])
        assert ri == ci + 1 and cu[ci] // T == (cu[ri + 1] - 1) // T  # adjacent, same row
        for s, side in ((ci, "chosen"), (ri, "rejected")):
            ids, mask = pairs.sequence(d, side)
            assert segs[s].tolist() == ids.tolist()
            lab = labels[cu[s] : cu[s + 1]]
            want = np.where(mask != 0, ids, -100)
            want[0] = -100
            assert lab.tolist() == want.tolist()
            assert pos[cu[s] : cu[s + 1]].tolist() == list(range(len(ids)))
        named |= {ci, ri}
        assert batch["ref_chosen"][k] == pairs.reference["chosen"][d]
    for s in set(range(len(segs))) - named:  # padding tails
        assert (segs[s] == 7).all() and (labels[cu[s] : cu[s + 1]] == -100).all()


def test_padded_pairs_layout():
    pairs = FakePairs([(2, 3, 1), (4, 1, 5)])
    b = collate_pairs_padded(pairs, [1, 0], pad_id=9)
    assert b["input_ids"].shape == (4, 9) and b["chosen_index"].tolist() == [0, 1] and b["rejected_index"].tolist() == [2, 3]
    assert b["input_ids"][0, :5].tolist() == pairs.sequence(1, "chosen")[0].tolist()
    assert b["input_ids"][3, :3].tolist() == pairs.sequence(0, "rejected")[0].tolist()
    assert b["attention_mask"].sum(1).tolist() == [5, 5, 9, 3] and b["pair_ids"].tolist() == [1, 0]
    assert pair_tokens(b) == 5 + 5 + 9 + 3  # both sides of both pairs, no padding
    assert pair_tokens(select_pairs(b, torch.tensor([False, True]))) == 5 + 3


@settings(max_examples=40, deadline=None)
@given(shapes_st, st.data())
def test_select_pairs_equals_collating_the_kept_pairs(shapes, data):
    """Filtering a batch keeps exactly the kept pairs' sequences, compacted (no empty rows, width = the
    fullest row), with valid cu_seqlens; for the padded layout the kept rows in the same order."""
    pairs = FakePairs(shapes, margins=np.arange(len(shapes), dtype=float))
    sc, sr = pairs.side_lengths
    T = int((sc + sr).max()) + 5
    plan = pack(sc + sr, T, "truncate")
    batch = collate_pairs_packed(pairs, plan, list(range(plan.n_rows)), pad_id=0)
    keep = torch.tensor(data.draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes))))
    out = select_pairs(batch, keep)
    kept = batch["pair_ids"][keep].tolist()
    assert out["pair_ids"].tolist() == kept and out["margin"].tolist() == batch["margin"][keep].tolist()
    segs, cu = _segments(out)
    W = out["input_ids"].shape[1] if kept else 0
    for k, d in enumerate(kept):
        for idx, side in ((out["chosen_index"][k], "chosen"), (out["rejected_index"][k], "rejected")):
            assert segs[int(idx)].tolist() == pairs.sequence(d, side)[0].tolist()
            assert out["position_ids"].reshape(-1)[cu[idx] : cu[idx + 1]].tolist() == list(range(len(segs[int(idx)])))
    if kept:
        fills = (out["labels"] != -100).any(1)
        assert fills.all()  # every row holds a kept pair
        assert W == max(sum(len(pairs.sequence(d, s)[0]) for d in row_pairs for s in ("chosen", "rejected"))
                        for row_pairs in _rows_of(out, cu, W))
    padded = collate_pairs_padded(pairs, batch["pair_ids"].numpy(), pad_id=0)
    pout = select_pairs(padded, keep)
    assert pout["pair_ids"].tolist() == kept
    for k, d in enumerate(kept):
        ids = pairs.sequence(d, "rejected")[0]
        row = pout["input_ids"][int(pout["rejected_index"][k])]
        assert row[: len(ids)].tolist() == ids.tolist()


def _rows_of(batch, cu, W):
    rows = {}
    for k, d in enumerate(batch["pair_ids"].tolist()):
        rows.setdefault(cu[int(batch["chosen_index"][k])] // W, []).append(d)
    return list(rows.values())


def test_loader_covers_every_pair_and_resumes(tmp_path):
    pairs = FakePairs([(i % 5 + 1, i % 3 + 1, i % 7 + 1) for i in range(40)])
    for world in (1, 3):
        for packing in (True, False):
            seen = []
            for rank in range(world):
                L = PairLoader(pairs, batch_size=2, pad_id=0, seq_len=24, packing=packing, rank=rank, world_size=world,
                               seed=3, drop_last=False)
                seen += [d for b in L for d in b["pair_ids"].tolist()]
            assert sorted(seen) == list(range(40)), (world, packing)
    L = PairLoader(pairs, batch_size=2, pad_id=0, seq_len=24, seed=5)
    full = [b["pair_ids"].tolist() for b in L]
    L2 = PairLoader(pairs, batch_size=2, pad_id=0, seq_len=24, seed=5)
    it = iter(L2)
    head = [next(it)["pair_ids"].tolist() for _ in range(3)]
    state = L2.state_dict()
    L3 = PairLoader(pairs, batch_size=2, pad_id=0, seq_len=24, seed=5)
    L3.load_state_dict(state)
    assert head + [b["pair_ids"].tolist() for b in L3] == full
    with pytest.raises(ValueError, match="state mismatch on 'seed'"):
        PairLoader(pairs, batch_size=2, pad_id=0, seq_len=24, seed=6).load_state_dict(state)
    longest = int(sum(pairs.side_lengths).max())
    with pytest.raises(ValueError, match=rf"pairs do not fit a row of seq_len=10 .*use seq_len >= {longest} "):
        PairLoader(pairs, batch_size=2, pad_id=0, seq_len=10)
    grouped = PairLoader(pairs, batch_size=4, pad_id=0, packing=False, group_by_length=True, seed=0)
    assert sum(len(b["pair_ids"]) for b in grouped) == 40


def test_margin_filter_rule_schedule_and_counts():
    f = MarginFilter(start=0.3, decay=0.95, every=10, floor=0.05)
    assert f.threshold(0) == 0.3 and f.threshold(9) == 0.3 and math.isclose(f.threshold(10), 0.285)
    assert f.threshold(10_000) == 0.05
    m = torch.tensor([1.0, 2.0, 3.0, 4.0, float("nan"), 10.0])
    keep = f.keep_mask(m, 0)
    ms = np.array([1, 2, 3, 4, 10.0])
    z = (ms - ms.mean()) / ms.std()
    want = np.insert(z > 0.3, 4, True)  # the unscored pair is kept
    assert keep.tolist() == want.tolist()
    assert f.last == {"threshold": 0.3, "kept": int((z > 0.3).sum()), "dropped": int((z <= 0.3).sum()), "unscored": 1}
    f.keep_mask(torch.tensor([5.0, 5.0, 5.0]), 0)  # no spread: nothing to rank, all kept
    assert f.last["kept"] == 3 and f.last["dropped"] == 0
    f.keep_mask(torch.tensor([0.0, 0.0, 0.0, 1.0]), 10_000)
    assert f.last["kept"] == 1
    k = MarginFilter(start=5.0, floor=5.0, min_keep=2).keep_mask(torch.tensor([1.0, 2.0, 3.0, 4.0]), 0)
    assert k.tolist() == [False, False, True, True]  # nobody passes z > 5: the best min_keep stay
    # 1 + 3 + 1 kept, 4 + 0 + 3 dropped, 1 unscored over the three batches
    assert f.counts == {"kept": 5, "dropped": 7, "unscored": 1}
    state = f.state_dict()
    g = MarginFilter()
    g.load_state_dict(state)
    assert g.counts == f.counts
    with pytest.raises(ValueError, match="floor=0.5 is above start=0.3"):
        MarginFilter(floor=0.5)


def test_margin_filter_on_a_real_pair_cache(tmp_path, tokenizer, write_jsonl):
    """Rewards written into the pairs file by a scorer reach the batch; the filter drops the low margins."""
    recs = [{"prompt": f"user asks why {i}", "chosen": "because of Rayleigh scattering", "rejected": "hello world",
             "reward_chosen": float(i), "reward_rejected": 0.0} for i in range(16)]
    cache = build_pair_cache(write_jsonl(tmp_path / "p.jsonl", recs), tokenizer,
                             PairConfig(chat_template="chatml", eos_token="</s>"), str(tmp_path / "c"), progress=False)
    L = PairLoader(cache, batch_size=2, pad_id=0, seq_len=int(sum(cache.side_lengths).max()) * 2, seed=0)
    f = MarginFilter(start=0.0, floor=0.0)
    for batch in L:
        out = f(batch, 0)
        m = batch["margin"]
        assert out["pair_ids"].tolist() == batch["pair_ids"][m > m.mean()].tolist()
        assert out["input_ids"].numel() <= batch["input_ids"].numel()
    assert f.counts["kept"] + f.counts["dropped"] == sum(len(b["pair_ids"]) for b in L) and f.counts["unscored"] == 0


@pytest.mark.parametrize("packing", [False, True])
def test_pair_loader_ranks_yield_equal_counts_with_fillers(packing):
    """9 units, batch 2, 4 ranks, drop_last=False: every rank yields 2 batches (a rank that stops early
    leaves the others waiting in a collective); the short last step is split evenly and a rank without
    a unit gets a filler that names no pair and carries no label; every pair is seen exactly once."""
    pairs = FakePairs([(2, 3, 2)] * 9)  # footprint 9: with seq_len 9 one pair per packed row, 9 units
    loaders = [PairLoader(pairs, batch_size=2, pad_id=0, seq_len=9, packing=packing, drop_last=False, rank=r,
                          world_size=4, seed=0) for r in range(4)]
    batches = [list(L) for L in loaders]
    assert [len(b) for b in batches] == [len(L) for L in loaders] == [2, 2, 2, 2]
    seen = [d for bs in batches for b in bs for d in b["pair_ids"].tolist()]
    assert sorted(seen) == list(range(9))
    last = [bs[-1] for bs in batches]
    assert len(last[0]["pair_ids"]) == 1 and (last[0]["labels"] != -100).any()
    for b in last[1:]:  # fillers: the tail's unit again, a forward's worth of tokens, nothing to learn
        assert b["pair_ids"].numel() == b["chosen_index"].numel() == b["rejected_index"].numel() == 0
        assert b["margin"].numel() == 0 and (b["labels"] == -100).all()
        assert torch.equal(b["input_ids"], last[0]["input_ids"])
        assert pair_tokens(b) == 0  # a filler's tokens are not real tokens of any pair
    sc, sr = pairs.side_lengths
    assert [pair_tokens(b) for b in last] == [int((sc + sr)[last[0]["pair_ids"]].sum()), 0, 0, 0]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 30), st.integers(1, 3), st.integers(1, 5), st.booleans(), st.booleans())
def test_pair_loader_ranks_stay_in_lock_step(n, batch_size, world, packing, drop_last):
    """Invariants of the loader core through the pair front: equal batch counts on every rank, no empty
    batch, no pair on two ranks, and with drop_last=False every pair exactly once."""
    pairs = FakePairs([(i % 4 + 1, i % 3 + 1, i % 5 + 1) for i in range(n)])
    kw = dict(batch_size=batch_size, pad_id=0, seq_len=20, packing=packing, drop_last=drop_last, seed=n)
    n_units = pack(sum(pairs.side_lengths), 20, "truncate").n_rows if packing else n
    if drop_last and n_units < batch_size * world:
        with pytest.raises(ValueError, match="no batch would ever be yielded"):
            PairLoader(pairs, rank=0, world_size=world, **kw)
        return
    per_rank = [list(PairLoader(pairs, rank=r, world_size=world, **kw)) for r in range(world)]
    assert len({len(bs) for bs in per_rank}) == 1
    assert all(b["input_ids"].numel() > 0 for bs in per_rank for b in bs)
    seen = [d for bs in per_rank for b in bs for d in b["pair_ids"].tolist()]
    assert len(seen) == len(set(seen))
    if not drop_last:
        assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("front", ["pairs", "tokens"])
def test_starting_an_iteration_leaves_the_global_torch_rng_alone(front):
    """The DataLoader gets its own generator: starting (or restarting, on resume) an epoch must not
    draw from the global torch RNG, or every later dropout mask of the run shifts."""
    from ftlib.data import TokenLoader

    if front == "pairs":
        loader = PairLoader(FakePairs([(2, 2, 2)] * 8), batch_size=2, pad_id=0, packing=False, seed=1)
    else:
        class Docs:
            lengths = np.full(8, 5)

            def __getitem__(self, i):
                return np.arange(5) + 1, np.ones(5, np.uint8)

        loader = TokenLoader(Docs(), batch_size=2, pad_id=0, packing=False, seed=1)
    torch.manual_seed(0)
    want = torch.rand(4)
    torch.manual_seed(0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.load_state_dict(state)
    next(iter(loader))  # a resumed iteration starts a second DataLoader
    assert torch.equal(torch.rand(4), want)


def test_data_exports_the_preference_pipeline():
    """ftlib.data is the one place to import the data pipeline from, preference pairs included."""
    import ftlib.data as data
    from ftlib.data import pair_batches, pairs

    for mod in (pairs, pair_batches):
        for name in mod.__all__:
            assert name in data.__all__ and getattr(data, name) is getattr(mod, name), name
    assert data.__all__ == sorted(data.__all__) and len(set(data.__all__)) == len(data.__all__)
    assert all(hasattr(data, name) for name in data.__all__)


def test_data_modules_cross_only_through_public_names():
    """No module of ftlib.data imports a private (_name) name from another ftlib module."""
    import ast
    from pathlib import Path

    import ftlib.data

    bad = []
    for path in sorted(Path(ftlib.data.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("ftlib")):
                bad += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_") and a.name != "__all__"]
    assert not bad
