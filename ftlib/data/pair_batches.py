"""Batches of preference pairs: padding-free packing with (pair, side) bookkeeping, the padded
layout, a resumable loader, and reward-margin filtering.

Packed layout (``collate_pairs_packed``). Each pair becomes two documents, prompt + chosen and
prompt + rejected, placed next to each other in the same row, each its own attention segment
(``cu_seqlens``; no token sees the other side). Rows of ``seq_len`` tokens are filled by
best-fit decreasing over the pairs' footprints ``2 p + c + r`` (``ftlib.data.packing.pack``), so
both members of a pair are always in the same row, hence the same micro-batch. The batch follows
the packed batch contract of ``ftlib.data.collate`` (``input_ids``, ``labels`` with -100 off the responses and on each
segment's first token, ``position_ids``, ``cu_seqlens``, ``max_seqlen``) plus the bookkeeping:

    pair_ids        int64 [P]  the cache pair id of each pair in the batch
    chosen_index    int64 [P]  index of the pair's chosen document among the cu_seqlens segments
    rejected_index  int64 [P]  same for the rejected one (padding tails are segments no pair names)
    margin          float64 [P]  reward margin (NaN when the pair has no scores)
    ref_chosen, ref_rejected   float64 [P]  precomputed reference log-probs, when the cache has them

Padded layout (``collate_pairs_padded``), the common one: 2P rows, the P chosen sequences then
the P rejected ones, right-padded to the longest (``attention_mask``); ``chosen_index =
arange(P)``, ``rejected_index = P + arange(P)`` index rows. Both layouts give the same per-pair
log-probabilities (``ftlib.preference.pair_logps`` reads either).

Loader (``PairLoader``): the front of the one loader core, ``ftlib.data.loader.UnitLoader``, with
a unit = a packed row (``packing=True``) or a pair, so order, rank slicing, equal per-rank counts,
resume and the DataLoader's own generator are exactly ``TokenLoader``'s. A filler (a rank with
no unit in the short last step of ``drop_last=False``) is a copy of a unit whose tokens carry no
label and whose pairs are named nowhere (``pair_ids`` etc. are empty for it): the rank runs a
forward and backward like the others, and the loss, the reward statistics and
``precompute_reference`` see no pair twice.

Unpaired (KTO) caches (``cache.unpaired``): a unit is an example and ``batch_size`` counts
examples; a batch is one row of exactly its tokens (``collate_unpaired``, no padding): the B
documents x_i + y_i, then (``kl=True``) the B mismatched x_i + y_{i-1} (completions rotated by
one within the batch, TRL's KL pairs), i.e. ``ftlib.rl.pack_kto``'s layout, with ``label`` bool
[B], ``n_examples`` = B and ``example_ids`` int64 [B]; a filler's documents follow, without labels.

Reward-margin filtering (``MarginFilter``), rejection sampling on scored pairs: per batch the
margins are z-scored, ``z_i = (m_i - mean(m)) / std(m)`` over the batch's scored pairs, and pair
i is kept iff ``z_i > tau(step)`` with

    tau(step) = max(floor, start * decay ** (step // every))      (default 0.3, 0.95, 100, 0.05)

i.e. the clearest preferences first, relaxing over training. With z-scores a threshold tau keeps
about ``1 - Phi(tau)`` of a batch (38 % at 0.3, 48 % at 0.05). At least ``min_keep`` scored
pairs (the highest z) are kept; a batch with fewer than two scored pairs, or all margins equal,
keeps them all; unscored pairs (NaN margin) are always kept. Kept, dropped and unscored pairs
are counted (``filter.counts``). Dropped pairs are removed from the batch before the forward, and
packed rows are compacted and trimmed, so they cost no compute.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .collate import doc_labels, pad_collate
from .loader import UnitLoader, lengths_sha256
from .packing import pack

__all__ = ["MarginFilter", "PairLoader", "collate_pairs_packed", "collate_pairs_padded", "collate_unpaired", "pair_tokens",
           "select_pairs"]

_PER_PAIR = ("pair_ids", "margin", "ref_chosen", "ref_rejected")


def _pair_extras(cache, pair_ids: np.ndarray) -> dict:
    out = {"pair_ids": torch.from_numpy(pair_ids.astype(np.int64)),
           "margin": torch.from_numpy(cache.effective_margin[pair_ids].astype(np.float64))}
    if cache.reference is not None:
        out["ref_chosen"] = torch.from_numpy(cache.reference["chosen"][pair_ids].astype(np.float64))
        out["ref_rejected"] = torch.from_numpy(cache.reference["rejected"][pair_ids].astype(np.float64))
    return out


def collate_pairs_packed(cache, plan, rows, pad_id: int, loss=None, trim: bool = False) -> dict:
    """Packed batch of the pairs in ``rows`` of ``plan`` (a ``PackPlan`` over pair footprints).

    ``loss``: optional per-row flags; a False row (a filler) keeps its tokens but gets no labels and
    its pairs are left out of the bookkeeping (``pair_ids``, ``chosen_index``, ...).
    ``trim``: the rows laid end to end as one row of exactly their tokens, without the padding tails
    (shape [1, tokens]; the same segments, so attention and every log-prob are those of the [B, T]
    batch, with no compute spent on padding; the shape changes from batch to batch)."""
    T, B = plan.seq_len, len(rows)
    ids = np.full((B, T), pad_id, dtype=np.int64)
    labels = np.full((B, T), -100, dtype=np.int64)
    pos = np.zeros((B, T), dtype=np.int64)
    cu, pair_ids, chosen_idx, rejected_idx = [0], [], [], []
    fills, tails = [], []  # tokens of each row, segments that are padding tails
    for b, r in enumerate(rows):
        p = 0
        real = loss is None or bool(loss[b])
        for d, _, _ in plan.row(int(r)):
            if real:
                pair_ids.append(d)
            for side, where in (("chosen", chosen_idx), ("rejected", rejected_idx)):
                tok, mask = cache.sequence(d, side)
                n = len(tok)
                ids[b, p : p + n] = tok
                labels[b, p : p + n] = doc_labels(tok, mask, real)
                pos[b, p : p + n] = np.arange(n)
                p += n
                if real:
                    where.append(len(cu) - 1)
                cu.append(b * T + p)
        fills.append(p)
        if p < T:  # padding tail: its own segment
            pos[b, p:] = np.arange(T - p)
            tails.append(len(cu) - 1)
            cu.append((b + 1) * T)
    cu_arr = np.asarray(cu, dtype=np.int32)
    if trim and B:  # drop the tails' positions and segments; renumber the segments the indices name
        flat = np.concatenate([np.arange(b * T, b * T + f) for b, f in enumerate(fills)])
        ids, labels, pos = (x.reshape(-1)[flat][None] for x in (ids, labels, pos))
        keep = np.ones(len(cu_arr) - 1, bool)
        keep[tails] = False
        cu_arr = np.concatenate([[0], np.cumsum(np.diff(cu_arr)[keep])]).astype(np.int32)
        renumber = np.cumsum(keep) - 1
        chosen_idx, rejected_idx = renumber[chosen_idx].tolist(), renumber[rejected_idx].tolist()
    return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(pos), "cu_seqlens": torch.from_numpy(cu_arr),
            "max_seqlen": int(np.diff(cu_arr).max()) if B else 0,
            "chosen_index": torch.tensor(chosen_idx, dtype=torch.int64),
            "rejected_index": torch.tensor(rejected_idx, dtype=torch.int64),
            **_pair_extras(cache, np.asarray(pair_ids, dtype=np.int64))}


def collate_pairs_padded(cache, pair_ids, pad_id: int, *, pad_to_multiple_of: int | None = None,
                         padding_side: str = "right", loss=None) -> dict:
    """Padded batch: chosen rows 0..P-1, rejected rows P..2P-1, padded to the longest of all 2P.

    ``loss``: optional per-pair flags; a False pair (a filler) keeps its two rows but gets no labels
    and is left out of the bookkeeping (``pair_ids``, ``chosen_index``, ...)."""
    pair_ids = np.asarray(pair_ids, dtype=np.int64)
    real = np.ones(len(pair_ids), bool) if loss is None else np.asarray(loss, dtype=bool)
    docs = [cache.sequence(int(d), side) for side in ("chosen", "rejected") for d in pair_ids]
    docs = [(t, m if ok else np.zeros_like(m)) for (t, m), ok in zip(docs, np.tile(real, 2))]
    batch = pad_collate(docs, pad_id, pad_to_multiple_of=pad_to_multiple_of, padding_side=padding_side)
    P, keep = len(pair_ids), torch.from_numpy(np.flatnonzero(real))
    return {**batch, "chosen_index": keep, "rejected_index": P + keep, **_pair_extras(cache, pair_ids[real])}


def collate_unpaired(cache, example_ids, *, kl: bool = True, loss=None) -> dict:
    """One row of the unpaired examples ``example_ids`` (and their mismatched documents when ``kl``).

    ``loss``: optional per-example flags; a False example (a filler) keeps its tokens, after the
    real documents, without labels, and is named nowhere (``example_ids``, ``label``)."""
    ex = np.asarray(example_ids, dtype=np.int64)
    real = np.ones(len(ex), bool) if loss is None else np.asarray(loss, dtype=bool)
    got = [cache.example(int(i)) for i in ex]
    ok = [g for g, r in zip(got, real) if r]
    docs = [(p, c, m, True) for p, (c, m), _ in ok]
    if kl:  # TRL: x_i with y_{i-1}
        docs += [(ok[i][0], ok[i - 1][1][0], ok[i - 1][1][1], True) for i in range(len(ok))]
    docs += [(p, c, m, False) for (p, (c, m), _), r in zip(got, real) if not r]
    ids, lab, pos, cu = [], [], [], [0]
    for p, c, m, with_loss in docs:
        tok = np.concatenate([p, c]).astype(np.int64)
        ids.append(tok)
        lab.append(doc_labels(tok, np.concatenate([np.zeros(len(p), np.uint8), m]), with_loss))
        pos.append(np.arange(len(tok)))
        cu.append(cu[-1] + len(tok))
    cu_arr = np.asarray(cu, dtype=np.int32)
    return {"input_ids": torch.from_numpy(np.concatenate(ids))[None], "labels": torch.from_numpy(np.concatenate(lab))[None],
            "position_ids": torch.from_numpy(np.concatenate(pos))[None], "cu_seqlens": torch.from_numpy(cu_arr),
            "max_seqlen": int(np.diff(cu_arr).max()), "n_examples": len(ok),
            "label": torch.tensor([g[2] for g in ok], dtype=torch.bool),
            "example_ids": torch.from_numpy(ex[real])}


def pair_tokens(batch: dict) -> int:
    """Real tokens of a pair batch: both sequences (prompt + response, the prompt once per side) of
    every pair it names; padding, padding tails and fillers are not counted. The throughput unit of
    ``benchmarks/bench_dpo.py`` (response tokens alone, the labels, are about half of it)."""
    ci, ri = batch["chosen_index"], batch["rejected_index"]
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"].to(torch.int64)
        n = cu[1:] - cu[:-1]
    else:
        n = batch["attention_mask"].to(torch.int64).sum(1)
    return int(n[ci].sum() + n[ri].sum())


def select_pairs(batch: dict, keep: torch.Tensor, pad_id: int = 0) -> dict:
    """The batch with only the pairs where ``keep`` [P] is True (packed rows compacted and trimmed)."""
    keep = torch.as_tensor(keep, dtype=torch.bool)
    ci, ri = batch["chosen_index"], batch["rejected_index"]
    if keep.shape != ci.shape:
        raise ValueError(f"keep must be [{ci.numel()}], got {tuple(keep.shape)}")
    out = {k: v[keep] for k, v in batch.items() if k in _PER_PAIR}
    K = int(keep.sum())
    if "cu_seqlens" not in batch:  # padded: select rows, then drop the columns that are padding everywhere
        rows = torch.cat([ci[keep], ri[keep]])
        sel = {k: batch[k].index_select(0, rows) for k in ("input_ids", "labels", "attention_mask")}
        cols = sel["attention_mask"].any(0).nonzero().squeeze(1)
        a, b = (int(cols[0]), int(cols[-1]) + 1) if len(cols) else (0, 0)
        out.update({k: v[:, a:b] for k, v in sel.items()})
        return {**batch, **out, "chosen_index": torch.arange(K), "rejected_index": torch.arange(K, 2 * K)}
    T = batch["input_ids"].shape[1]
    cu = batch["cu_seqlens"].tolist()
    segs = sorted(torch.cat([ci[keep], ri[keep]]).tolist())  # kept segments in their original order
    by_row: dict[int, list[int]] = {}
    for s in segs:
        by_row.setdefault(cu[s] // T, []).append(s)
    width = max((sum(cu[s + 1] - cu[s] for s in ss) for ss in by_row.values()), default=0)
    flat = {k: batch[k].reshape(-1) for k in ("input_ids", "labels", "position_ids")}
    new = {k: torch.full((len(by_row), width), -100 if k == "labels" else 0, dtype=v.dtype) for k, v in flat.items()}
    new["input_ids"].fill_(pad_id)
    new_cu, new_seg = [0], {}
    for b, ss in enumerate(by_row.values()):
        p = 0
        for s in ss:
            n = cu[s + 1] - cu[s]
            for k in flat:
                new[k][b, p : p + n] = flat[k][cu[s] : cu[s] + n]
            p += n
            new_seg[s] = len(new_cu) - 1
            new_cu.append(b * width + p)
        if p < width:
            new["position_ids"][b, p:] = torch.arange(width - p)
            new_cu.append((b + 1) * width)
    cu_t = torch.tensor(new_cu, dtype=torch.int32)
    out.update(new)
    out.update(cu_seqlens=cu_t, max_seqlen=int((cu_t[1:] - cu_t[:-1]).max()) if len(new_cu) > 1 else 0,
               chosen_index=torch.tensor([new_seg[s] for s in ci[keep].tolist()], dtype=torch.int64),
               rejected_index=torch.tensor([new_seg[s] for s in ri[keep].tolist()], dtype=torch.int64))
    return {**batch, **out}


def _pair_batch(cache, plan, opts, units, real):
    """A PairLoader batch: packed rows of ``plan``, or padded pairs (fillers without labels or bookkeeping)."""
    if getattr(cache, "unpaired", False):  # a duck-typed pair source need not say
        return collate_unpaired(cache, units, kl=opts["kl"], loss=real)
    if plan is not None:
        return collate_pairs_packed(cache, plan, units, opts["pad_id"], loss=real, trim=opts["trim_padding"])
    return collate_pairs_padded(cache, units, opts["pad_id"], pad_to_multiple_of=opts["pad_to_multiple_of"],
                                padding_side=opts["padding_side"], loss=real)


class PairLoader(UnitLoader):
    """Iterable of pair batches over a ``PairCache``: the ``UnitLoader`` front for pairs (see the module docstring).

    ``packing=True``: a unit is a packed row of ``seq_len`` tokens and ``batch_size`` counts rows;
    ``packing=False``: a unit is a pair, ``batch_size`` counts pairs (2 x batch_size padded rows),
    optionally length-grouped (by the longer side). ``rank`` / ``world_size`` default to torch.distributed's.
    ``trim_padding`` (packing): each batch's rows as one row of exactly their tokens, without the padding
    tails (``collate_pairs_packed(trim=True)``): no compute on padding, a shape that changes per batch
    (what eager CPU steps want; keep fixed shapes for ``torch.compile`` / CUDA graphs).
    """

    _kind = "pair loader"

    def __init__(self, cache, *, batch_size: int, pad_id: int, seq_len: int | None = None, packing: bool = True,
                 shuffle: bool = True, seed: int = 0, rank: int | None = None, world_size: int | None = None,
                 drop_last: bool = True, num_workers: int = 0, pin_memory: bool = False,
                 prefetch_factor: int | None = 2, group_by_length: bool = False, mega_batch_mult: int = 50,
                 pad_to_multiple_of: int | None = None, padding_side: str = "right", pack_backend: str | None = None,
                 multiprocessing_context=None, trim_padding: bool = False, kl: bool = True):
        unpaired = getattr(cache, "unpaired", False)  # a duck-typed pair source need not say
        if unpaired:
            if not packing or seq_len is not None or group_by_length or trim_padding:
                raise ValueError("an unpaired (KTO) cache makes one packed row per batch of exactly its tokens: "
                                 "pass packing=True without seq_len, group_by_length or trim_padding")
        elif packing and not seq_len:
            raise ValueError("packing=True needs seq_len")
        if packing and group_by_length:
            raise ValueError("group_by_length applies to padded batches (packing=False)")
        if len(cache) == 0:
            raise ValueError(f"{cache.path}: the pair cache holds no pairs (see cache.report for skipped records)")
        self.cache, self.packing, self.seq_len = cache, packing, seq_len
        self.opts = {"pad_id": pad_id, "pad_to_multiple_of": pad_to_multiple_of, "padding_side": padding_side,
                     "trim_padding": trim_padding, "kl": kl}
        sc, sr = (np.asarray(x, dtype=np.int64) for x in cache.side_lengths)
        self.footprint = sc + sr  # tokens of a pair in a packed row: 2 p + c + r
        self.plan = None
        if unpaired:
            unit_lengths = sc + sr - cache.prompt_len  # prompt + completion (one side is empty)
            self.footprint = 2 * unit_lengths if kl else unit_lengths
        elif packing:
            over = np.flatnonzero(self.footprint > seq_len)
            if len(over):
                raise ValueError(
                    f"{len(over)} pairs do not fit a row of seq_len={seq_len} (both sides of a pair share a row; "
                    f"first: pair {int(over[0])}, {int(self.footprint[over[0]])} tokens); use seq_len >= "
                    f"{int(self.footprint.max())} (2 x the formatter's max_length is always enough)")
            self.plan = pack(self.footprint, seq_len, "truncate", pack_backend)
            unit_lengths = np.add.reduceat(self.plan.length, self.plan.row_ptr[:-1])
        else:
            unit_lengths = np.maximum(sc, sr)  # a padded pair costs two rows of its longer side
        identity = {"n_pairs": len(cache), "n_tokens": int(self.footprint.sum()),
                    "lengths_sha256": lengths_sha256(sc, sr), "packing": packing, "seq_len": seq_len}
        if unpaired:
            identity["kl"] = kl
        super().__init__(functools.partial(_pair_batch, cache, self.plan, self.opts), unit_lengths,
                         batch_size=batch_size, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size,
                         drop_last=drop_last, group_by_length=group_by_length, mega_batch_mult=mega_batch_mult,
                         num_workers=num_workers, pin_memory=pin_memory, prefetch_factor=prefetch_factor,
                         multiprocessing_context=multiprocessing_context, identity=identity,
                         what="examples" if unpaired else "packed rows" if packing else "pairs")

    @property
    def pack_stats(self):
        return None if self.plan is None else self.plan.stats


class MarginFilter:
    """Keep the pairs of a batch whose z-scored reward margin exceeds a decaying threshold.

    ``filter(batch, step) -> batch`` (see the module docstring for the rule); ``threshold(step)``;
    ``counts`` ({"kept", "dropped", "unscored"} since construction) and ``last`` (the same for the
    latest batch, plus its threshold). ``state_dict`` / ``load_state_dict`` carry the counts.
    """

    def __init__(self, start: float = 0.3, decay: float = 0.95, every: int = 100, floor: float = 0.05,
                 min_keep: int = 1, pad_id: int = 0):
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if every < 1 or min_keep < 0:
            raise ValueError(f"every must be >= 1 and min_keep >= 0, got {every}, {min_keep}")
        if floor > start:
            raise ValueError(f"floor={floor} is above start={start}: the threshold would never decay")
        self.start, self.decay, self.every, self.floor, self.min_keep, self.pad_id = start, decay, every, floor, min_keep, pad_id
        self.counts = {"kept": 0, "dropped": 0, "unscored": 0}
        self.last: dict = {}

    def threshold(self, step: int) -> float:
        return max(self.floor, self.start * self.decay ** (int(step) // self.every))

    def keep_mask(self, margin: torch.Tensor, step: int) -> torch.Tensor:
        """[P] bool: which pairs to keep given their margins (NaN = unscored, always kept)."""
        m = margin.double()
        scored = torch.isfinite(m)
        keep = torch.ones_like(scored)
        ms = m[scored]
        tau = self.threshold(step)
        if ms.numel() >= 2 and float(ms.std(unbiased=False)) > 0:
            z = (ms - ms.mean()) / ms.std(unbiased=False)
            k = z > tau
            if int(k.sum()) < self.min_keep:
                k[torch.topk(z, min(self.min_keep, z.numel())).indices] = True
            keep[scored] = k
        n_scored, n_kept = int(scored.sum()), int(keep.sum())
        n_unscored = len(m) - n_scored
        self.last = {"threshold": tau, "kept": n_kept - n_unscored, "dropped": len(m) - n_kept, "unscored": n_unscored}
        for key in self.counts:
            self.counts[key] += self.last[key]
        return keep

    def __call__(self, batch: dict, step: int) -> dict:
        keep = self.keep_mask(batch["margin"], step)
        return batch if bool(keep.all()) else select_pairs(batch, keep, self.pad_id)

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.counts = {k: int(state["counts"][k]) for k in self.counts}
