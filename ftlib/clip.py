"""Gradient clippers: global norm, z-score adaptive, AGC, per-layer norm.

Every clipper is a callable on parameters (an ``nn.Module``, an iterable of tensors, or an
iterable of ``(name, tensor)`` pairs) that clips the ``.grad`` of each parameter in place and
returns a :class:`ClipStats` (norm before, norm after, clipped flag, scale) for logging. Stats
are 0-d tensors on the gradients' device, so clipping never forces a host sync; call
``stats.to_dict()`` when you log.

Rules (g = all gradients flattened, ||.|| the p-norm, p = 2 unless stated):

- **Global norm** (Pascanu et al. 2013, "On the difficulty of training RNNs"; the rule of
  ``torch.nn.utils.clip_grad_norm_``)::

      s = min(1, c / (||g|| + 1e-6));   g <- s * g

- **Z-score adaptive**: keep exponential moving estimates of the mean m and variance v of
  the global gradient norm n_t. After ``warmup`` steps a step is clipped to the bound::

      b = m + z * sqrt(v);   s = min(1, b / n_t);   g <- s * g

  and the EMA is updated with the *clipped* norm c_t = min(n_t, b) (so one spike cannot
  inflate the bound for later spikes)::

      d = c_t - m;  m <- m + a d;  v <- (1 - a)(v + a d^2)      (a = 1 - beta)

  During warm-up nothing is clipped and the EMA is fed the raw norm (the first norm
  initialises m; v starts at 0). Non-finite norms never touch the EMA.

- **AGC**, adaptive gradient clipping (Brock et al. 2021, "High-Performance Large-Scale Image
  Recognition Without Normalization", sec. 4.1), unit-wise for each output unit i (row i of a
  weight: every dim but the first is reduced; vectors and scalars form one unit)::

      ||G_i|| / max(||W_i||, eps) <= lam,   G_i <- G_i * lam max(||W_i||, eps) / ||G_i||  if violated

- **Per-layer norm**: parameters are grouped by their owning module (the name up to the last
  dot); the first rule ``(regex, max_norm)`` whose regex ``re.search``-matches the parameter
  name sets that group's bound; each group is clipped like the global rule with its own norm.

Sharded gradients (FSDP2 / DTensor): norms are reduced over all shards. Each shard's local
p-th power sum is divided by the number of replicas (mesh dims with ``Replicate``) and summed
over every mesh dim with one ``all_reduce`` per mesh dim, so every rank sees the same norm and
applies the same scale. Plain tensors are taken as whole (as with DDP, where every rank holds
the same averaged gradient).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "ClipStats",
    "GlobalNormClipper",
    "ZScoreClipper",
    "AGCClipper",
    "PerLayerClipper",
    "grad_norm",
    "named_grads",
]

_EPS = 1e-6  # same guard as torch.nn.utils.clip_grad_norm_


@dataclass
class ClipStats:
    """What one clipping call did. Tensors are 0-d, on the gradients' device."""

    norm_before: torch.Tensor
    norm_after: torch.Tensor
    clipped: torch.Tensor  # bool: did any gradient get scaled down
    scale: torch.Tensor  # the (smallest) factor applied; 1 when nothing was clipped
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def to_dict(self) -> dict[str, float]:
        """Plain floats for a logger (one host sync)."""
        out = {
            "grad_norm": float(self.norm_before),
            "grad_norm_clipped": float(self.norm_after),
            "clipped": float(self.clipped),
            "clip_scale": float(self.scale),
        }
        out.update({k: float(v) for k, v in self.extra.items()})
        return out


# --------------------------------------------------------------------------------------------
# Parameter handling and sharded norms
# --------------------------------------------------------------------------------------------


