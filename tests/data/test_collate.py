import numpy as np
import pytest
import torch

from ftlib.data import length_grouped_batches, pad_collate, padding_fraction

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
