"""The loader core (``UnitLoader``) and its token front (``TokenLoader``): resumable, rank-aware batches.

    loader = TokenLoader(cache, batch_size=8, seq_len=2048, pad_id=0, seed=1234)
    for epoch in range(start_epoch, n_epochs):
        loader.set_epoch(epoch)
        for batch in loader:          # dict of tensors, the batch contract of ftlib.data.collate
            ...
            ckpt["data"] = loader.state_dict()

One core, thin fronts. ``UnitLoader`` decides everything about *which* units a rank sees when:
the order, the rank slicing, equal per-rank counts (fillers), exact resume and the
``DataLoader`` that fetches batches. A front says what a unit is and how a batch is built from
unit ids: ``TokenLoader`` (here) over a token cache, ``ftlib.data.pair_batches.PairLoader``
over a pair cache. A new kind of data gets a new front, never a second copy of the core.

Units (``TokenLoader``). With ``packing=True`` a unit is a packed row (``packing.pack`` with
best-fit decreasing, computed once, since the rows depend only on the lengths); otherwise a unit
is a document and batches are padded by ``collate.pad_collate`` (optionally length-grouped).

Order. Epoch e's order is a permutation drawn from ``np.random.default_rng([seed, e])`` — the
same on every rank and every run (with ``group_by_length``, the length-grouped batches of
``collate.length_grouped_batches`` over the units' lengths). It is cut into *global steps* of
``batch_size * world_size`` units; rank r takes units ``[r * batch_size, (r + 1) * batch_size)``
of each global step. So the ranks partition every step without overlap or loss. The tail that
does not fill a global step is always the *last* step. It is dropped (``drop_last=True``,
default; a fresh order each epoch drops different units) or split evenly across the ranks
(``drop_last=False``: rank r gets ``q + (r < rem)`` of its ``n = q * world_size + rem`` units).
Every rank therefore yields the same number of batches (a rank that stopped early would leave
the others waiting in a collective: a DDP/FSDP hang), and none is empty: where the tail has
fewer units than ranks, a rank without one gets a *filler*, a copy of the tail's shortest unit
that carries no loss (every label -100; a pair batch names no pair), so it adds nothing to the
loss or to token-weighted accumulation but runs an ordinary forward and backward. In
``rank_steps`` a filler of unit u is written ``-1 - u``.

Workers. Each step of a rank is one item of a map-style dataset, fetched by a
``torch.utils.data.DataLoader`` (``batch_size=None``) from a sampler over the step indices, so
``num_workers``, ``pin_memory`` and ``prefetch_factor`` work as usual; DataLoader hands step
indices to workers round-robin and returns results in index order, so workers never overlap.
The DataLoader gets a generator of its own, seeded from ``(seed, epoch, step)``: without one it
draws its base seed from the global torch RNG, so starting an iteration (and starting it again
on resume) would shift every later dropout mask of the run.

A dataset with fewer units than one global step is refused with ``drop_last=True`` (every
epoch would be empty).

Mixtures. With ``groups`` (the source of each unit) and ``weights`` (one per source), epoch e's
units are drawn by weight before they are ordered (``ftlib.data.mixture``: as many units as all
sources hold, source i's share of the epoch's tokens ``w_i``, its units subsampled or repeated), from the same
``[seed, e]`` generator, so every rank slices the same global steps and a resume is exact; the
weights and the units per source join the identity a resume checks. ``mix(epoch)`` is the realised
mix: units and tokens per source. ``TokenLoader`` packs each source on its own (a row never
mixes sources) when given ``weights`` over a ``MixedDocs``.

Resume. ``state_dict()`` is ``{epoch, step}`` plus the settings that define the order and the
data's identity (for tokens: units, tokens and a SHA-256 of the document lengths in order, so
reordered or swapped documents are refused, not only a changed total); ``step`` counts batches
already handed to the user (prefetched batches are not counted), so ``load_state_dict``
followed by iteration yields exactly the batches not yet seen. ``set_epoch(e)`` with a new
epoch starts it at step 0; iterating a finished epoch yields nothing and moves the loader to the
next epoch, so a loop without ``set_epoch`` also works.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

from .._dist import get_rank, get_world_size
from .collate import length_grouped_batches, pad_collate
from .mixture import draw_mixture, mixture_counts
from .packing import PackPlan, PackStats, collate_packed, pack

__all__ = ["TokenLoader", "UnitLoader", "lengths_sha256"]


def _dist_rank_world() -> tuple[int, int]:
    return get_rank(), get_world_size()


def lengths_sha256(*lengths) -> str:
    """SHA-256 of length arrays in order (int64 little-endian, concatenated): a data identity for resume."""
    h = hashlib.sha256()
    for a in lengths:
        h.update(np.ascontiguousarray(a, "<i8").tobytes())
    return h.hexdigest()


class _Steps(torch.utils.data.Dataset):
    """Item k = the k-th batch of this rank in the current epoch (built in a worker)."""

    def __init__(self, steps, make_batch):
        self.steps, self.make_batch = steps, make_batch

    def __len__(self):
        return len(self.steps)

    def __getitem__(self, k):
        units = np.asarray(self.steps[k], dtype=np.int64)
        real = units >= 0  # a negative id -1 - u: a filler copy of unit u, without loss
        return self.make_batch(np.where(real, units, -1 - units), real)


class UnitLoader:
    """The loader core over ``len(unit_lengths)`` units; see the module docstring.

    ``make_batch(units, real) -> batch``: the batch of unit ids ``units`` (int64 [k]); where
    ``real`` [k] is False the unit is a filler and must carry no loss. It runs in DataLoader
    workers, so it must be picklable when ``num_workers > 0`` (a module-level function or a
    ``functools.partial`` of one). ``unit_lengths`` [n_units]: the tokens of each unit (length
    grouping sorts by it; a filler copies the tail's shortest unit). ``identity``: the front's
    description of its data and layout, compared by ``load_state_dict`` beside the order
    settings. ``what`` names the units in messages ("documents", "packed rows", "pairs").
    ``rank`` / ``world_size`` default to torch.distributed's when it is initialized.
    """

    _kind = "loader"  # names the front in a refused resume

    def __init__(self, make_batch, unit_lengths, *, batch_size: int, shuffle: bool = True, seed: int = 0,
                 rank: int | None = None, world_size: int | None = None, drop_last: bool = True,
                 group_by_length: bool = False, mega_batch_mult: int = 50, num_workers: int = 0,
                 pin_memory: bool = False, prefetch_factor: int | None = 2, multiprocessing_context=None,
                 identity: dict | None = None, what: str = "units", groups=None, weights=None,
                 group_names=None):
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if group_by_length and not shuffle:
            raise ValueError(f"group_by_length shuffles the {what} (random mega-batches); it cannot honour "
                             "shuffle=False")
        r0, w0 = _dist_rank_world()
        self.rank = r0 if rank is None else rank
        self.world_size = w0 if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} not in [0, world_size={self.world_size})")
        self.make_batch = make_batch
        self.unit_lengths = np.asarray(unit_lengths, dtype=np.int64)
        self.n_units = len(self.unit_lengths)
        self.batch_size, self.seed, self.shuffle, self.drop_last = batch_size, seed, shuffle, drop_last
        self.group_by_length, self.mega_batch_mult = group_by_length, mega_batch_mult
        self.num_workers, self.pin_memory, self.prefetch_factor = num_workers, pin_memory, prefetch_factor
        self.multiprocessing_context = multiprocessing_context
        self._front_identity = dict(identity or {})
        self.groups = self.weights = None
        if weights is not None:
            self.groups = np.asarray(groups, np.int64)
            self.weights = [float(w) for w in weights]
            if len(self.groups) != self.n_units or len(self.weights) < 1 or (
                    len(self.groups) and not 0 <= self.groups.min() <= self.groups.max() < len(self.weights)):
                raise ValueError(f"groups must give a source in [0, {len(self.weights)}) for each of the "
                                 f"{self.n_units} {what}")
            if not all(w > 0 for w in self.weights):
                raise ValueError(f"mixture weights must be > 0, got {self.weights}")
            self.group_names = list(group_names) if group_names is not None else [str(i) for i in
                                                                                  range(len(self.weights))]
            self.group_units = np.bincount(self.groups, minlength=len(self.weights))
            empty = [self.group_names[i] for i, n in enumerate(self.group_units) if n == 0]
            if empty:
                raise ValueError(f"mixture source(s) {', '.join(empty)} hold no {what}")
            self._front_identity.update(mixture_weights=self.weights, mixture_units=self.group_units.tolist())
        G = batch_size * self.world_size
        if drop_last and self.n_units < G:  # every epoch would be empty: refuse rather than train on nothing
            raise ValueError(f"{self.n_units} {what} < one global batch of {G} (batch_size {batch_size} x "
                             f"world_size {self.world_size}): with drop_last=True no batch would ever be "
                             "yielded; lower batch_size or pass drop_last=False")
        self.epoch, self.step = 0, 0
        self._steps_cache: tuple[int, list] | None = None

    # -- order ------------------------------------------------------------------------------------
    def _epoch_units(self, epoch: int, rng) -> np.ndarray | None:
        """The units of a mixture's epoch, drawn by weight (None: every unit once)."""
        if self.weights is None:
            return None
        if not hasattr(self, "_mix_counts"):  # the weights are shares of tokens: units by each source's mean size
            mean = (np.bincount(self.groups, weights=self.unit_lengths, minlength=len(self.weights))
                    / np.maximum(self.group_units, 1))
            self._mix_counts = mixture_counts(np.asarray(self.weights) / np.maximum(mean, 1e-9), self.n_units)
        return draw_mixture(rng, self.groups, self._mix_counts)

    def _global_steps(self, epoch: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch])
        G = self.batch_size * self.world_size
        units = self._epoch_units(epoch, rng)
        if self.group_by_length:
            lengths = self.unit_lengths if units is None else self.unit_lengths[units]
            steps = length_grouped_batches(lengths, G, rng, self.mega_batch_mult)
            if units is not None:
                steps = [units[s] for s in steps]
        else:
            n = self.n_units if units is None else len(units)
            order = units if units is not None else rng.permutation(n) if self.shuffle else np.arange(n)
            steps = [order[i : i + G] for i in range(0, n, G)]
        if self.drop_last:
            steps = [s for s in steps if len(s) == G]
        return steps

    def rank_steps(self, epoch: int | None = None) -> list[np.ndarray]:
        """Unit ids of each batch this rank yields in ``epoch`` (default: the current one); ``-1 - u``
        is a filler copy of unit u (see the module docstring)."""
        epoch = self.epoch if epoch is None else epoch
        if self._steps_cache is None or self._steps_cache[0] != epoch:
            B, W, r = self.batch_size, self.world_size, self.rank
            mine = []
            for s in self._global_steps(epoch):
                if len(s) == B * W:
                    mine.append(s[r * B : (r + 1) * B])
                    continue
                # the short last step: an even split, and a filler where a rank would get nothing
                q, rem = divmod(len(s), W)
                a = r * q + min(r, rem)
                part = s[a : a + q + (r < rem)]
                if not len(part):
                    part = np.asarray([-1 - int(s[np.argmin(self.unit_lengths[s])])])
                mine.append(part)
            self._steps_cache = (epoch, mine)
        return self._steps_cache[1]

    def __len__(self) -> int:
        return len(self.rank_steps())

    def mix(self, epoch: int | None = None) -> dict | None:
        """The realised mix of ``epoch`` (default: the current one) over every rank's batches:
        ``{source: {"weight", "units", "tokens", "share"}}`` (share: of the epoch's tokens), or None
        without ``weights``."""
        if self.weights is None:
            return None
        steps = self._global_steps(self.epoch if epoch is None else epoch)
        units = np.concatenate(steps) if steps else np.zeros(0, np.int64)
        g = self.groups[units]
        tok = np.bincount(g, weights=self.unit_lengths[units], minlength=len(self.weights))
        n = np.bincount(g, minlength=len(self.weights))
        total = max(1.0, float(tok.sum()))
        wsum = sum(self.weights)
        return {name: {"weight": round(w / wsum, 6), "units": int(n[i]), "tokens": int(tok[i]),
                       "share": round(float(tok[i]) / total, 6)}
                for i, (name, w) in enumerate(zip(self.group_names, self.weights))}

    # -- state ------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.step = epoch, 0

    def _identity(self) -> dict:
        # everything the order of units depends on, plus the front's description of the data
        return {"seed": self.seed, "n_units": self.n_units, **self._front_identity,
                "batch_size": self.batch_size, "world_size": self.world_size, "rank": self.rank,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "group_by_length": self.group_by_length,
                "mega_batch_mult": self.mega_batch_mult}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        bad = [f"{k!r}: saved {state[k]!r}, this loader has {v!r}"
               for k, v in self._identity().items() if k in state and state[k] != v]
        if bad:
            raise ValueError(f"{self._kind} state mismatch on {'; '.join(bad)} (the data or its order would "
                             "differ, so exact resume is impossible)")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])

    # -- iteration --------------------------------------------------------------------------------
    def __iter__(self):
        steps = self.rank_steps()
        if self.step >= len(steps):  # epoch finished: move on to the next
            self.epoch, self.step = self.epoch + 1, 0
            return
        kw = {}
        if self.num_workers > 0:
            kw = {"prefetch_factor": self.prefetch_factor, "multiprocessing_context": self.multiprocessing_context}
        # A generator of its own: DataLoader otherwise draws its workers' base seed from the global torch
        # RNG, so starting an iteration (again, on resume) would shift every later dropout mask.
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence([self.seed, self.epoch, self.step])
                                                .generate_state(1, np.uint64)[0] >> 1))
        dl = torch.utils.data.DataLoader(_Steps(steps, self.make_batch), batch_size=None,
                                         sampler=range(self.step, len(steps)), num_workers=self.num_workers,
                                         pin_memory=self.pin_memory, generator=gen, **kw)
        for batch in dl:
            self.step += 1  # counted before the user sees it: a checkpoint in the loop body resumes after it
            yield batch
        if self.step >= len(steps):
            self.epoch, self.step = self.epoch + 1, 0