def named_grads(parameters) -> list[tuple[str, nn.Parameter]]:
    """``(name, param)`` for every parameter that has a gradient.

    ``parameters`` is a module, a tensor, an iterable of tensors or of ``(name, tensor)``.
    Unnamed tensors are called ``param{i}``.
    """
    if isinstance(parameters, nn.Module):
        items = list(parameters.named_parameters())
    elif isinstance(parameters, torch.Tensor):
        items = [("param0", parameters)]
    else:
        items = []
        for i, p in enumerate(parameters):
            if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
                items.append(p)
            elif isinstance(p, torch.Tensor):
                items.append((f"param{i}", p))
            else:
                raise TypeError(f"parameters[{i}] is {type(p).__name__}; expected a tensor or (name, tensor)")
    return [(n, p) for n, p in items if p.grad is not None]


def _dtensor_cls():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise); in-place edits reach it."""
    cls = _dtensor_cls()
    return t._local_tensor if cls is not None and isinstance(t, cls) else t


def _placement_info(t: torch.Tensor):
    """(mesh, replicas, sharded mesh dims by tensor dim) for a DTensor, None for a plain tensor."""
    cls = _dtensor_cls()
    if cls is None or not isinstance(t, cls):
        return None
    from torch.distributed.tensor import Replicate, Shard

    replicas, shard_dims = 1, defaultdict(list)
    for mesh_dim, pl in enumerate(t.placements):
        if isinstance(pl, Replicate):
            replicas *= t.device_mesh.size(mesh_dim)
        elif isinstance(pl, Shard):
            shard_dims[pl.dim % t.ndim].append(mesh_dim)
        else:
            raise ValueError(
                f"gradient has placement {pl}; reduce gradients (e.g. finish FSDP/DDP backward) before clipping"
            )
    return t.device_mesh, replicas, shard_dims


def _all_reduce_mesh(x: torch.Tensor, mesh, mesh_dims, op) -> None:
    import torch.distributed as dist

    for d in mesh_dims:
        dist.all_reduce(x, op=op, group=mesh.get_group(d))


def _local_contributions(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Each tensor's local share of the global norm, float32 [n]: ||local||^p / replicas (max-abs for p = inf).

    One ``_foreach_norm`` per (device, dtype) bucket.
    """
    inf = math.isinf(norm_type)
    out_device = _local(grads[0]).device
    out = torch.empty(len(grads), device=out_device)
    buckets: dict = defaultdict(list)
    for i, g in enumerate(grads):
        loc = _local(g)
        buckets[(loc.device, loc.dtype)].append((i, loc))
    for items in buckets.values():
        norms = torch.stack(torch._foreach_norm([t for _, t in items], norm_type, dtype=torch.float32))
        out[torch.tensor([i for i, _ in items], device=out_device)] = norms.to(out_device)
    if not inf:
        replicas = torch.tensor([1 if (info := _placement_info(g)) is None else info[1] for g in grads],
                                dtype=torch.float32, device=out_device)
        out = out.pow(norm_type) / replicas
    return out


