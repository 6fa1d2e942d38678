"""Weighted mixtures: each source its own documents, sampled by weight per epoch, deterministic,
rank-sharded, resumed exactly; the realised mix reported."""

import numpy as np
import pytest

from ftlib.data import MixedDocs, TokenLoader, parse_mixture
from ftlib.data.mixture import mixture_counts


class _Docs:
    """n documents whose every token is ``tok`` (so a batch shows which source each token came from)."""

    def __init__(self, n, tok, seed):
        self.lengths = np.random.default_rng(seed).integers(5, 40, n)
        self.tok = tok

    def __getitem__(self, i):
        n = int(self.lengths[i])
        return np.full(n, self.tok, np.int64), np.ones(n, np.uint8)


def _mixed():
    return MixedDocs([_Docs(300, 1, 0), _Docs(60, 2, 1)], names=["a.jsonl", "b/"])


def _loader(**kw):
    return TokenLoader(_mixed(), batch_size=4, seq_len=64, pad_id=0, seed=3, weights=[0.7, 0.3], **kw)


def _tokens(batches):
    return [b["input_ids"].numpy().copy() for b in batches]


def test_parse_mixture():
    assert parse_mixture(["a.jsonl:0.7", "b/:0.3"]) == [("a.jsonl", 0.7), ("b/", 0.3)]
    assert parse_mixture(["a.jsonl", "hf://datasets/o/n"]) == [("a.jsonl", None), ("hf://datasets/o/n", None)]
    assert parse_mixture(["hf://datasets/o/n:2"]) == [("hf://datasets/o/n", 2.0)]
    assert parse_mixture({"a": 1, "b": 3}) == [("a", 1.0), ("b", 3.0)]
    for bad in (["a:0.7", "b"], ["a:0"], ["a:-1"], ["a:nan"]):
        with pytest.raises(ValueError):
            parse_mixture(bad)
    assert mixture_counts([0.7, 0.3], 10).tolist() == [7, 3] and mixture_counts([1, 1, 1], 10).sum() == 10


def test_the_realised_mix_follows_the_weights_and_rows_never_mix_sources():
    loader = _loader()
    mix = loader.mix()
    assert abs(mix["a.jsonl"]["share"] - 0.7) < 0.02 and abs(mix["b/"]["share"] - 0.3) < 0.02  # of the tokens
    assert loader.n_units - 8 < mix["a.jsonl"]["units"] + mix["b/"]["units"] <= loader.n_units  # less the short step
    for b in loader:
        for row in b["input_ids"].numpy():
            assert len(set(row[row != 0].tolist())) <= 1  # a packed row holds one source's documents
    # source b is upsampled (its natural share is ~1/6): each of its rows is used, repeats spread evenly
    steps = np.concatenate(loader._global_steps(0))
    b_rows = steps[loader.groups[steps] == 1]
    counts = np.bincount(b_rows, minlength=loader.n_units)[loader.groups == 1]
    assert counts.min() >= 1 and counts.max() - counts.min() <= 1
    assert loader.mix(0) != loader.mix(1) or not np.array_equal(loader._global_steps(0)[0], loader._global_steps(1)[0])


def test_a_mixture_is_deterministic_and_rank_sharded():
    one = _tokens(_loader())
    assert all(np.array_equal(x, y) for x, y in zip(one, _tokens(_loader())))
    ranks = [TokenLoader(_mixed(), batch_size=2, seq_len=64, pad_id=0, seed=3, weights=[0.7, 0.3], rank=r,
                         world_size=2) for r in (0, 1)]
    g = ranks[0]._global_steps(0)
    assert all(np.array_equal(s, a) for s, a in zip(_loader()._global_steps(0), g))  # same draw on every rank
    for k, s in enumerate(g):
        assert np.array_equal(np.concatenate([ranks[0].rank_steps()[k], ranks[1].rank_steps()[k]]), s)


def test_a_mixture_resumes_exactly():
    full = _loader()
    ref = []
    for e in range(2):
        full.set_epoch(e)
        ref += _tokens(full)
    part = _loader()
    it, got = iter(part), []
    for _ in range(5):
        got.append(next(it)["input_ids"].numpy().copy())
    state = part.state_dict()
    resumed = _loader()
    resumed.load_state_dict(state)
    got += _tokens(resumed)
    resumed.set_epoch(1)
    got += _tokens(resumed)
    assert len(got) == len(ref) and all(np.array_equal(x, y) for x, y in zip(got, ref))
    other = TokenLoader(_mixed(), batch_size=4, seq_len=64, pad_id=0, seed=3, weights=[0.5, 0.5])
    with pytest.raises(ValueError, match="mixture_weights"):
        other.load_state_dict(state)


def test_data_flag_weights_are_checked_with_one_line_naming_the_flag():
    from ftlib.data.cli import FlagError, data_sources

    assert data_sources(["a.jsonl:0.7", "b/:0.3"]) == [("a.jsonl", 0.7), ("b/", 0.3)]
    with pytest.raises(FlagError, match=r"^--data: give every source a weight or none: b/ has none"):
        data_sources(["a.jsonl:0.7", "b/"])


@pytest.mark.parametrize("value", [["a.jsonl:0.7", "b/:0.3"], {"a.jsonl": 0.7, "b/": 0.3}], ids=["list", "mapping"])
def test_a_mixture_in_a_config_file(tmp_path, value):
    import json

    from ftlib.data.cli import FlagParser, data_sources
    from ftlib.train.cli import add_data_flags, parse_with_config

    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"data": value}))
    p = FlagParser()
    add_data_flags(p)
    p.add_argument("--config")
    args = parse_with_config(p, ["--config", str(cfg)])
    assert data_sources(args.data) == [("a.jsonl", 0.7), ("b/", 0.3)]


@pytest.mark.parametrize("group_by_length", [False, True])
def test_a_mixture_of_padded_documents(group_by_length):
    loader = TokenLoader(_mixed(), batch_size=4, pad_id=0, packing=False, seed=1, weights=[1, 1],
                         group_by_length=group_by_length)
    mix = loader.mix()
    assert abs(mix["a.jsonl"]["share"] - 0.5) < 0.03
    seen = [set(b["input_ids"].numpy().ravel().tolist()) - {0} for b in loader]
    assert len(seen) == len(loader) and {1, 2} <= set().union(*seen)