def _token_batch(docs, plan, opts, units, real):
    """A TokenLoader batch: packed rows of ``plan``, or padded documents (fillers without labels)."""
    if plan is not None:
        return collate_packed(plan, units, docs.__getitem__, opts["pad_id"], loss=real)
    batch = [docs[int(d)] for d in units]
    batch = [(t, m if ok else np.zeros_like(m)) for (t, m), ok in zip(batch, real)]
    return pad_collate(batch, opts["pad_id"], pad_to_multiple_of=opts["pad_to_multiple_of"],
                       max_length=opts["max_length"], padding_side=opts["padding_side"])


def _pack_by_source(lengths, sources, seq_len, overflow, backend, n_sources=0) -> tuple[PackPlan, np.ndarray | None]:
    """``pack`` of all documents (``sources`` None), or of each source's documents on its own, the rows laid
    end to end: (plan, source of each row or None)."""
    if sources is None:
        return pack(lengths, seq_len, overflow, backend), None
    plans, ids = [], []
    for s in range(n_sources):
        idx = np.flatnonzero(sources == s)
        plans.append(pack(lengths[idx], seq_len, overflow, backend))
        ids.append(idx)
    ptr = [np.zeros(1, np.int64)]
    for p in plans:
        ptr.append(p.row_ptr[1:] + ptr[-1][-1])
    st = [p.stats for p in plans]
    n_rows, n_tok = sum(x.n_rows for x in st), sum(x.n_tokens for x in st)
    stats = PackStats(n_docs=sum(x.n_docs for x in st), n_rows=n_rows, n_tokens=n_tok,
                      fill_ratio=n_tok / (n_rows * seq_len) if n_rows else 1.0,
                      n_split_docs=sum(x.n_split_docs for x in st), n_truncated_docs=sum(x.n_truncated_docs for x in st),
                      n_truncated_tokens=sum(x.n_truncated_tokens for x in st))
    plan = PackPlan(seq_len, np.concatenate(ptr), np.concatenate([i[p.doc] for i, p in zip(ids, plans)]),
                    np.concatenate([p.start for p in plans]), np.concatenate([p.length for p in plans]), stats)
    return plan, np.repeat(np.arange(len(plans)), [p.n_rows for p in plans])