def _reduce_groups(
    contrib: torch.Tensor, tensors: list[torch.Tensor], groups: list[int], n_groups: int, inf: bool
) -> torch.Tensor:
    """Sum (max for p = inf) the local contributions [n] into [n_groups], then over every shard.

    DTensor contributions are reduced over their mesh (one ``all_reduce`` per mesh dim); plain
    tensors count once.
    """
    by_mesh: dict = defaultdict(list)
    for i, t in enumerate(tensors):
        info = _placement_info(t)
        by_mesh[None if info is None else info[0]].append(i)
    total = torch.zeros(n_groups, device=contrib.device)
    for mesh, idxs in by_mesh.items():
        acc = torch.zeros(n_groups, device=contrib.device)
        vals = contrib[torch.tensor(idxs, device=contrib.device)]
        gidx = torch.tensor([groups[i] for i in idxs], device=contrib.device)
        if inf:
            acc.scatter_reduce_(0, gidx, vals, reduce="amax")
        else:
            acc.index_add_(0, gidx, vals)
        if mesh is not None:
            import torch.distributed as dist

            _all_reduce_mesh(acc, mesh, range(mesh.ndim), dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        total = torch.maximum(total, acc) if inf else total + acc
    return total


def _group_norms(grads: list[torch.Tensor], groups: list[int], n_groups: int, norm_type: float) -> torch.Tensor:
    """p-norm of each group of (possibly sharded) tensors over every shard, float32 [n_groups]."""
    if not grads:
        return torch.zeros(n_groups)
    inf = math.isinf(norm_type)
    total = _reduce_groups(_local_contributions(grads, norm_type), grads, groups, n_groups, inf)
    return total if inf else total.pow(1.0 / norm_type)


def grad_norm(parameters, norm_type: float = 2.0) -> torch.Tensor:
    """Total p-norm of all gradients (over every shard for DTensor gradients), float32 0-d."""
    grads = [p.grad for _, p in named_grads(parameters)]
    return _group_norms(grads, [0] * len(grads), 1, float(norm_type))[0]


def _check_bound(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def _check_norm_type(value: float) -> float:
    value = float(value)
    if not value > 0:  # +inf (max-abs norm) is allowed
        raise ValueError(f"norm_type must be > 0 or inf, got {value}")
    return value


def _scale_(grads: list[torch.Tensor], scale: torch.Tensor) -> None:
    by_device: dict = defaultdict(list)
    for g in grads:
        loc = _local(g)
        by_device[loc.device].append(loc)
    for device, ts in by_device.items():
        torch._foreach_mul_(ts, scale.to(device))


# --------------------------------------------------------------------------------------------
# Clippers
# --------------------------------------------------------------------------------------------


class _Stateless:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state; got keys {sorted(state)}")


class GlobalNormClipper(_Stateless):
    """Clip the global gradient norm to ``max_norm`` (same result as ``clip_grad_norm_``)."""

    def __init__(self, max_norm: float, norm_type: float = 2.0):
        self.max_norm = _check_bound("max_norm", max_norm)
        self.norm_type = _check_norm_type(norm_type)

    def __call__(self, parameters) -> ClipStats:
        grads = [p.grad for _, p in named_grads(parameters)]
        norm = _group_norms(grads, [0] * len(grads), 1, self.norm_type)[0]
        scale = torch.clamp(self.max_norm / (norm + _EPS), max=1.0)
        _scale_(grads, scale)
        return ClipStats(norm, norm * scale, scale < 1.0, scale)


class ZScoreClipper:
    """Clip spikes above ``mean + z * std`` of an EMA of the gradient norm (see module doc).

    ``warmup`` counts calls: the first ``warmup`` calls never clip. The EMA lives in tensors on
    the gradients' device, so a call makes no host sync.
    """

    def __init__(self, z: float = 3.0, beta: float = 0.98, warmup: int = 100, norm_type: float = 2.0):
        self.z = _check_bound("z", z)
        if not 0.0 < beta < 1.0:
            raise ValueError(f"beta must be in (0, 1), got {beta}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.beta, self.warmup = float(beta), int(warmup)
        self.norm_type = _check_norm_type(norm_type)
        self.step = 0  # calls so far
        self.mean = torch.zeros((), dtype=torch.float64)
        self.var = torch.zeros((), dtype=torch.float64)
        self.count = torch.zeros((), dtype=torch.float64)  # finite norms absorbed into the EMA

    def bound(self) -> torch.Tensor:
        """The current clipping bound m + z*sqrt(v); +inf before the EMA has a value."""
        b = self.mean + self.z * self.var.sqrt()
        return torch.where(self.count > 0, b, torch.full_like(b, math.inf))

    def __call__(self, parameters) -> ClipStats:
        grads = [p.grad for _, p in named_grads(parameters)]
        norm = _group_norms(grads, [0] * len(grads), 1, self.norm_type)[0]
        self.mean, self.var, self.count = (t.to(norm.device) for t in (self.mean, self.var, self.count))
        finite = torch.isfinite(norm)
        one = torch.ones((), device=norm.device)
        if self.step < self.warmup:
            scale, clipped_norm = one, norm.double()
        else:
            bound = self.bound()
            scale = torch.where(finite, torch.clamp(bound / (norm.double() + _EPS), max=1.0), one.double()).float()
            clipped_norm = torch.minimum(norm.double(), bound)
            _scale_(grads, scale)
        a = 1.0 - self.beta
        first = self.count == 0
        d = clipped_norm - self.mean
        new_mean = torch.where(first, clipped_norm, self.mean + a * d)
        new_var = torch.where(first, torch.zeros_like(self.var), (1.0 - a) * (self.var + a * d * d))
        self.mean = torch.where(finite, new_mean, self.mean)
        self.var = torch.where(finite, new_var, self.var)
        self.count = self.count + finite.double()
        self.step += 1
        return ClipStats(norm, norm * scale, scale < 1.0, scale)

    def state_dict(self) -> dict:
        return {"step": self.step, "mean": float(self.mean), "var": float(self.var), "count": float(self.count)}

    def load_state_dict(self, state: dict) -> None:
        missing = {"step", "mean", "var", "count"} - set(state)
        if missing:
            raise KeyError(f"ZScoreClipper state is missing {sorted(missing)}")
        self.step = int(state["step"])
        self.mean, self.var, self.count = (
            torch.tensor(float(state[k]), dtype=torch.float64) for k in ("mean", "var", "count")
        )


def _unit_sq_norms(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared L2 norm of each output unit, float32 [rows] (ndim >= 2) or [1]: (local shard, all shards)."""
    loc = _local(t)
    if t.ndim >= 2:
        reduced_dims = list(range(1, t.ndim))
        local = torch.linalg.vector_norm(loc.flatten(1), dim=1, dtype=torch.float32).square()
    else:
        reduced_dims = list(range(t.ndim))
        local = torch.linalg.vector_norm(loc, dtype=torch.float32).square().reshape(1)
    info = _placement_info(t)
    if info is None:
        return local, local
    mesh, _replicas, shard_dims = info
    # rows split over a Shard(0) mesh dim are whole locally; only reduced dims need a sum
    dims = [md for td in reduced_dims for md in shard_dims.get(td, [])]
    if not dims:
        return local, local
    import torch.distributed as dist

    full = local.clone()
    _all_reduce_mesh(full, mesh, dims, dist.ReduceOp.SUM)
    return local, full


class AGCClipper(_Stateless):
    """Unit-wise adaptive gradient clipping, ||G_i|| / max(||W_i||, eps) <= clipping (Brock et al. 2021).

    ``exclude`` holds regexes of parameter names left alone (the paper skips the final
    classifier, e.g. ``exclude=("lm_head",)``). Reads W once and G twice (norms, scaling); the
    global norms before and after come from the unit norms, without another pass.
    """

    def __init__(self, clipping: float = 0.01, eps: float = 1e-3, exclude: Iterable[str] = ()):
        self.clipping = _check_bound("clipping", clipping)
        self.eps = _check_bound("eps", eps)
        self.exclude = [re.compile(p) for p in exclude]

    def __call__(self, parameters) -> ClipStats:
        named = [(n, p) for n, p in named_grads(parameters) if not any(r.search(n) for r in self.exclude)]
        if not named:
            zero = torch.zeros(())
            return ClipStats(zero, zero, zero > 0, torch.ones(()))
        grads = [p.grad for _, p in named]
        device = _local(grads[0]).device
        before_c, after_c, min_scales = [], [], []
        with torch.no_grad():
            for _, p in named:
                w_norm = _unit_sq_norms(p.detach())[1].sqrt()
                g_local_sq, g_sq = _unit_sq_norms(p.grad)
                max_norm = self.clipping * torch.clamp(w_norm, min=self.eps)
                scale = torch.clamp(max_norm / torch.clamp(g_sq.sqrt(), min=_EPS), max=1.0)  # [units]
                g = _local(p.grad)
                g.mul_(scale.reshape((-1,) + (1,) * (g.ndim - 1)).to(g.dtype) if p.ndim >= 2 else scale[0].to(g.dtype))
                info = _placement_info(p.grad)
                replicas = 1 if info is None else info[1]
                # this shard's share of ||G||^2 before / after: rows of the local shard
                before_c.append(g_local_sq.sum().to(device) / replicas)
                after_c.append((g_local_sq * scale.square()).sum().to(device) / replicas)
                min_scales.append(scale.min().to(device) if scale.numel() else torch.ones((), device=device))
        sums = _reduce_groups(torch.stack(before_c + after_c), grads + grads, [0] * len(grads) + [1] * len(grads), 2,
                              inf=False)
        before, after = sums.sqrt().unbind()
        scale = torch.stack(min_scales).min()
        if any(_placement_info(g) is not None for g in grads):
            import torch.distributed as dist

            dist.all_reduce(scale, op=dist.ReduceOp.MIN)  # sharded rows: every rank reports the same
        return ClipStats(before, after, scale < 1.0, scale)


class PerLayerClipper(_Stateless):
    """Clip each layer's gradient norm to its own bound.

    ``rules`` is a sequence of ``(regex, max_norm)``; a parameter takes the first rule whose
    regex matches its name, layers are the parameters' owning modules (name up to the last
    dot). Parameters no rule matches use ``default`` (left alone when ``default`` is None).
    Needs names: pass a module or ``(name, tensor)`` pairs.
    """

    def __init__(self, rules: Iterable[tuple[str, float]], default: float | None = None, norm_type: float = 2.0):
        self.rules = [(re.compile(p), _check_bound(f"max_norm for {p!r}", m)) for p, m in rules]
        if not self.rules and default is None:
            raise ValueError("PerLayerClipper needs at least one rule or a default bound")
        self.default = None if default is None else _check_bound("default", default)
        self.norm_type = _check_norm_type(norm_type)

    def _bound(self, name: str) -> float | None:
        for pattern, bound in self.rules:
            if pattern.search(name):
                return bound
        return self.default

    def __call__(self, parameters) -> ClipStats:
        if not isinstance(parameters, nn.Module):
            parameters = list(parameters)
            if any(isinstance(p, torch.Tensor) for p in parameters):
                raise TypeError("PerLayerClipper matches parameter names: pass a module or (name, tensor) pairs")
        named = named_grads(parameters)
        if not named:
            zero = torch.zeros(())
            return ClipStats(zero, zero, zero > 0, torch.ones(()))
        keys: dict[tuple[str, float], int] = {}
        grads, groups, bounds = [], [], []
        for n, p in named:
            grads.append(p.grad)
            bound = self._bound(n)
            if bound is None:
                groups.append(-1)  # unbounded: assigned to the last group below
                continue
            key = (n.rpartition(".")[0], bound)
            if key not in keys:
                keys[key] = len(keys)
                bounds.append(bound)
            groups.append(keys[key])
        n_b = len(bounds)
        groups = [n_b if k < 0 else k for k in groups]
        inf = math.isinf(self.norm_type)
        # one pass over the gradients for every layer's norm; before/after follow from them
        sums = _reduce_groups(_local_contributions(grads, self.norm_type), grads, groups, n_b + 1, inf)
        norms = sums if inf else sums.pow(1.0 / self.norm_type)  # [n_b + 1], last = unbounded
        scales = torch.ones_like(norms)
        scales[:n_b] = torch.clamp(torch.tensor(bounds, device=norms.device) / (norms[:n_b] + _EPS), max=1.0)
        by_group = defaultdict(list)
        for g, k in zip(grads, groups):
            if k < n_b:
                by_group[k].append(g)
        for k, gs in by_group.items():
            _scale_(gs, scales[k])
        if inf:
            before, after = sums.max(), (sums * scales).max()
        else:
            p = self.norm_type
            before, after = sums.sum().pow(1.0 / p), (sums * scales.pow(p)).sum().pow(1.0 / p)
        scale = scales.min()
        return ClipStats(before, after, scale < 1.0, scale, {"layers_clipped": (scales[:n_b] < 1.0).sum().float()})
