"""LoRA rank decay: shrink adapter ranks during training, keeping the best low-rank part of each update.

A layer's update is ``dW = s B A`` (``B`` [out, r], ``A`` [r, in], ``s`` the scaling). Its SVD comes
from the small factors alone, never from an [out, in] matrix:

    B = Q_B R_B,  A^T = Q_A R_A                 thin QR: Q_B [out, r], Q_A [in, r], R_* [r, r]
    R_B R_A^T = U S V^T                         SVD of an r x r core
    dW = s (Q_B U) S (Q_A V)^T                  the SVD of dW: sigma_i = S_ii

Shrinking to the components ``K`` (the k largest for the best rank-k approximation, Eckart-Young)
re-factorises

    A' = rho V_K^T Q_A^T,   B' = Q_B U_K S_K / rho,    rho = ||A||_F / sqrt(r)

so ``s B' A' = s sum_{i in K} sigma_i u_i v_i^T``: for every input x the layer output moves by

    ||dy|| = ||s (B A - B' A') x|| <= s max_{i not in K} sigma_i ||x||,
    ||s (B A - B' A')||_F = s sqrt(sum_{i not in K} sigma_i^2).

``A'`` keeps the row scale of ``A`` (``B'`` carries the magnitudes, as at LoRA's init), so a
component with sigma = 0 keeps a live ``A`` row instead of two zero factors that never train.
The scaling ``s`` is kept: ``alpha' = s k`` (rsLoRA: ``s sqrt(k)``). ``get_lora_config`` reads each
layer's rank and alpha back as ``rank_pattern`` / ``alpha_pattern`` entries, one escaped full module
name per layer that differs from ``r`` / ``alpha`` (the user's own patterns are expanded into such
names: the file is written with sorted keys and PEFT takes the first matching pattern, so a general
pattern could shadow a decayed layer), so ``save_adapter`` writes plain PEFT LoRA that ``peft`` and
ftlib load, after :class:`RankDecay` or a direct ``shrink_lora`` alike.
Cost per layer: two thin QRs (out r^2 + in r^2) and an r x r SVD, in float64.

Optimizer state, ``optimizer_state="project"`` (default). The gradients of the new factors are
exact linear maps of the old ones (no inverse of S is needed):

    g_A' = T_A g_A,  T_A = V_K^T R_A / rho                  [k, r]
    g_B' = g_B T_B,  T_B = R_A^+ V_K rho                    [r, k]   (R_A^+ = R_A^-1 when A has full rank)

(from g_A = s B^T G, g_B = s G A^T with G the gradient w.r.t. dW, and R_B R_A^T = U S V^T).
Pending gradients and first moments (Adam ``exp_avg``, SGD ``momentum_buffer``) are mapped so;
that is exact for the current gradient and, as in GaLore's projection, an approximation for an
average of past gradients taken at other factors. Second moments (``exp_avg_sq``,
``max_exp_avg_sq``, ``square_avg``, ``sum``) are mapped elementwise by the squared coefficients,
``v' = (T * T) v``: the diagonal of ``T diag(v) T^T``, exact when gradient coordinates are
uncorrelated. Step counters are kept. ``optimizer_state="reset"`` drops the state of the shrunk
factors instead (Adam then restarts their moments and bias correction). Either way the optimizer
object and its parameter groups stay valid: the parameters are the same ``nn.Parameter`` objects
with new data. An optimizer state this module does not know (e.g. 8-bit quantised moments) is
refused with ``project``, before anything changes; use ``reset`` there.

Importance for budget allocation (``budget=True``: the schedule's ranks summed over layers are a
global budget, redistributed across layers): ``"singular"`` scores component i of a layer by
``s sigma_i`` (its share of dW's Frobenius norm); ``"sensitivity"`` by a moving average of
``|v_i^T R_A g_A Q_A v_i| = |s sigma_i u_i^T G v_i|``, the first-order loss change when the
component is removed (the component-level gradient-weight product of AdaLoRA, Zhang et al. 2023,
arXiv:2303.10512), which :meth:`RankDecay.observe` accumulates while gradients are present. The
average is kept per singular-value position (components sorted by sigma at every observation), an
approximation when components swap places between observations.

Not supported (refused with a message): DoRA layers (the magnitude's row norm ``||W + s B A||``
changes with the truncation, so the output bound above does not hold), merged adapters, and
FSDP2-sharded (DTensor) factors. Under DDP the wrapper's gradient buckets are sized at
construction: rebuild the DDP wrapper after a decay step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from ._match import pattern_value
from .apply import LORA_CONFIG_ATTR, get_lora_config, lora_layers
from .layers import LoRALinear

__all__ = [
    "ExponentialRank",
    "RankDecay",
    "ShrinkReport",
    "StepRanks",
    "lora_spectrum",
    "shrink_lora",
]

_FIRST_MOMENTS = ("exp_avg", "momentum_buffer")
_SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum")
_IMPORTANCE = ("singular", "sensitivity")


# ---- schedules ---------------------------------------------------------------------------------


class ExponentialRank:
    """``r(t) = max(r_end, floor(r0 * decay^n))`` with ``n = floor((t - start) / every)`` decay events so far."""

    def __init__(self, decay: float, r_end: int = 1, *, every: int = 1, start: int = 0):
        if not 0.0 < float(decay) < 1.0:
            raise ValueError(f"ExponentialRank: decay must be in (0, 1), got {decay!r}")
        if not isinstance(r_end, int) or isinstance(r_end, bool) or r_end < 1:
            raise ValueError(f"ExponentialRank: r_end must be a positive integer, got {r_end!r}")
        if not isinstance(every, int) or every < 1 or not isinstance(start, int) or start < 0:
            raise ValueError(f"ExponentialRank: every must be >= 1 and start >= 0 (integers), got {every!r}, {start!r}")
        self.decay, self.r_end, self.every, self.start = float(decay), r_end, every, start

    def __call__(self, t: int, r0: int) -> int:
        n = max(0, (int(t) - self.start) // self.every)
        return min(r0, max(self.r_end, math.floor(r0 * self.decay**n + 1e-9)))


class StepRanks:
    """A list of ``(step, rank)``: the rank of the last entry whose step is <= t (``r0`` before the first)."""

    def __init__(self, steps: Iterable[tuple[int, int]]):
        pts = [(int(s), int(r)) for s, r in steps]
        if not pts:
            raise ValueError("StepRanks: give at least one (step, rank) pair")
        for (s0, r0), (s1, r1) in zip(pts, pts[1:]):
            if s1 <= s0:
                raise ValueError(f"StepRanks: steps must increase, got {s0} then {s1}")
            if r1 > r0:
                raise ValueError(f"StepRanks: rank decay never grows a rank, got {r0} then {r1} at step {s1}")
        if any(r < 1 for _, r in pts):
            raise ValueError(f"StepRanks: ranks must be >= 1, got {pts}")
        self.points = pts

    def __call__(self, t: int, r0: int) -> int:
        rank = r0
        for s, r in self.points:
            if s <= t:
                rank = r
        return min(r0, rank)


Schedule = Callable[[int, int], int]


# ---- the factorisation ---------------------------------------------------------------------------


@dataclass
class _Spectrum:
    q_b: torch.Tensor  # (out, r) float64
    u: torch.Tensor  # (r, r)
    s: torch.Tensor  # (r,) singular values of B A (not scaled), descending
    v: torch.Tensor  # (r, r)
    q_a: torch.Tensor  # (in, r)
    r_a: torch.Tensor  # (r, r)
    rho: float


def _check_layer(name: str, layer: LoRALinear) -> None:
    if layer.use_dora:
        raise ValueError(f"rank decay of {name}: DoRA layers are not supported (the magnitude's row norm "
                         "||W + s B A|| changes with the truncation, so the output bound does not hold)")
    if layer.merged:
        raise RuntimeError(f"rank decay of {name}: the adapter is merged into the base weight; unmerge it first")
    for p in (layer.lora_A.weight, layer.lora_B.weight):
        if hasattr(p, "full_tensor") or hasattr(p, "device_mesh"):
            raise ValueError(f"rank decay of {name}: FSDP2-sharded (DTensor) factors cannot change shape in "
                             "place; decay before sharding, or on a gathered copy")


@torch.no_grad()
def _spectrum(layer: LoRALinear) -> _Spectrum:
    a = layer.lora_A.weight.detach().to(torch.float64)  # (r, in)
    b = layer.lora_B.weight.detach().to(torch.float64)  # (out, r)
    r, (out_f, in_f) = a.shape[0], (b.shape[0], a.shape[1])
    # r > out or r > in (tiny layers): zero rows make both R factors r x r; the extra rows of Q only
    # meet zero singular values, so they are cut off again below
    q_b, r_b = torch.linalg.qr(torch.nn.functional.pad(b, (0, 0, 0, max(0, r - out_f))))  # (out, r), (r, r)
    q_a, r_a = torch.linalg.qr(torch.nn.functional.pad(a.t(), (0, 0, 0, max(0, r - in_f))))  # (in, r), (r, r)
    u, s, vh = torch.linalg.svd(r_b @ r_a.t())  # (r, r): the core of B A
    rho = float(torch.linalg.vector_norm(a)) / math.sqrt(r)
    return _Spectrum(q_b[:out_f], u, s, vh.t(), q_a[:in_f], r_a, rho if rho > 0 else 1.0)


def lora_spectrum(layer: LoRALinear) -> torch.Tensor:
    """The singular values of the layer's update ``s B A`` (float64, descending), from the factors only."""
    return _spectrum(layer).s * layer.scaling


