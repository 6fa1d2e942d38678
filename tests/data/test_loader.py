
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.data import (
    FormatConfig,
    TokenLoader,
    build_cache,
    pack,
)


class MemDocs:
    """Documents whose token values are their global token positions (traceable)."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)])

    def __getitem__(self, i):
        a, b = int(self.starts[i]), int(self.starts[i + 1])
        return np.arange(a, b) + 1, np.ones(b - a, np.uint8)  # +1: 0 is the pad id


def _lengths(n, seed=0):
    return np.random.default_rng(seed).integers(1, 40, size=n)


def _tokens(batches):
    return [t for b in batches for t in b["input_ids"].ravel().tolist() if t != 0]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 60), st.integers(1, 4), st.integers(1, 4), st.booleans(), st.booleans(), st.integers(0, 3))
def test_ranks_partition_every_epoch(n, batch_size, world, packing, drop_last, epoch):
    docs = MemDocs(_lengths(n, n))
    n_units = pack(docs.lengths, 48).n_rows if packing else n
    if drop_last and n_units < batch_size * world:  # no batch at all: refused
        with pytest.raises(ValueError, match="no batch would ever be yielded"):
            TokenLoader(docs, batch_size=batch_size, pad_id=0, seq_len=48, packing=packing, world_size=world, rank=0)
        return
    loaders = [TokenLoader(docs, batch_size=batch_size, pad_id=0, seq_len=48, packing=packing, rank=r,
                           world_size=world, drop_last=drop_last, seed=7) for r in range(world)]
    units = np.concatenate([np.concatenate(L.rank_steps(epoch) or [np.zeros(0, int)]) for L in loaders])
    real = units[units >= 0]  # a negative id is a filler copy (no labels) of unit -1 - id
    assert len(np.unique(real)) == len(real)  # no unit on two ranks or twice on one
    n_units = loaders[0].n_units
    G = batch_size * world
    assert len(real) == (n_units // G * G if drop_last else n_units)
    assert len({len(L.rank_steps(epoch)) for L in loaders}) == 1  # ranks stay in lock-step (no DDP hang)
    for L in loaders:
        sizes = [len(s) for s in L.rank_steps(epoch)]
        assert min(sizes) >= 1 and all(n == batch_size for n in sizes[:-1])  # only the last step is short
    if not drop_last and n_units % G:  # the short last step is split evenly: real units per rank differ by <= 1
        last = [int((L.rank_steps(epoch)[-1] >= 0).sum()) for L in loaders]
        assert sum(last) == n_units % G and max(last) - min(last) <= 1
    # the batches themselves carry exactly those units' tokens
    if not packing and not drop_last:
        toks = []
        for L in loaders:
            L.set_epoch(epoch)
            for units, batch in zip(L.rank_steps(epoch), L):
                filler = torch.as_tensor(units < 0)
                assert (batch["labels"][filler] == -100).all()  # a filler row teaches nothing
                toks += [t for t in batch["input_ids"][~filler].ravel().tolist() if t != 0]
        assert sorted(toks) == list(range(1, int(docs.lengths.sum()) + 1))


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 12), st.booleans(), st.booleans(), st.integers(1, 3))
def test_resume_from_any_position_yields_exactly_the_rest(k, packing, group, world):
    docs = MemDocs(_lengths(50))
    kw = dict(batch_size=3, pad_id=0, seq_len=32, packing=packing, seed=3, group_by_length=group and not packing,
              pad_to_multiple_of=8, rank=world - 1, world_size=world)
    ref = TokenLoader(docs, **kw)
    full = []
    for epoch in range(2):  # two epochs of the user loop
        ref.set_epoch(epoch)
        full += [(epoch, b) for b in ref]
    k = min(k, len(full) - 1)
    run = TokenLoader(docs, **kw)
    seen, state = 0, None
    for epoch in range(2):
        run.set_epoch(epoch)
        for _ in run:
            seen += 1
            if seen == k:
                state = run.state_dict()
                break
        if state is not None:
            break
    resumed = TokenLoader(docs, **kw)
    if state is not None:
        resumed.load_state_dict(state)
    rest = []
    for epoch in range(state["epoch"] if state else 0, 2):
        resumed.set_epoch(epoch)
        rest += [(epoch, b) for b in resumed]
    assert len(rest) == len(full) - k
    for (e1, a), (e2, b) in zip(rest, full[k:]):
        assert e1 == e2 and all(torch.equal(a[key], b[key]) for key in a if key != "max_seqlen")


def test_epochs_are_deterministic_and_differ():
    docs = MemDocs(_lengths(40))
    a, b = (TokenLoader(docs, batch_size=2, pad_id=0, seq_len=40, seed=1) for _ in range(2))
    assert [s.tolist() for s in a.rank_steps(0)] == [s.tolist() for s in b.rank_steps(0)]
    assert [s.tolist() for s in a.rank_steps(0)] != [s.tolist() for s in a.rank_steps(1)]
    # a loop without set_epoch moves on to the next epoch by itself
    first, second = list(a), list(a)
    assert a.epoch == 2 and len(first) == len(second) and not torch.equal(first[0]["input_ids"], second[0]["input_ids"])


def test_state_mismatch_is_refused():
    docs = MemDocs(_lengths(20))
    s = TokenLoader(docs, batch_size=2, pad_id=0, seq_len=40).state_dict()
    with pytest.raises(ValueError, match="'batch_size'"):
        TokenLoader(docs, batch_size=4, pad_id=0, seq_len=40).load_state_dict(s)


@pytest.mark.filterwarnings("ignore:.pin_memory. argument is set as true")
def test_workers_pin_memory_prefetch_match_single_process(tmp_path, tokenizer, write_jsonl):
    words = "hello world the quick brown fox".split()
    rng = np.random.default_rng(0)
    write_jsonl(tmp_path / "a.jsonl", [{"text": " ".join(rng.choice(words, rng.integers(1, 20)))} for _ in range(60)])

    cache = build_cache(str(tmp_path / "a.jsonl"), tokenizer, FormatConfig(kind="text", eos_token="</s>"),
                        str(tmp_path / "c"), progress=False)
    kw = dict(batch_size=4, pad_id=0, seq_len=32, seed=5, rank=1, world_size=2)
    ref = list(TokenLoader(cache, **kw))
    par = TokenLoader(cache, num_workers=2, pin_memory=True, prefetch_factor=2, **kw)
    it = iter(par)
    got = [next(it) for _ in range(3)]
    state = par.state_dict()
    assert state["step"] == 3  # prefetched batches are not counted as seen
    resumed = TokenLoader(cache, num_workers=2, **kw)
    resumed.load_state_dict(state)
    got += list(resumed)
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert all(torch.equal(a[k], b[k]) for k in a if k != "max_seqlen") and a["max_seqlen"] == b["max_seqlen"]


def test_chat_cache_to_packed_batches_end_to_end(tmp_path, tokenizer, write_jsonl):
    """Labels of a packed batch are exactly the assistant turns (+ turn end) of each conversation."""

    recs = [{"messages": [{"role": "user", "content": f"why {'is the sky blue ' * (i % 3 + 1)}"},
                          {"role": "assistant", "content": "because of Rayleigh scattering" + " hi" * i}]}
            for i in range(12)]
    write_jsonl(tmp_path / "chat.jsonl", recs)
    cache = build_cache(str(tmp_path / "chat.jsonl"), tokenizer, FormatConfig(kind="chat", chat_template="chatml"),
                        str(tmp_path / "c"), progress=False)
    assert cache.lengths.max() <= 128  # no document is split, so every label survives
    loader = TokenLoader(cache, batch_size=2, seq_len=128, pad_id=0, seed=0, drop_last=False)
    got = []
    for batch in loader:
        labels = batch["labels"].ravel()
        cu = batch["cu_seqlens"].tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            lab = labels[a:b]
            if (lab != -100).any():
                got.append(tokenizer.decode(lab[lab != -100].tolist(), skip_special_tokens=False))
    want = ["because of Rayleigh scattering" + " hi" * i + "<|im_end|>" for i in range(12)]
    assert sorted(got) == sorted(want)


def test_too_few_units_for_one_global_step_is_an_error_not_an_empty_epoch():
    docs = MemDocs(_lengths(5))
    with pytest.raises(ValueError, match=r"5 documents < one global batch of 6 \(batch_size 3 x world_size 2\)"):
        TokenLoader(docs, batch_size=3, pad_id=0, packing=False, rank=0, world_size=2)
    loader = TokenLoader(docs, batch_size=3, pad_id=0, packing=False, rank=1, world_size=2, drop_last=False)
    assert len(loader) == 1  # without drop_last the tail is still served


def test_state_mismatch_on_order_settings_and_data():
    docs = MemDocs(_lengths(30))
    kw = dict(batch_size=2, pad_id=0, packing=False, group_by_length=True)
    s = TokenLoader(docs, **kw).state_dict()
    with pytest.raises(ValueError, match="'mega_batch_mult'"):
        TokenLoader(docs, mega_batch_mult=4, **kw).load_state_dict(s)
    other = MemDocs(_lengths(30, seed=1))  # same number of documents, different data
    with pytest.raises(ValueError, match="'n_tokens'"):
        TokenLoader(other, **kw).load_state_dict(s)
    s = TokenLoader(docs, batch_size=2, pad_id=0, seq_len=16).state_dict()
    with pytest.raises(ValueError, match="'overflow'"):
        TokenLoader(docs, batch_size=2, pad_id=0, seq_len=16, overflow="truncate").load_state_dict(s)


def test_group_by_length_with_shuffle_off_is_refused():
    """Length grouping draws a random order; shuffle=False would be ignored silently."""
    with pytest.raises(ValueError, match="group_by_length shuffles"):
        TokenLoader(MemDocs(_lengths(20)), batch_size=2, pad_id=0, packing=False, group_by_length=True, shuffle=False)


def test_documents_over_max_length_are_refused_up_front_by_index():
    """Not mid-epoch inside a worker, with a batch-local index that names no document."""
    lengths = np.array([5, 9, 3, 12, 4, 4])
    with pytest.raises(ValueError, match=r"2 documents exceed max_length=8 \(first: document 1, 9 tokens\)"):
        TokenLoader(MemDocs(lengths), batch_size=2, pad_id=0, packing=False, max_length=8)
    assert len(TokenLoader(MemDocs(lengths), batch_size=2, pad_id=0, packing=False, max_length=12)) == 3


def test_a_tail_smaller_than_the_world_gives_filler_batches_without_labels():
    """5 packed rows, 2 per rank on 4 ranks: the tail of 1 row goes to rank 0; ranks 1-3 get a
    filler copy of it with no labels, so every rank steps the same number of times."""
    docs = MemDocs([16] * 5)
    loaders = [TokenLoader(docs, batch_size=1, pad_id=0, seq_len=16, drop_last=False, rank=r, world_size=4, seed=0)
               for r in range(4)]
    batches = [list(L) for L in loaders]
    assert [len(b) for b in batches] == [2, 2, 2, 2]
    last = [b[-1] for b in batches]
    assert (last[0]["labels"] != -100).any()
    for b in last[1:]:
        assert (b["labels"] == -100).all() and torch.equal(b["input_ids"], last[0]["input_ids"])


def test_resume_fingerprints_the_lengths_in_order():
    lengths = _lengths(30)
    state = TokenLoader(MemDocs(lengths), batch_size=2, pad_id=0, seq_len=40).state_dict()
    assert len(state["lengths_sha256"]) == 64
    TokenLoader(MemDocs(lengths.copy()), batch_size=2, pad_id=0, seq_len=40).load_state_dict(state)  # same data: fine
    with pytest.raises(ValueError, match="'lengths_sha256'"):
        TokenLoader(MemDocs(lengths[::-1].copy()), batch_size=2, pad_id=0, seq_len=40).load_state_dict(state)


class _Docs:
    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def __getitem__(self, i):
        n = int(self.lengths[i])
        return np.full(n, i + 1), np.ones(n, np.uint8)


@pytest.mark.parametrize("n", [21, 23, 25])
def test_group_by_length_without_drop_last_keeps_ranks_in_step(n):
    """Every rank must yield the same number of batches, none empty, the short step last."""
    lengths = np.random.default_rng(0).integers(1, 50, size=n)
    loaders = [TokenLoader(_Docs(lengths), batch_size=3, pad_id=0, packing=False, group_by_length=True,
                           mega_batch_mult=2, drop_last=False, rank=r, world_size=4, seed=1) for r in range(4)]
    counts = [len(list(L)) for L in loaders]
    print("batches per rank:", counts)
    assert len(set(counts)) == 1
    for L in loaders:
        steps = L.rank_steps(0)
        assert all(len(s) >= 1 for s in steps) and all(len(s) == 3 for s in steps[:-1])


def test_resume_refuses_reordered_documents():
    a = _Docs([5, 9, 3, 7, 2, 8, 4, 6])
    b = _Docs([9, 5, 3, 7, 2, 8, 4, 6])  # same count, same total tokens, two documents swapped
    state = TokenLoader(a, batch_size=2, pad_id=0, packing=False).state_dict()
    with pytest.raises(ValueError, match="loader state mismatch"):
        TokenLoader(b, batch_size=2, pad_id=0, packing=False).load_state_dict(state)
