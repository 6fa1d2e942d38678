"""Dynamic padding and length grouping, for when packing is off.

``pad_collate`` pads a list of documents to ``L = min(round_up(max_len, pad_to_multiple_of),
max_length)`` (multiples of 8/32/64 keep tensor-core shapes and the number of compiled shapes
small), on the right or the left. A document longer than ``max_length`` is an error: the
formatter's ``max_length`` (with its truncation policy) is the place to cut, so nothing is lost
silently here.

Batch contract (DESIGN.md): ``input_ids`` [B, L] int64, ``labels`` [B, L] aligned with
``input_ids`` (not shifted; -100 on padding, on tokens without loss and on each document's first
token, which nothing predicts), ``attention_mask`` [B, L] int64 (1 = real token).

Length grouping (the "mega-batch" trick of Hugging Face's LengthGroupedSampler): shuffle the
documents, cut the order into mega-batches of ``batch_size * mega_batch_mult``, sort each by
length (descending) and cut it into batches, then shuffle the batches, putting the one holding
the longest document first so an out-of-memory shows at step 0. Documents in a batch then have
similar lengths, so the padding fraction sum(L - len_i) / (B * L) drops while the order stays
random at the mega-batch scale.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["pad_collate", "length_grouped_batches", "padding_fraction"]


def pad_collate(docs, pad_id: int, *, pad_to_multiple_of: int | None = None, max_length: int | None = None,
                padding_side: str = "right") -> dict:
    """``docs``: list of (input_ids, loss_mask) 1-D arrays. Returns the padded batch dict."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be left|right, got {padding_side!r}")
    if not docs:
        raise ValueError("pad_collate: empty batch")
    lens = [len(d[0]) for d in docs]
    longest = max(lens)
    if max_length is not None and longest > max_length:
        i = int(np.argmax(lens))
        raise ValueError(f"document {i} of the batch has {longest} tokens > max_length={max_length}; "
                         "truncate it when formatting (FormatConfig.max_length)")
    L = longest
    if pad_to_multiple_of:
        L = -(-L // pad_to_multiple_of) * pad_to_multiple_of
    if max_length is not None:
        L = min(L, max_length)
    B = len(docs)
    ids = np.full((B, L), pad_id, dtype=np.int64)
    labels = np.full((B, L), -100, dtype=np.int64)
    attn = np.zeros((B, L), dtype=np.int64)
    for b, (tok, mask) in enumerate(docs):
        n = len(tok)
        a = 0 if padding_side == "right" else L - n
        seg = np.asarray(tok, dtype=np.int64)
        ids[b, a : a + n] = seg
        labels[b, a : a + n] = np.where(np.asarray(mask) != 0, seg, -100)
        if n:
            labels[b, a] = -100
        attn[b, a : a + n] = 1
    return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy(attn)}


def length_grouped_batches(lengths, batch_size: int, rng: np.random.Generator,
                           mega_batch_mult: int = 50) -> list[np.ndarray]:
    """Batches of document indices with similar lengths (see the module docstring)."""
    lengths = np.asarray(lengths)
    order = rng.permutation(len(lengths))
    mega = batch_size * mega_batch_mult
    batches = []
    for m in range(0, len(order), mega):
        chunk = order[m : m + mega]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        batches.extend(chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size))
    if not batches:
        return []
    perm = rng.permutation(len(batches))
    batches = [batches[i] for i in perm]
    longest = int(np.argmax([lengths[b].max() for b in batches]))
    batches[0], batches[longest] = batches[longest], batches[0]
    return batches


def padding_fraction(lengths, batches, pad_to_multiple_of: int | None = None) -> float:
    """Fraction of padded positions over ``batches`` (lists of document indices)."""
    lengths = np.asarray(lengths)
    pad = total = 0
    for b in batches:
        ls = lengths[b]
        L = int(ls.max())
        if pad_to_multiple_of:
            L = -(-L // pad_to_multiple_of) * pad_to_multiple_of
        total += L * len(ls)
        pad += L * len(ls) - int(ls.sum())
    return pad / total if total else 0.0
