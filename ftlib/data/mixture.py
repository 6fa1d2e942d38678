"""Weighted data mixtures: several sources, each its own token cache, sampled by weight every epoch.

    --data chat.jsonl:0.7 code/:0.3          (a training script; a config file: data: [chat.jsonl:0.7, code/:0.3])
    specs = parse_mixture(["chat.jsonl:0.7", "code/:0.3"])    # [("chat.jsonl", 0.7), ("code/", 0.3)]
    docs = MixedDocs([open_cache("c/0"), open_cache("c/1")], names=["chat.jsonl", "code/"])
    loader = TokenLoader(docs, batch_size=8, seq_len=2048, pad_id=0, weights=[0.7, 0.3])

A spec is ``PATH:WEIGHT`` (the weight after the last ``:``, a positive number; weights need not
sum to 1, they are normalised). Either every source of a list has a weight or none has (then the
sources are one corpus, read as one cache). ``hf://`` specs take a weight the same way.

What is sampled. The loader's units (packed rows, or documents without packing) are built *per
source* — a packed row never mixes sources — and the weights are shares of the epoch's *tokens*
(what the loss is summed over). An epoch has as many units as all sources together (``N``);
source ``i`` gets ``n_i`` of them, proportional to ``w_i / L_i`` (``L_i``: the mean tokens of its
units, so a source of short, half-empty rows gets more rows for the same tokens), rounded by
largest remainder so that the ``n_i`` sum to ``N``. Its ``n_i`` units are drawn from its ``m_i``
units as whole passes over a fresh permutation each (``n_i // m_i`` times) plus the first
``n_i mod m_i`` of one more: below its natural share a source is subsampled without repeats,
above it every unit repeats as evenly as possible. The draw uses the epoch's generator (``[seed, epoch]``) like the
plain order, so it is the same on every rank and every run: the ranks slice the same global steps,
and a resumed run (``{epoch, step}``) continues exactly. :func:`mixture_counts` and
:func:`draw_mixture` are that rule; ``UnitLoader.mix(epoch)`` reports the realised mix of an
epoch (units and tokens per source).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["MixedDocs", "draw_mixture", "mixture_counts", "parse_mixture"]


def parse_mixture(specs) -> list[tuple[str, float | None]]:
    """``["a.jsonl:0.7", "b/:0.3"]`` (or a mapping ``{path: weight}``) -> ``[(path, weight or None)]``.

    ``ValueError`` for a weight that is not a positive finite number, or a list where only some
    sources have one."""
    if isinstance(specs, dict):
        items = [(str(k), v) for k, v in specs.items()]
    else:
        items = []
        for s in [specs] if isinstance(specs, str) else list(specs):
            s = str(s)
            path, sep, w = s.rpartition(":")
            weight = None
            if sep and path and "/" not in w:
                try:
                    weight = float(w)
                except ValueError:
                    weight = None
                else:
                    s = path
            items.append((s, weight))
    out = []
    for path, w in items:
        if w is not None:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
                raise ValueError(f"{path}:{w}: a source's weight must be a positive number")
            w = float(w)
        out.append((path, w))
    given = [w is not None for _, w in out]
    if any(given) and not all(given):
        missing = [p for p, w in out if w is None]
        raise ValueError(f"give every source a weight or none: {', '.join(missing)} has none "
                         "(write PATH:WEIGHT, e.g. a.jsonl:0.7 b/:0.3)")
    return out


def mixture_counts(weights, n: int) -> np.ndarray:
    """Units per source in an epoch of ``n`` units: ``w_i / sum(w) * n`` rounded by largest remainder."""
    w = np.asarray(weights, np.float64)
    exact = w / w.sum() * n
    counts = np.floor(exact).astype(np.int64)
    rest = n - int(counts.sum())
    if rest:
        counts[np.argsort(-(exact - counts), kind="stable")[:rest]] += 1
    return counts


def draw_mixture(rng: np.random.Generator, groups: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The epoch's units: for each source ``i``, ``counts[i]`` of the units where ``groups == i``
    (whole fresh permutations, then part of one more), all of them shuffled together."""
    picked = []
    for i, k in enumerate(counts.tolist()):
        units = np.flatnonzero(groups == i)
        if k and not len(units):
            raise ValueError(f"mixture source {i} has no units to draw {k} from")
        full, part = divmod(k, len(units)) if len(units) else (0, 0)
        picked.extend(units[rng.permutation(len(units))] for _ in range(full))
        picked.append(units[rng.permutation(len(units))[:part]])
    sel = np.concatenate(picked) if picked else np.zeros(0, np.int64)
    return sel[rng.permutation(len(sel))]


class MixedDocs:
    """Several token caches (or any objects with ``lengths`` and ``[i]``) as one: document ``i`` of the
    whole is document ``i - start[s]`` of source ``s``; ``source_ids`` (n_docs,) names each document's
    source, ``source_names`` the sources. Pickles as its parts (each cache pickles as its path)."""

    def __init__(self, parts, names=None):
        self.parts = list(parts)
        if not self.parts:
            raise ValueError("MixedDocs needs at least one source")
        self.source_names = list(names) if names is not None else [f"source {i}" for i in range(len(self.parts))]
        lens = [np.asarray(p.lengths, np.int64) for p in self.parts]
        self.lengths = np.concatenate(lens)
        self.source_ids = np.concatenate([np.full(len(x), i, np.int64) for i, x in enumerate(lens)])
        self._starts = np.concatenate([[0], np.cumsum([len(x) for x in lens])])

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int):
        s = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self.parts[s][int(i - self._starts[s])]