@dataclass
class ShrinkReport:
    """What one layer's shrink did."""

    name: str
    old_rank: int
    new_rank: int
    singular_values: list[float]  # of s B A before the shrink, descending
    kept: list[int]  # indices into singular_values
    max_discarded: float  # the output bound's factor: ||dy|| <= max_discarded * ||x||
    discarded_frobenius: float  # ||s (B A - B' A')||_F

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _maps(sp: _Spectrum, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T_A [k, r], T_B [r, k]): g_A' = T_A g_A, g_B' = g_B T_B."""
    v_k = sp.v[:, keep]  # (r, k)
    t_a = v_k.t() @ sp.r_a / sp.rho
    t_b = torch.linalg.pinv(sp.r_a) @ v_k * sp.rho
    return t_a, t_b


def _check_state(optimizer, params: list[nn.Parameter], mode: str, name: str) -> None:
    if optimizer is None or mode == "reset":
        return
    for p in params:
        for key, val in optimizer.state.get(p, {}).items():
            if torch.is_tensor(val) and val.shape == p.shape and key not in _FIRST_MOMENTS + _SECOND_MOMENTS:
                raise ValueError(
                    f"rank decay of {name}: optimizer state {key!r} of {type(optimizer).__name__} cannot be projected "
                    "(unknown kind); pass optimizer_state='reset'"
                )


@torch.no_grad()
def _map_tensor(x: torch.Tensor, t: torch.Tensor, left: bool, square: bool) -> torch.Tensor:
    m = t * t if square else t
    x64 = x.to(torch.float64)
    out = m @ x64 if left else x64 @ m
    if square:
        out = out.clamp_min(0.0)
    return out.to(x.dtype)


def _set_data(p: nn.Parameter, new: torch.Tensor) -> None:
    """Give ``p`` new data of another shape, keeping the Parameter object (the optimizer holds it).

    Autograd caches a leaf's gradient accumulator (with the leaf's shape) while any graph that used
    it is alive, e.g. the last step's loss; ``set_data`` drops that cache only when the dtype or
    device changes, so the data passes through another dtype first. Otherwise the next backward
    would check the new gradient against the old shape and fail.
    """
    new = new.to(device=p.device, dtype=p.dtype).contiguous()
    other = torch.float32 if p.dtype != torch.float32 else torch.float64
    p.data = torch.empty(0, dtype=other, device=p.device)
    p.data = new


@torch.no_grad()
def shrink_lora(
    layer: LoRALinear,
    rank: int | None = None,
    *,
    keep: Iterable[int] | None = None,
    optimizer=None,
    optimizer_state: str = "project",
    name: str = "layer",
) -> ShrinkReport:
    """Replace the layer's update by its best rank-``rank`` approximation (or the components ``keep``).

    ``optimizer`` (a ``torch.optim`` optimizer, a ``TrainOptimizer``, or None): its state for the two
    factors is projected or reset (``optimizer_state``); the factors stay the same ``nn.Parameter``
    objects. Pending gradients are mapped exactly. Returns a :class:`ShrinkReport`.
    """
    _check_layer(name, layer)
    if optimizer_state not in ("project", "reset"):
        raise ValueError(f"optimizer_state must be 'project' or 'reset', got {optimizer_state!r}")
    optimizer = getattr(optimizer, "optimizer", optimizer)  # TrainOptimizer -> its torch optimizer
    r = layer.r
    if keep is None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= r:
            raise ValueError(f"rank decay of {name}: new rank must be an integer in [1, {r}], got {rank!r}")
        keep_idx = list(range(rank))
    else:
        keep_idx = sorted(set(int(i) for i in keep))
        if not keep_idx or keep_idx[0] < 0 or keep_idx[-1] >= r:
            raise ValueError(f"rank decay of {name}: keep must name components in [0, {r}), got {keep_idx}")
    a_p, b_p = layer.lora_A.weight, layer.lora_B.weight
    _check_state(optimizer, [a_p, b_p], optimizer_state, name)
    sp = _spectrum(layer)
    k = len(keep_idx)
    sv = (sp.s * layer.scaling).tolist()
    dropped = [i for i in range(r) if i not in set(keep_idx)]
    report = ShrinkReport(
        name=name, old_rank=r, new_rank=k, singular_values=sv, kept=keep_idx,
        max_discarded=max((sv[i] for i in dropped), default=0.0),
        discarded_frobenius=math.sqrt(sum(sv[i] ** 2 for i in dropped)),
    )
    if k == r and keep_idx == list(range(r)):
        return report
    idx = torch.tensor(keep_idx, dtype=torch.long, device=sp.s.device)
    new_a = sp.rho * (sp.q_a @ sp.v[:, idx]).t()  # (k, in)
    new_b = (sp.q_b @ sp.u[:, idx]) * (sp.s[idx] / sp.rho)  # (out, k)
    t_a, t_b = _maps(sp, idx)

    # gradients and optimizer state are mapped while the parameters still have the old shapes
    grads = {}
    for p, t, left in ((a_p, t_a, True), (b_p, t_b, False)):
        if p.grad is not None:
            grads[p] = _map_tensor(p.grad, t, left, square=False)
            p.grad = None
        if optimizer is not None and p in optimizer.state:
            if optimizer_state == "reset":
                del optimizer.state[p]
                continue
            st = optimizer.state[p]
            for key, val in list(st.items()):
                if torch.is_tensor(val) and val.shape == p.shape:
                    st[key] = _map_tensor(val, t, left, square=key in _SECOND_MOMENTS)
    _set_data(a_p, new_a)
    _set_data(b_p, new_b)
    for p, g in grads.items():
        p.grad = g
    layer.lora_A.out_features = layer.lora_B.in_features = k
    s = layer.scaling
    layer.r = k
    layer.alpha = s * (math.sqrt(k) if layer.use_rslora else k)
    layer.scaling = s  # kept exactly (alpha' / k may round differently)
    return report


# ---- the schedule driver -------------------------------------------------------------------------


@dataclass
class _LayerState:
    r0: int
    schedule: Schedule
    importance: list[float] = field(default_factory=list)  # sensitivity EMA by singular-value position


class RankDecay:
    """Shrink the ranks of a model's LoRA layers on a schedule; call :meth:`step` after each optimizer step.

    ``schedule``: a callable ``(t, r0) -> rank`` (:class:`ExponentialRank`, :class:`StepRanks`) for
    every adapted layer; ``patterns``: ``{pattern: schedule or None}`` per module, matched as PEFT's
    ``rank_pattern`` (``(.*\\.)?(pattern)$``, first match wins; None exempts the layer). ``t`` counts
    optimizer steps (``step()`` advances it by one, or pass ``t``). ``budget=True``: the scheduled
    ranks summed over layers are a global budget that ``importance`` redistributes (no layer grows,
    none drops below ``min_rank``). ``optimizer`` may be None (e.g. compressing a trained adapter).

    Loop::

        decay = RankDecay(model, ExponentialRank(0.5, r_end=4, every=200), optimizer=opt)
        for batch in ...:
            ...; opt.step(); decay.step()          # shrinks at t = 200, 400, ... until rank 4
        save_adapter(model, "out/adapter")         # PEFT LoRA with rank_pattern / alpha_pattern
    """

    def __init__(
        self,
        model: nn.Module,
        schedule: Schedule | None = None,
        *,
        patterns: dict[str, Schedule | None] | None = None,
        optimizer=None,
        optimizer_state: str = "project",
        budget: bool = False,
        importance: str = "singular",
        min_rank: int = 1,
        ema: float = 0.85,
    ):
        if optimizer_state not in ("project", "reset"):
            raise ValueError(f"optimizer_state must be 'project' or 'reset', got {optimizer_state!r}")
        if importance not in _IMPORTANCE:
            raise ValueError(f"importance must be one of {_IMPORTANCE}, got {importance!r}")
        if not isinstance(min_rank, int) or min_rank < 1:
            raise ValueError(f"min_rank must be a positive integer, got {min_rank!r}")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema!r}")
        self.model, self.optimizer, self.optimizer_state = model, optimizer, optimizer_state
        self.budget, self.importance, self.min_rank, self.ema = budget, importance, min_rank, ema
        self.layers: dict[str, _LayerState] = {}
        for name, layer in lora_layers(model):
            sched = pattern_value(patterns or {}, name, schedule)
            if sched is None:
                continue
            _check_layer(name, layer)
            self.layers[name] = _LayerState(layer.r, sched)
        if not self.layers:
            raise ValueError("RankDecay: no LoRA layer has a schedule (apply_lora first, or check the patterns)")
        self.t = 0
        self.observations = 0
        self.history: list[dict] = []

    def _layer(self, name: str) -> LoRALinear:
        return self.model.get_submodule(name)

    def ranks(self) -> dict[str, int]:
        """Current rank of every scheduled layer."""
        return {name: self._layer(name).r for name in self.layers}

    @torch.no_grad()
    def observe(self) -> None:
        """Accumulate the sensitivity importance from the gradients present now (after backward, before
        they are zeroed: with ``TrainOptimizer`` between ``prepare_grads()`` and ``step()``)."""
        for name, st in self.layers.items():
            layer = self._layer(name)
            g = layer.lora_A.weight.grad
            if g is None:
                raise RuntimeError(f"RankDecay.observe: {name}.lora_A has no gradient; call it after backward")
            sp = _spectrum(layer)
            c = sp.r_a @ g.to(torch.float64) @ sp.q_a  # (r, r)
            score = (sp.v * (c @ sp.v)).sum(0).abs().tolist()  # |v_i^T C v_i| per component
            if len(st.importance) != len(score):
                st.importance = score
            else:
                st.importance = [self.ema * a + (1 - self.ema) * b for a, b in zip(st.importance, score)]
        self.observations += 1

    def _scores(self, name: str) -> list[float]:
        layer = self._layer(name)
        if self.importance == "singular":
            return lora_spectrum(layer).tolist()
        st = self.layers[name]
        if len(st.importance) != layer.r:
            raise RuntimeError(f"RankDecay: importance='sensitivity' needs observe() calls before a decay step "
                               f"({name} has no scores for its {layer.r} components)")
        return st.importance

    def targets(self, t: int) -> dict[str, list[int]]:
        """Components each layer keeps at step ``t`` (indices in singular-value order)."""
        current = self.ranks()
        want = {n: min(current[n], st.schedule(t, st.r0)) for n, st in self.layers.items()}
        for n, r in want.items():
            if not isinstance(r, int) or r < 1:
                raise ValueError(f"RankDecay: schedule gave rank {r!r} for {n} at step {t}")
        if not self.budget:
            return {n: list(range(r)) for n, r in want.items()}
        total = sum(want.values())
        if total >= sum(current.values()):
            return {n: list(range(r)) for n, r in current.items()}
        keep: dict[str, list[int]] = {}
        pool: list[tuple[float, str, int]] = []
        for n in self.layers:
            scores = self._scores(n)
            floor = min(self.min_rank, current[n])
            order = sorted(range(current[n]), key=lambda i: (-scores[i], i))
            keep[n] = sorted(order[:floor])
            pool += [(scores[i], n, i) for i in order[floor:]]
        left = total - sum(len(v) for v in keep.values())
        for _, n, i in sorted(pool, key=lambda x: (-x[0], x[1], x[2]))[: max(left, 0)]:
            keep[n].append(i)
        return {n: sorted(v) for n, v in keep.items()}

    def step(self, t: int | None = None) -> list[ShrinkReport]:
        """Advance to step ``t`` (default: one more) and shrink every layer whose target is below its rank."""
        self.t = self.t + 1 if t is None else int(t)
        targets = self.targets(self.t)
        reports = []
        for name, keep in targets.items():
            layer = self._layer(name)
            if keep == list(range(layer.r)):
                continue
            _check_state(getattr(self.optimizer, "optimizer", self.optimizer),
                         [layer.lora_A.weight, layer.lora_B.weight], self.optimizer_state, name)
        for name, keep in targets.items():
            layer = self._layer(name)
            if keep == list(range(layer.r)):
                continue
            st = self.layers[name]
            old_scores = st.importance if len(st.importance) == layer.r else []
            reports.append(shrink_lora(layer, keep=keep, optimizer=self.optimizer,
                                       optimizer_state=self.optimizer_state, name=name))
            st.importance = [old_scores[i] for i in keep] if old_scores else []  # kept components keep their order
        if reports:
            self._update_config()
            self.history.append({"t": self.t, "ranks": {r.name: r.new_rank for r in reports}})
        return reports

    def _update_config(self) -> None:
        # the stored config follows the layers (get_lora_config derives it from their ranks and alphas)
        if getattr(self.model, LORA_CONFIG_ATTR, None) is not None:
            object.__setattr__(self.model, LORA_CONFIG_ATTR, get_lora_config(self.model))

    # -- state ------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """JSON-ready: step, initial and current ranks, importance averages, history."""
        return {
            "t": self.t,
            "observations": self.observations,
            "r0": {n: st.r0 for n, st in self.layers.items()},
            "ranks": self.ranks(),
            "importance": {n: list(st.importance) for n, st in self.layers.items()},
            "history": list(self.history),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved state; the model must already hold the saved ranks (load the decayed adapter first)."""
        missing = set(self.layers) - set(state["ranks"])
        if missing:
            raise ValueError(f"RankDecay state has no entry for {sorted(missing)[:3]}")
        now = self.ranks()
        for n in self.layers:
            if now[n] != state["ranks"][n]:
                raise ValueError(f"RankDecay state: {n} has rank {now[n]} but the state says {state['ranks'][n]}; "
                                 "load the adapter saved with this state first")
        self.t, self.observations = int(state["t"]), int(state.get("observations", 0))
        for n, st in self.layers.items():
            st.r0 = int(state["r0"][n])
            st.importance = [float(x) for x in state.get("importance", {}).get(n, [])]
        self.history = list(state.get("history", []))
