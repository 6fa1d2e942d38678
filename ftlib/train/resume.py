"""Resume a whole train state from the newest good checkpoint, with one rule for changed settings.

    settings = {"lr": args.lr, "clip": args.clip, "lora_r": args.lora_r, ...}   # what defines the run
    resumed = resume_train_state(out / "checkpoints", resume=args.resume, settings=settings,
                                 overrides=args.override, fixed=FIXED, seed=args.seed, plan=plan,
                                 model=model, optimizer=opt, scheduler=sched, clipper=clipper, loader=loader)
    step = resumed.step
    ...
    ckpt.save(step, ..., extra={**run_extra(settings, loader), "tokens_seen": n})

What is restored. The trainable weights, the optimizer's state (moments, counters, loss scaler),
the schedule's progress, the clipper's state, the loader's position and the RNG states, through
``ftlib.checkpoint.load_checkpoint`` (one loader for one-process and sharded checkpoints). The hyperparameters are the
ones this process built from its settings: after the load, every optimizer param group gets back
its freshly built values (weight decay, betas, ...) and the scheduler its freshly built base LRs.
The settings check below makes them equal to the checkpoint's unless a setting was overridden,
so an override takes effect at once and entirely (``--override lr`` sets the new base LR; it is
not silently lost to the checkpoint's).

Changed settings: one rule. The checkpoint records the settings of the run that wrote it
(``run_extra``). A resume compares them with the settings given now and refuses any difference,
naming each changed setting ``old -> new``, unless ``overrides`` names it; a setting in ``fixed``
cannot be overridden (the saved state would not fit it or would mean something else: adapter
rank, target modules, sequence length, seed, the data itself). Overridden changes are returned in
``Resumed.overrides`` (``{name: (old, new)}``) for the run manifest. A checkpoint without
recorded settings (written by an older ftlib) is resumed with a warning that nothing was compared.

Data position across world sizes. A checkpoint records its loader position as ``(epoch, step)``
at ``batch_size x world_size`` units per micro-batch step, i.e. ``k = step x batch_size x
world_size`` units of the epoch's order consumed (the order is a permutation of the units drawn
from ``(seed, epoch)``, the same for every world size). An optimizer step takes ``U = batch_size
x world_size x grad_accum`` units. When a run resumes with another world size, batch size or
accumulation but the same ``U``, the step plan (``ftlib.train.plan``: steps per epoch
``floor(N / U)``) and the schedule are unchanged and ``k`` is a whole number of the new
micro-batch steps, so the loader is re-addressed to ``k / (batch_size' x world_size')`` and every
later optimizer step sums over exactly the units it would have without the interruption. A
different ``U`` would change the plan and the schedule: refused, naming both world sizes and the
accumulation that keeps ``U``: that advice works on any engine, so a sharded (``--engine fsdp``)
checkpoint resumes on one process too (loaded whole, the data position re-planned), and a
one-process or DDP checkpoint is refused under a sharded run. Ranks whose RNG state the checkpoint does not hold (a one-process
checkpoint on several ranks: it holds rank 0's) are reseeded from ``(seed, rank, step)``, with a
note: dropout masks then differ from an uninterrupted run's.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._dist import get_rank, get_world_size
from ..checkpoint import latest_checkpoint, load_checkpoint
from ..checkpoint.format import CheckpointWarning, read_state
from ..checkpoint.sharded import KIND as SHARDED_KIND
from .plan import StepPlan
from .seed import seed_everything

__all__ = ["ResumeError", "Resumed", "compare_settings", "replan_loader_state", "resume_train_state", "run_extra",
           "run_settings"]

RUN_KEY = "run"  # the checkpoint's extra entry written by run_extra
# settings of earlier ftlib versions that the checkpoint itself now answers (its layout is read from it)
NOT_COMPARED = ("checkpoint_layout",)


class ResumeError(ValueError):
    """A checkpoint cannot continue this run as configured; the message says what differs and what to do."""


@dataclass
class Resumed:
    """What ``resume_train_state`` restored: ``path`` None for a fresh start (step 0)."""

    step: int = 0
    path: Path | None = None
    extra: dict = field(default_factory=dict)
    overrides: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    saved_world_size: int | None = None
    rng_restored: bool = False


def run_extra(settings: Mapping[str, Any], loader) -> dict:
    """The entry to merge into every checkpoint's ``extra``: the run's settings and its batch geometry."""
    return {RUN_KEY: {"settings": dict(settings), "world_size": int(loader.world_size),
                      "batch_size": int(loader.batch_size)}}


def run_settings(values: Mapping[str, Any], names: Iterable[str], *, out: str | os.PathLike | None = None) -> dict:
    """The settings ``names`` of ``values`` (e.g. ``vars(args)``) as a resume compares them: a path
    inside the run's folder ``out`` is written ``<out>/relative/path``, so a run folder that was
    moved or copied resumes (its demo model, its caches) without a spurious change."""
    root = Path(out).resolve() if out is not None else None
    settings = {}
    for k in names:
        v = values.get(k)
        if root is not None and isinstance(v, (str, os.PathLike)) and str(v) and (p := Path(v)).exists():
            try:
                v = "<out>/" + p.resolve().relative_to(root).as_posix()
            except ValueError:
                v = str(v)
        settings[k] = v
    return settings


def _fmt(v: Any) -> str:
    return "<unset>" if v is _MISSING else repr(v)


_MISSING = object()


def compare_settings(saved: Mapping[str, Any], current: Mapping[str, Any], *, overrides: Iterable[str] = (),
                     fixed: Iterable[str] = (), where: str = "checkpoint",
                     added: Mapping[str, Any] | None = None) -> dict[str, tuple[Any, Any]]:
    """The changed settings this run takes, ``{name: (old, new)}``; ``ResumeError`` naming every
    change that ``overrides`` does not name, every override of a ``fixed`` setting and every
    override that names no setting. ``added``: settings newer than some saved runs, with the value
    a run that predates them had (a checkpoint without the key counts as that value, not a change)."""
    overrides, fixed = set(overrides), set(fixed)
    saved = {**{k: v for k, v in (added or {}).items() if k not in saved}, **saved}
    unknown = sorted(overrides - set(current))
    if unknown:
        raise ResumeError(f"cannot override {', '.join(unknown)}: not a setting of this run "
                          f"(settings: {', '.join(sorted(current))})")
    changed = {k: (saved.get(k, _MISSING), current.get(k, _MISSING)) for k in sorted(set(saved) | set(current))
               if saved.get(k, _MISSING) != current.get(k, _MISSING)}
    refused = [k for k in changed if k not in overrides or k in fixed]
    bad_fixed = sorted(overrides & fixed & set(changed))
    if refused:
        lines = [f"  {k}: {_fmt(changed[k][0])} -> {_fmt(changed[k][1])}"
                 + (" (cannot be overridden: the saved state depends on it)" if k in fixed else "") for k in refused]
        hint = [k for k in refused if k not in fixed]
        msg = (f"{where} was saved by a run with other settings; resuming would mix old and new:\n"
               + "\n".join(lines))
        if hint:
            msg += (f"\nPass the old values to continue the run as it was, or override {', '.join(hint)} to take "
                    f"the new values from here on (--override {','.join(hint)})")
        if bad_fixed:
            msg += f"\n{', '.join(bad_fixed)} cannot be overridden: start a new run (another output folder)"
        raise ResumeError(msg)
    return {k: changed[k] for k in changed}


def replan_loader_state(saved: Mapping[str, Any], loader) -> dict:
    """``saved`` (a loader ``state_dict()``, possibly of another rank, world size or batch size)
    re-addressed to ``loader``: the same units consumed, counted in ``loader``'s micro-batch steps.
    ``ResumeError`` when that is not a whole number of steps (or the order depends on the batch)."""
    need = ("epoch", "step", "batch_size", "world_size")
    missing = [k for k in need if k not in saved]
    if missing:
        raise ResumeError(f"loader state lacks {missing}: cannot place the data position")
    state = dict(saved)
    old_g = int(saved["batch_size"]) * int(saved["world_size"])
    new_g = int(loader.batch_size) * int(loader.world_size)
    if old_g != new_g:
        if saved.get("group_by_length") or getattr(loader, "group_by_length", False):
            raise ResumeError(f"length-grouped batches depend on the global batch: saved {saved['batch_size']} x "
                              f"{saved['world_size']} ranks, now {loader.batch_size} x {loader.world_size}")
        units = int(saved["step"]) * old_g
        if units % new_g:
            raise ResumeError(
                f"the saved data position ({units} units of epoch {saved['epoch']} consumed at {saved['batch_size']} "
                f"x {saved['world_size']} ranks) is not a whole number of micro-batch steps of {loader.batch_size} x "
                f"{loader.world_size} ranks")
        state["step"] = units // new_g
    state.update(batch_size=loader.batch_size, world_size=loader.world_size)
    if "rank" in state:
        state["rank"] = loader.rank
    return state


class _Replanned:
    """Passed to the checkpoint loader as the loader: re-addresses the saved position, then loads it.
    It shows the sharded loader the saved geometry (``world_size``, ``batch_size``, this rank's
    saved rank), so the position comes through as saved and is re-planned here."""

    def __init__(self, loader, world_size: int | None = None, batch_size: int | None = None):
        self.loader = loader
        self.saved: dict | None = None
        self.world_size = int(world_size or loader.world_size)
        self.batch_size = int(batch_size or loader.batch_size)
        self.rank = get_rank() % self.world_size

    def load_state_dict(self, state: dict) -> None:
        self.saved = dict(state)
        self.loader.load_state_dict(replan_loader_state(state, self.loader))


def _fresh_hparams(scheduler, optimizer) -> tuple[list[float] | None, list[dict] | None]:
    groups = None
    torch_opt = getattr(scheduler, "optimizer", None) or getattr(optimizer, "optimizer", optimizer)
    if torch_opt is not None and hasattr(torch_opt, "param_groups"):
        groups = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in torch_opt.param_groups]
    base = list(scheduler.base_lrs) if scheduler is not None and hasattr(scheduler, "base_lrs") else None
    return base, groups


def _restore_hparams(scheduler, optimizer, base, groups) -> None:
    torch_opt = getattr(scheduler, "optimizer", None) or getattr(optimizer, "optimizer", optimizer)
    if groups is not None:
        for g, fresh in zip(torch_opt.param_groups, groups):
            g.update(fresh)
    if base is not None:
        scheduler.load_state_dict({**scheduler.state_dict(), "base_lrs": base})  # sets every group's lr


def resume_train_state(root: str | os.PathLike, *, resume: bool, settings: Mapping[str, Any],
                       model, optimizer=None, scheduler=None, clipper=None, loader=None,
                       overrides: Iterable[str] = (), fixed: Iterable[str] = (),
                       added: Mapping[str, Any] | None = None, plan: StepPlan | None = None, seed: int = 0, sharded: bool = False,
                       log: Callable[[str], Any] = print) -> Resumed:
    """Restore the newest good checkpoint under ``root`` into the given objects (see the module doc).

    ``resume=False``: a fresh start; ``ResumeError`` when ``root`` already holds checkpoints (a
    used output folder is never trained over silently). ``resume=True`` without a checkpoint:
    a fresh start, logged. ``model`` is the module the checkpoint was saved from (for
    ``sharded=True`` the sharded one). ``settings`` holds ``batch_size`` and ``grad_accum`` (the
    batch geometry, checked as the global batch) beside the rest. ``plan``: checks that the loader
    position matches the step. Every rank calls it under torch.distributed.
    """
    root = Path(root)
    existing = latest_checkpoint(root, full=False)
    if not resume:
        if existing is not None:
            raise ResumeError(f"{root} holds checkpoints of an earlier run (newest: {existing.name}): pass --resume "
                              "to continue it, or choose another output folder")
        return Resumed()
    if existing is None:
        log(f"--resume: no checkpoint in {root}, starting from step 0")
        return Resumed()
    rank = get_rank()
    world = int(loader.world_size) if loader is not None else get_world_size()
    load = load_checkpoint  # one loader for both kinds
    if sharded:
        path = existing
    else:
        path = latest_checkpoint(root)  # verified; warns about and skips incomplete or corrupt ones
        if path is None:
            raise ResumeError(f"{root}: no complete checkpoint to resume from (every one failed verification)")

    # 1. the settings and batch geometry the checkpoint was written with, before anything is loaded
    saved_sharded = read_state(path).get("model_kind") == SHARDED_KIND
    if sharded and not saved_sharded:
        raise ResumeError(f"{path} was saved by one process or DDP, not sharded: a sharded run (--engine fsdp) "
                          "cannot continue it; resume it on one process or with --engine ddp")
    with warnings.catch_warnings():  # the state file alone; the full load below verifies (and warns once)
        warnings.simplefilter("ignore", CheckpointWarning)
        head = load(path, rng=False, verify=False)
    saved_run = head.extra.get(RUN_KEY) or {}
    overrides_taken: dict[str, tuple[Any, Any]] = {}
    saved_world = saved_run.get("world_size")
    if not saved_run:
        warnings.warn(f"{path}: the checkpoint records no run settings (saved by an older ftlib); the settings of "
                      "this run were not compared with the saved run's", stacklevel=2)
    else:
        saved_settings = {k: v for k, v in saved_run.get("settings", {}).items() if k not in NOT_COMPARED}
        settings = {k: v for k, v in settings.items() if k not in NOT_COMPARED}
        geometry = ("batch_size", "grad_accum")
        old_u = saved_settings.get("batch_size", 0) * saved_settings.get("grad_accum", 0) * saved_world
        new_u = settings.get("batch_size", 0) * settings.get("grad_accum", 0) * world
        if old_u != new_u:
            keep = old_u / (settings.get("batch_size", 1) * world)
            hint = (f"grad_accum {int(keep)} keeps it (--grad-accum {int(keep)}): the run continues with the same "
                    "data in every step and the same schedule"
                    if keep == int(keep) and keep >= 1 else "no grad_accum keeps it at this batch size and world size")
            raise ResumeError(
                f"{path} was saved on {saved_world} rank(s) with {old_u} units per optimizer step (batch_size "
                f"{saved_settings.get('batch_size')} x grad_accum {saved_settings.get('grad_accum')} x {saved_world} "
                f"ranks); this run has {world} rank(s) and {new_u} (batch_size {settings.get('batch_size')} x "
                f"grad_accum {settings.get('grad_accum')} x {world}): the step plan and the schedule would change. "
                f"The global batch must stay: {hint}")
        overrides_taken = compare_settings({k: v for k, v in saved_settings.items() if k not in geometry},
                                           {k: v for k, v in settings.items() if k not in geometry},
                                           overrides=overrides, fixed=fixed, where=str(path), added=added)
    # 2. the state: the optimizer and schedule hyperparameters stay the ones built from the settings
    base, groups = _fresh_hparams(scheduler, optimizer)
    same_world = saved_world in (None, world) and world == 1
    if sharded:
        state = load(path, model=model, optimizer=optimizer, scheduler=scheduler, clipper=clipper, loader=loader)
        rng_restored = True
    else:
        proxy = (_Replanned(loader, saved_world, saved_run.get("batch_size")) if loader is not None else None)
        state = load(path, model=model, optimizer=optimizer, scheduler=scheduler, clipper=clipper, loader=proxy,
                     rng=same_world, verify=False)
        rng_restored = same_world
        if not rng_restored:
            seed_everything(seed + rank + 1_000_003 * state.step)
            log(f"note: {path} holds one process's RNG state and this run has {world} ranks: the weights, "
                "optimizer, schedule and data position are restored, the RNG streams (dropout) restart from a "
                "seed, so the run is not bitwise the same as an uninterrupted one")
    _restore_hparams(scheduler, optimizer, base, groups)
    if plan is not None and loader is not None:
        epoch, consumed = plan.position(state.step)
        if consumed and (loader.epoch, loader.step) != (epoch, consumed):
            raise ResumeError(f"{path}: loader position (epoch {loader.epoch}, batch {loader.step}) does not match "
                              f"step {state.step} (epoch {epoch}, batch {consumed})")
    if saved_world is not None and saved_world != world:
        log(f"re-planned the data position from {saved_world} rank(s) to {world}")
    for k, (old, new) in overrides_taken.items():
        log(f"override: {k} {_fmt(old)} -> {_fmt(new)}")
    log(f"resumed from {state.path} (step {state.step})")
    return Resumed(step=state.step, path=Path(state.path), extra=dict(state.extra), overrides=overrides_taken,
                   saved_world_size=saved_world, rng_restored=rng_restored)
