"""A held-out split of a token cache: a fixed, seeded subset of its documents set aside for evaluation.

    train_docs, eval_docs = heldout_split(cache, 0.05, seed=0)
    loader = TokenLoader(train_docs, batch_size=4, seq_len=2048, pad_id=pad)
    eval_loader = TokenLoader(eval_docs, batch_size=4, seq_len=2048, pad_id=pad, shuffle=False, drop_last=False)

The split is a permutation of the document indices drawn from ``np.random.default_rng([seed, 7])``:
the first ``n_eval = max(1, round(fraction * n))`` documents of it are held out, the rest train.
It depends only on ``(n, fraction, seed)``, so every rank and every resumed run draws the same
split, and the two parts partition the cache: no document is in both, none is lost. Each part is
a ``DocSubset``, a view that the loaders take like a cache (``lengths`` and ``[i]``) with its
documents in cache order; it holds no copy of the tokens and pickles small (DataLoader workers).
"""

from __future__ import annotations

import numpy as np

__all__ = ["DocSubset", "heldout_split"]


class DocSubset:
    """Documents ``indices`` of ``docs`` (a token cache or any object with ``lengths`` and ``[i]``)."""

    def __init__(self, docs, indices):
        self.docs = docs
        self.indices = np.asarray(indices, dtype=np.int64)
        n = len(docs.lengths)
        if self.indices.ndim != 1 or (len(self.indices) and (self.indices.min() < 0 or self.indices.max() >= n)):
            raise ValueError(f"DocSubset: indices must be a 1-D array of document ids in [0, {n})")
        self.lengths = np.asarray(docs.lengths, dtype=np.int64)[self.indices]
        if hasattr(docs, "source_ids"):  # a mixture's documents keep their source (ftlib.data.mixture)
            self.source_ids = np.asarray(docs.source_ids, np.int64)[self.indices]
            self.source_names = docs.source_names

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.docs[int(self.indices[i])]


def heldout_split(docs, fraction: float, *, seed: int = 0) -> tuple[DocSubset, DocSubset]:
    """(train, held-out) views of ``docs``, the held-out one ``fraction`` of the documents (at least one)."""
    n = len(docs.lengths)
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"heldout_split: fraction must be in (0, 1), got {fraction}")
    n_eval = max(1, int(round(fraction * n)))
    if n_eval >= n:
        raise ValueError(f"heldout_split: holding out {n_eval} of {n} documents leaves none to train on")
    perm = np.random.default_rng([seed, 7]).permutation(n)
    return DocSubset(docs, np.sort(perm[n_eval:])), DocSubset(docs, np.sort(perm[:n_eval]))
