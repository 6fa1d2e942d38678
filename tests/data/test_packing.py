import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.data import bfd_assign, collate_packed, cpp_available, pack

lengths_st = st.lists(st.integers(1, 200), min_size=1, max_size=60)
seq_st = st.integers(1, 64)


def _docs(lengths):
    """Documents with globally distinct token values, so every token can be traced."""
    out, base = [], 0
    for L in lengths:
        out.append((np.arange(base, base + L, dtype=np.int64), np.ones(L, np.uint8)))
        base += L
    return out


@settings(max_examples=60, deadline=None)
@given(lengths_st, seq_st, st.sampled_from(["split", "truncate"]))
def test_rows_fit_and_every_token_kept_exactly_once(lengths, seq_len, overflow):
    plan = pack(lengths, seq_len, overflow)
    fills = np.add.reduceat(plan.length, plan.row_ptr[:-1]) if plan.n_rows else np.zeros(0)
    assert (fills <= seq_len).all() and (np.diff(plan.row_ptr) > 0).all()
    for d, L in enumerate(lengths):
        sel = plan.doc == d
        starts, lens = plan.start[sel], plan.length[sel]
        o = np.argsort(starts)
        starts, lens = starts[o], lens[o]
        kept = min(L, seq_len) if overflow == "truncate" else L
        assert starts[0] == 0 and (starts[1:] == (starts + lens)[:-1]).all() and (starts + lens)[-1] == kept
    st_ = plan.stats
    assert st_.n_tokens == int(plan.length.sum()) and st_.n_rows == plan.n_rows
    assert st_.n_truncated_tokens == (sum(max(0, L - seq_len) for L in lengths) if overflow == "truncate" else 0)


@pytest.mark.skipif(not cpp_available(), reason="no C++ compiler")
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), max_size=300), st.integers(50, 80), st.booleans())
def test_cpp_and_numpy_identical(lengths, cap, presort):
    x = np.asarray(lengths, dtype=np.int64)
    if presort:
        x = np.sort(x)[::-1]
    a, na = bfd_assign(x, cap, backend="cpp")
    b, nb = bfd_assign(x, cap, backend="numpy")
    assert na == nb and np.array_equal(a, b)


def test_bfd_known_instance_and_tie_rule():
    plan = pack([5, 4, 3, 3, 2, 2, 1], 8, backend="numpy")
    assert [[p[0] for p in plan.row(r)] for r in range(plan.n_rows)] == [[0, 2], [1, 3, 6], [4, 5]]
    plan = pack([3, 3, 1], 4)  # rooms tie at 1: the lower row id takes the 1
    assert [[p[0] for p in plan.row(r)] for r in range(plan.n_rows)] == [[0, 2], [1]]
    with pytest.raises(ValueError, match="empty"):
        pack([3, 0], 4)
    with pytest.raises(ValueError, match="outside"):
        bfd_assign(np.array([5]), 4)


def test_forcing_cpp_without_compiler_is_an_error(monkeypatch):
    from ftlib.data import packing

    monkeypatch.setattr(packing, "_FN", [None])
    with pytest.raises(RuntimeError, match="forced"):
        bfd_assign(np.array([1, 2]), 4, backend="cpp")
    assert bfd_assign(np.array([3, 2, 2]), 4)[1] == 2  # auto falls back to NumPy


@settings(max_examples=50, deadline=None)
@given(lengths_st, seq_st, st.integers(1, 4), st.data())
def test_packed_batch_contract(lengths, seq_len, B, data):
    docs = _docs(lengths)
    plan = pack(lengths, seq_len)
    rows = data.draw(st.lists(st.integers(0, plan.n_rows - 1), min_size=1, max_size=B, unique=True))
    batch = collate_packed(plan, rows, docs.__getitem__, pad_id=-1)
    ids, labels, pos, cu = (batch[k].numpy() for k in ("input_ids", "labels", "position_ids", "cu_seqlens"))
    n, T = len(rows), seq_len
    assert ids.shape == labels.shape == pos.shape == (n, T) and cu.dtype == np.int32
    assert cu[0] == 0 and cu[-1] == n * T and (np.diff(cu) > 0).all()
    assert set(range(0, n * T + 1, T)) <= set(cu.tolist())  # every row boundary is a segment boundary
    assert batch["max_seqlen"] == int(np.diff(cu).max())
    flat_ids, flat_lab, flat_pos = ids.ravel(), labels.ravel(), pos.ravel()
    for a, b in zip(cu[:-1], cu[1:]):
        assert a // T == (b - 1) // T  # no segment crosses a row
        assert (flat_pos[a:b] == np.arange(b - a)).all() and flat_lab[a] == -100
        seg = flat_ids[a:b]
        if seg[0] == -1:  # padding segment
            assert (seg == -1).all() and (flat_lab[a:b] == -100).all()
        else:  # one contiguous slice of one document, labels aligned with ids
            assert (np.diff(seg) == 1).all() and (flat_lab[a + 1 : b] == seg[1:]).all()
    want = np.concatenate([docs[d][0][s : s + k] for r in rows for d, s, k in plan.row(r)])
    assert np.array_equal(np.sort(flat_ids[flat_ids >= 0]), np.sort(want))


def test_loss_mask_becomes_labels():
    docs = [(np.array([5, 6, 7, 8]), np.array([0, 0, 1, 1], np.uint8))]
    b = collate_packed(pack([4], 6), [0], docs.__getitem__, pad_id=0)
    assert b["labels"].tolist() == [[-100, -100, 7, 8, -100, -100]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1]] and b["cu_seqlens"].tolist() == [0, 4, 6]


def test_float_lengths_are_refused_not_truncated():
    """bfd_assign's C++ and NumPy paths read int64 lengths: float lengths (2.7 tokens) were truncated."""
    with pytest.raises(ValueError, match="lengths must be integers.*float64"):
        bfd_assign(np.array([1.5, 2.7, 3.9]), 4)
    assert bfd_assign(np.array([], dtype=np.float64), 4)[1] == 0 and bfd_assign([1, 3], 4)[1] == 1


def test_pack_backend_switch_is_read_from_the_one_table(monkeypatch):
    """FTLIB_PACK_BACKEND goes through ftlib._backends: a bad value names the variable and its values;
    ``numpy`` forced gives the same rows as ``auto``."""
    lengths = np.array([5, 3, 7, 2, 6], dtype=np.int64)
    auto = bfd_assign(lengths, 8)
    monkeypatch.setenv("FTLIB_PACK_BACKEND", "numpy")
    rows, n = bfd_assign(lengths, 8)
    assert n == auto[1] and rows.tolist() == auto[0].tolist()
    monkeypatch.setenv("FTLIB_PACK_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"FTLIB_PACK_BACKEND='fast': expected one of auto\|cpp\|numpy"):
        bfd_assign(lengths, 8)
