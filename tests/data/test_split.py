"""ftlib.data.split: a seeded held-out split partitions the documents and is the same on every call."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.data.split import DocSubset, heldout_split


class _Docs:
    def __init__(self, n):
        self.lengths = np.arange(1, n + 1, dtype=np.int64)

    def __getitem__(self, i):
        return ("doc", i)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(2, 500), fraction=st.floats(0.001, 0.999), seed=st.integers(0, 2**31))
def test_split_partitions_the_documents_deterministically(n, fraction, seed):
    docs = _Docs(n)
    n_eval = max(1, round(fraction * n))
    if n_eval >= n:
        with pytest.raises(ValueError, match="leaves none to train on"):
            heldout_split(docs, fraction, seed=seed)
        return
    train, held = heldout_split(docs, fraction, seed=seed)
    assert len(held) == n_eval and len(train) == n - n_eval
    assert sorted(np.concatenate([train.indices, held.indices]).tolist()) == list(range(n))
    assert list(train.indices) == sorted(train.indices) and list(held.indices) == sorted(held.indices)
    again = heldout_split(docs, fraction, seed=seed)
    assert np.array_equal(again[1].indices, held.indices)
    perm = np.random.default_rng([seed, 7]).permutation(n)  # the documented draw
    assert np.array_equal(held.indices, np.sort(perm[:n_eval]))
    i = int(len(held) // 2)
    assert held[i] == ("doc", int(held.indices[i])) and held.lengths[i] == docs.lengths[held.indices[i]]


def test_bad_fraction_and_indices_are_refused():
    for f in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="fraction must be in"):
            heldout_split(_Docs(10), f)
    with pytest.raises(ValueError, match=r"document ids in \[0, 10\)"):
        DocSubset(_Docs(10), [3, 10])
