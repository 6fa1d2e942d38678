"""Batches: padded (``pad_collate``) and packed (``collate_packed``), and length grouping.

Batch contract (every batch the loader yields)
    ``input_ids`` [B, T] int64; ``labels`` [B, T] int64 aligned with ``input_ids`` (*not*
    shifted: the loss compares logits[t] with labels[t + 1]) with -100 = no loss: on padding, on
    tokens whose loss mask is 0, and on the first token of every document or packed segment,
    which nothing of its own predicts. Padded batches add ``attention_mask`` [B, T] int64 (1 =
    real token). Packed batches add ``position_ids`` [B, T] restarting at 0 per segment,
    ``cu_seqlens`` int32 [n_segments + 1] (cumulative segment boundaries over the flattened B*T
    tokens, the flash-attn varlen convention) and ``max_seqlen``; the padding tail of a row is
    a segment of its own (pad ids, labels -100), so segments never cross a row and
    ``cu_seqlens[-1] == B*T``. No token attends across a document boundary. Labels are built in
    one place, :func:`doc_labels`.

``pad_collate`` pads a list of documents to ``L = min(round_up(max_len, pad_to_multiple_of),
max_length)`` (multiples of 8/32/64 keep tensor-core shapes and the number of compiled shapes
small), on the right or the left. A document longer than ``max_length`` is an error: the
formatter's ``max_length`` (with its truncation policy) is the place to cut, so nothing is lost
silently here. ``collate_packed`` lays out the rows of a :class:`~ftlib.data.packing.PackPlan`.

Length grouping (the "mega-batch" trick of Hugging Face's LengthGroupedSampler): shuffle the
documents, cut the order into mega-batches of ``batch_size * mega_batch_mult``, sort each by
length (descending) and cut it into batches, then shuffle the full batches, putting the one
holding the longest document first so an out-of-memory shows at step 0. The one short batch
(when ``batch_size`` does not divide the number of documents) comes last, so a distributed
loader can split it evenly. Documents in a batch then have similar lengths, so the padding
fraction sum(L - len_i) / (B * L) drops while the order stays random at the mega-batch scale.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["collate_packed", "doc_labels", "length_grouped_batches", "pad_collate", "padding_fraction"]


def doc_labels(ids: np.ndarray, mask: np.ndarray, loss: bool = True) -> np.ndarray:
    """Labels of one document or packed segment: its token where the loss mask is 1, else -100; the
    first token is always -100 (nothing in the segment predicts it); all -100 when ``loss`` is False."""
    lab = np.where(np.asarray(mask) != 0, ids, -100) if loss else np.full(len(ids), -100)
    if len(lab):
        lab[0] = -100
    return lab


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
        labels[b, a : a + n] = doc_labels(seg, mask)
        attn[b, a : a + n] = 1
    return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy(attn)}


def collate_packed(plan, rows, get_doc, pad_id: int, loss=None) -> dict:
    """Packed batch from row ids of ``plan`` (a PackPlan). ``get_doc(d) -> (ids, loss_mask)`` NumPy
    arrays; ``loss``: optional per-row flags, False gives that row no labels (a filler row)."""
    T, B = plan.seq_len, len(rows)
    ids = np.full((B, T), pad_id, dtype=np.int64)
    labels = np.full((B, T), -100, dtype=np.int64)
    pos = np.zeros((B, T), dtype=np.int64)
    cu = [0]
    for b, r in enumerate(rows):
        p = 0
        for d, s, n in plan.row(int(r)):
            tok, mask = get_doc(d)
            seg = tok[s : s + n].astype(np.int64)
            ids[b, p : p + n] = seg
            labels[b, p : p + n] = doc_labels(seg, mask[s : s + n], loss is None or bool(loss[b]))
            pos[b, p : p + n] = np.arange(n)
            p += n
            cu.append(b * T + p)
        if p < T:  # padding tail: its own segment
            pos[b, p:] = np.arange(T - p)
            cu.append((b + 1) * T)
    cu_arr = np.asarray(cu, dtype=np.int32)
    return {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(pos),
        "cu_seqlens": torch.from_numpy(cu_arr),
        "max_seqlen": int(np.diff(cu_arr).max()) if B else 0,
    }


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
    # mega is a multiple of batch_size: only the last mega-batch can end in a short batch
    full = [b for b in batches if len(b) == batch_size]
    short = [b for b in batches if len(b) < batch_size]
    full = [full[i] for i in rng.permutation(len(full))]
    if full:
        longest = int(np.argmax([lengths[b].max() for b in full]))
        full[0], full[longest] = full[longest], full[0]
        if short and lengths[short[0]].max() > lengths[full[0]].max():
            # the longest document fell in the short batch: trade it for the shortest one of the first
            # full batch, so that batch (B x the longest length) is still the biggest and comes first
            s, f = short[0].copy(), full[0].copy()
            i, j = int(np.argmax(lengths[s])), int(np.argmin(lengths[f]))
            s[i], f[j] = f[j], s[i]
            short[0], full[0] = s, f
    return full + short


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
