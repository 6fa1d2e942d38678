import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.data import collate_packed, length_grouped_batches, pad_collate, padding_fraction
from ftlib.data.collate import doc_labels

DOCS = [(np.array([1, 2, 3]), np.array([0, 1, 1], np.uint8)), (np.array([4, 5, 6, 7, 8]), np.ones(5, np.uint8))]


def test_right_padding_rounded_to_multiple():
    b = pad_collate(DOCS, pad_id=0, pad_to_multiple_of=8)
    assert b["input_ids"].tolist() == [[1, 2, 3, 0, 0, 0, 0, 0], [4, 5, 6, 7, 8, 0, 0, 0]]
    assert b["labels"].tolist() == [[-100, 2, 3] + [-100] * 5, [-100, 5, 6, 7, 8] + [-100] * 3]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    assert b["input_ids"].dtype == b["labels"].dtype == b["attention_mask"].dtype == torch.int64


def test_left_padding_and_cap():
    b = pad_collate(DOCS, pad_id=9, pad_to_multiple_of=8, max_length=6, padding_side="left")
    assert b["input_ids"].tolist() == [[9, 9, 9, 1, 2, 3], [9, 4, 5, 6, 7, 8]]
    assert b["labels"].tolist() == [[-100, -100, -100, -100, 2, 3], [-100, -100, 5, 6, 7, 8]]
    assert b["attention_mask"].tolist() == [[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]]
    with pytest.raises(ValueError, match="document 1 of the batch has 5 tokens > max_length=4"):
        pad_collate(DOCS, pad_id=0, max_length=4)


def test_length_grouping_is_a_partition_and_cuts_padding():
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.normal(5, 1, size=2000)).astype(int) + 1  # long-tailed
    batches = length_grouped_batches(lengths, 16, np.random.default_rng(1))
    flat = np.concatenate(batches)
    assert np.array_equal(np.sort(flat), np.arange(len(lengths)))
    assert lengths[batches[0]].max() == lengths.max()  # longest batch first
    random_batches = np.array_split(np.random.default_rng(1).permutation(len(lengths)), 125)
    grouped, rand = padding_fraction(lengths, batches), padding_fraction(lengths, random_batches)
    assert grouped < rand / 3, (grouped, rand)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=120), st.integers(1, 9), st.integers(1, 4),
       st.integers(0, 10**6))
def test_length_grouping_puts_the_short_batch_last_and_the_longest_first(lengths, batch_size, mult, seed):
    """A partition; every batch full but the last; the first batch holds the longest document."""
    lengths = np.asarray(lengths)
    batches = length_grouped_batches(lengths, batch_size, np.random.default_rng(seed), mult)
    assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(len(lengths)))
    assert all(len(b) == batch_size for b in batches[:-1]) and 1 <= len(batches[-1]) <= batch_size
    if len(batches[0]) == batch_size:  # when there is a full batch, it carries the longest document
        assert lengths[batches[0]].max() == lengths.max()


def test_labels_are_built_one_way_for_padded_and_packed_batches():
    from ftlib.data import pack

    docs = [(np.array([5, 6, 7, 8]), np.array([0, 1, 1, 0], np.uint8)), (np.array([9, 10]), np.array([1, 1], np.uint8))]
    want = [doc_labels(t, m).tolist() for t, m in docs]
    assert want == [[-100, 6, 7, -100], [-100, 10]]
    padded = pad_collate(docs, pad_id=0)["labels"]
    assert padded[0].tolist() == want[0] and padded[1, :2].tolist() == want[1]
    plan = pack([4, 2], 6)
    packed = collate_packed(plan, [0], docs.__getitem__, 0)["labels"][0].tolist()
    assert packed == want[0] + want[1]
    filler = collate_packed(plan, [0], docs.__getitem__, 0, loss=[False])
    assert (filler["labels"] == -100).all() and filler["input_ids"][0].tolist() == [5, 6, 7, 8, 9, 10]