class TokenLoader(UnitLoader):
    """Iterable of token batches over a token cache: the ``UnitLoader`` front for documents.

    ``docs``: a ``TokenCache`` (or any object with ``lengths`` (n,) and ``docs[i] -> (ids,
    loss_mask)``, picklable when ``num_workers > 0``). ``seq_len`` is required with packing.
    ``rank`` / ``world_size`` default to torch.distributed's when it is initialized.
    """

    def __init__(self, docs, *, batch_size: int, pad_id: int, seq_len: int | None = None, packing: bool = True,
                 overflow: str = "split", shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, drop_last: bool = True, num_workers: int = 0,
                 pin_memory: bool = False, prefetch_factor: int | None = 2, group_by_length: bool = False,
                 mega_batch_mult: int = 50, pad_to_multiple_of: int | None = None,
                 max_length: int | None = None, padding_side: str = "right", pack_backend: str | None = None,
                 multiprocessing_context=None, weights=None):
        if packing and not seq_len:
            raise ValueError("packing=True needs seq_len")
        if packing and group_by_length:
            raise ValueError("group_by_length applies to padded batches (packing=False)")
        self.docs, self.packing, self.seq_len, self.overflow = docs, packing, seq_len, overflow
        self.opts = {"pad_id": pad_id, "pad_to_multiple_of": pad_to_multiple_of, "max_length": max_length,
                     "padding_side": padding_side}
        self.lengths = np.asarray(docs.lengths, dtype=np.int64)
        if not packing and max_length is not None and len(self.lengths) and self.lengths.max() > max_length:
            over = np.flatnonzero(self.lengths > max_length)
            raise ValueError(f"{len(over)} documents exceed max_length={max_length} (first: document {int(over[0])}, "
                             f"{int(self.lengths[over[0]])} tokens); truncate them when formatting "
                             "(FormatConfig.max_length)")
        sources = None
        if weights is not None:  # a mixture: the source of each document (MixedDocs, or a subset of one)
            sources = getattr(docs, "source_ids", None)
            if sources is None:
                raise ValueError("weights need docs that name each document's source (ftlib.data.MixedDocs)")
            sources = np.asarray(sources, np.int64)
            if len(weights) != len(getattr(docs, "source_names", weights)):
                raise ValueError(f"{len(weights)} weights for {len(docs.source_names)} sources")
        self.plan = None
        groups = sources
        if packing:
            self.plan, groups = _pack_by_source(self.lengths, sources, seq_len, overflow, pack_backend,
                                                len(weights or ()))
        unit_lengths = self.lengths
        if packing:
            unit_lengths = (np.add.reduceat(self.plan.length, self.plan.row_ptr[:-1]) if self.plan.n_rows
                            else np.zeros(0, np.int64))
        identity = {"n_tokens": int(self.lengths.sum()), "lengths_sha256": lengths_sha256(self.lengths),
                    "packing": packing, "seq_len": seq_len, "overflow": overflow}
        super().__init__(functools.partial(_token_batch, docs, self.plan, self.opts), unit_lengths,
                         batch_size=batch_size, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size,
                         drop_last=drop_last, group_by_length=group_by_length, mega_batch_mult=mega_batch_mult,
                         num_workers=num_workers, pin_memory=pin_memory, prefetch_factor=prefetch_factor,
                         multiprocessing_context=multiprocessing_context, identity=identity,
                         what="packed rows" if packing else "documents", groups=groups, weights=weights,
                         group_names=getattr(docs, "source_names", None))

    @property
    def pack_stats(self):
        return None if self.plan is None else self.plan.stats
