"""``load_checkpoint``: restore either kind of checkpoint, one-process or sharded, into the given objects.

    state = load_checkpoint(root, model=model, optimizer=opt, scheduler=sched, clipper=clip, loader=loader)
    step = state.step

``path`` is a ``step-*`` directory or a root; a root resolves to its newest checkpoint that
passes verification, each newer failing one skipped with a ``CheckpointWarning`` naming it and
why. A step directory given by name is verified and refused (``CheckpointError``) if it fails.

What is read. Only files the checkpoint's marker lists (and verifies): a file copied into a
checkpoint after the save (a stray ``trainable.safetensors``, an extra shard) is ignored, with
a ``CheckpointWarning`` naming it. Every object given must have been saved; objects left
``None`` are not restored; RNG states are restored last, after anything that draws random
numbers while being built. The optimizer is restored through its own ``load_state_dict``: a
``TrainOptimizer``'s precision, fp16 fallback, counters and loss scaler come back as it saved
them (an fp16 run that fell back to bf16/fp32 resumes in the fallback precision).

One-process checkpoints (``Checkpointer``): each process reads the whole state.

Sharded checkpoints (``ftlib.distributed.ShardedCheckpointer``; layout in ``sharded``): under
torch.distributed ``load_checkpoint`` is then collective (call it on every rank with the same
arguments, after sharding the model and building the optimizer): the ranks share the
verification (``verify_shared``) and agree on the checkpoint, and DCP reads, on every rank,
the chunks its shards overlap. From W ranks to W' ranks:

- weights and optimizer state: any W' (one process without torch.distributed loads a sharded
  checkpoint whole; FSDP2, HSDP, DDP and plain modules all load each other's);
- schedule, clipper, loss scaler, optimizer wrapper, counters, metrics, extra: any W';
- the loader position: exact when the global batch (``batch_size * world_size``) is unchanged,
  refused otherwise (the order of the remaining data would differ);
- RNG states: per rank; with W' == W each rank gets its own back (a bit-exact continuation); with
  W' != W rank r gets saved rank r mod W's, with a ``CheckpointWarning``.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._dist import get_rank, get_world_size, is_distributed
from .format import (
    MARKER,
    MODEL_TENSORS,
    OPTIM_TENSORS,
    SERVING_FILES,
    SHARDS,
    STATE_JSON,
    STATE_TENSORS,
    TRAINABLE_TENSORS,
    CheckpointError,
    CheckpointWarning,
    decode,
    read_marker,
    read_state,
    read_tensors,
    set_rng_state,
    step_dirs,
    step_of_name,
)
from .local import lora_config, unwrap
from .sharded import (
    KIND,
    causal_lm,
    listed_shards_reader,
    model_tensors,
    optimizer_parts,
    quiet_single_process,
    rank_file,
    train_optimizer_parts,
)
from .verify import unlisted_files, verify_checkpoint, verify_shared

__all__ = ["Checkpoint", "adapter_config_diff", "load_checkpoint"]

_ADAPTER_FIELDS = ("r", "lora_alpha", "use_rslora", "use_dora", "rank_pattern", "alpha_pattern", "target_modules",
                   "modules_to_save")


@dataclass
class Checkpoint:
    """What ``load_checkpoint`` restored: where from, the step, and the saved metrics and extra."""

    path: Path
    step: int
    metrics: dict
    extra: dict


# ---- which checkpoint ---------------------------------------------------------------------------


def _is_sharded(path: Path) -> bool:
    try:
        return json.loads((path / STATE_JSON).read_text()).get("model_kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False  # verification will say what is wrong with it


def _check(path: Path, full: bool) -> str | None:
    """None if ``path`` passes, else why (collective for a sharded checkpoint under torch.distributed)."""
    if _is_sharded(path) and is_distributed():
        return verify_shared(path, full=full)
    try:
        verify_checkpoint(path, full=full)
    except CheckpointError as e:
        return str(e)
    return None


def _resolve(path: Path, verify: bool) -> Path:
    if (path / MARKER).exists() or step_of_name(path.name) is not None:
        if verify or _is_sharded(path):  # sizes are always checked before DCP reads the shards
            error = _check(path, full=verify)
            if error:
                raise CheckpointError(error)
        return path
    for _, p in reversed(step_dirs(path)):
        error = _check(p, full=True)
        if error is None:
            return p
        if get_rank() == 0:
            warnings.warn(f"skipping checkpoint {p}: {error}; falling back to an earlier one", CheckpointWarning,
                          stacklevel=3)
    raise FileNotFoundError(f"{path}: no complete checkpoint to resume from")


def load_checkpoint(path: str | os.PathLike, *, model: nn.Module | None = None, optimizer=None, scheduler=None,
                    clipper=None, loader=None, scaler=None, rng: bool = True, verify: bool = True) -> Checkpoint:
    """Restore a checkpoint (either kind, see the module doc) into the given objects; return what it held.

    ``path``: a ``step-*`` directory or a root (then the newest good one). ``verify=False`` skips
    the SHA-256 check of a directory given by name. Raises ``CheckpointError`` (or
    FileNotFoundError when a root holds no usable checkpoint) naming the file and what does not fit.
    """
    path = _resolve(Path(path), verify)
    marker = read_marker(path)
    state = read_state(path)
    where = str(path / STATE_JSON)
    stray = [f for f in unlisted_files(path, marker) if f not in SERVING_FILES]  # ftlib's own: no warning
    if stray and get_rank() == 0:
        warnings.warn(f"{path}: {stray} are not listed in the checkpoint's {MARKER} marker (added after the save); "
                      "they are ignored", CheckpointWarning, stacklevel=2)
    listed = set(marker["files"])
    small = read_tensors(path / STATE_TENSORS) if STATE_TENSORS in listed else {}

    def part(name: str) -> Any:
        if name not in state:
            raise CheckpointError(f"{where}: no {name} state was saved, but a {name} was given to restore")
        return decode(state[name], small, where)

    if state.get("model_kind") == KIND:
        _load_sharded(path, state, small, listed, model, optimizer, loader, rng)
    else:
        if model is not None:
            _load_model(unwrap(model), path, state.get("model_kind"), listed)
        if optimizer is not None:
            if "optimizer" not in state or OPTIM_TENSORS not in listed:
                raise CheckpointError(f"{where}: no optimizer state was saved")
            optim_tensors = read_tensors(path / OPTIM_TENSORS)
            try:
                optimizer.load_state_dict(decode(state["optimizer"], optim_tensors, where))
            except (ValueError, KeyError, RuntimeError) as e:
                raise CheckpointError(f"{path / OPTIM_TENSORS}: optimizer state does not fit: {e}") from None
    for name, obj in (("scheduler", scheduler), ("clipper", clipper), ("scaler", scaler)) + (
            () if state.get("model_kind") == KIND else (("loader", loader),)):
        if obj is not None:
            try:
                obj.load_state_dict(part(name))
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{where}: {name} state does not fit: {e}") from None
    if rng and state.get("model_kind") != KIND:
        if "rng" not in state:
            raise CheckpointError(f"{where}: no RNG state was saved (saved with rng=False); pass rng=False")
        set_rng_state(decode(state["rng"], small, where), where)
    elif rng:
        _load_rank_rng(path, state)
    return Checkpoint(path=path, step=int(state["step"]), metrics=decode(state.get("metrics", {}), None, where),
                      extra=decode(state.get("extra", {}), small, where))


# ---- the adapter's config ----------------------------------------------------------------------


def adapter_config_diff(path: Path, model: nn.Module) -> list[str]:
    """``["r 4 -> 8", ...]``: each adapter setting that differs between ``path``'s adapter_config.json
    (saved) and ``model``'s adapters (now); empty when they agree or either is absent."""
    from ..lora.peft_io import ADAPTER_CONFIG

    cfg = lora_config(model)
    f = path / ADAPTER_CONFIG
    if cfg is None or not f.is_file():
        return []
    try:
        saved = json.loads(f.read_text())
    except (OSError, ValueError):
        return []
    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else sorted(set(cfg.target_modules))
    now = cfg.to_peft_dict(targets)
    return [f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in _ADAPTER_FIELDS if saved.get(k) != now.get(k)]


# ---- one-process checkpoints --------------------------------------------------------------------


def _load_model(model: nn.Module, path: Path, kind: str | None, listed: set[str]) -> None:
    has_lora = lora_config(model) is not None
    if kind == "lora":
        from ..lora import load_adapter
        from ..lora.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS

        if not has_lora:
            raise CheckpointError(f"{path}: holds a LoRA adapter but the model has none; apply_lora with the "
                                  "run's config first (or load the adapter alone with ftlib.lora.load_adapter)")
        if not {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= listed:
            raise CheckpointError(f"{path}: its marker lists no adapter ({ADAPTER_CONFIG}, {ADAPTER_WEIGHTS})")
        diff = adapter_config_diff(path, model)
        if diff:
            raise CheckpointError(f"{path / ADAPTER_CONFIG}: the adapter does not fit the model: "
                                  f"{', '.join(diff)} (saved -> this model's)")
        try:
            load_adapter(model, path, check_base=False)
        except (ValueError, RuntimeError, FileNotFoundError) as e:
            raise CheckpointError(f"{path}: adapter does not fit the model: {e}") from None
        if TRAINABLE_TENSORS in listed:
            extra = read_tensors(path / TRAINABLE_TENSORS)
            params = dict(model.named_parameters())
            missing = sorted(set(extra) - set(params))
            if missing:
                raise CheckpointError(f"{path / TRAINABLE_TENSORS}: parameters the model lacks: {missing[:5]}")
            with torch.no_grad():
                for k, t in extra.items():
                    if params[k].shape != t.shape:
                        raise CheckpointError(f"{path / TRAINABLE_TENSORS}: {k} has shape {tuple(t.shape)}, the "
                                              f"model's is {tuple(params[k].shape)}")
                    params[k].copy_(t)
        return
    if has_lora:
        raise CheckpointError(f"{path}: holds a full fine-tuning checkpoint but the model has LoRA adapters")
    if MODEL_TENSORS not in listed:
        raise CheckpointError(f"{path}: its marker lists no {MODEL_TENSORS}")
    tensors = read_tensors(path / MODEL_TENSORS)
    own = model.state_dict(keep_vars=True)
    unexpected = sorted(set(tensors) - set(own))
    missing = [k for k in own if k not in tensors and not any(own[k] is own[j] for j in tensors if j in own)]
    if unexpected or missing:
        raise CheckpointError(f"{path / MODEL_TENSORS}: does not fit the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for k, t in tensors.items():
            if own[k].shape != t.shape:
                raise CheckpointError(f"{path / MODEL_TENSORS}: {k} has shape {tuple(t.shape)}, the model's is "
                                      f"{tuple(own[k].shape)}")
            own[k].copy_(t)


# ---- sharded checkpoints ------------------------------------------------------------------------


def _check_fit(where: str, saved: dict, have: dict[str, torch.Tensor], what: str, note: str = "") -> None:
    missing = sorted(set(have) - set(saved))
    unexpected = sorted(set(saved) - set(have))
    if missing or unexpected:
        raise CheckpointError(f"{where}: the {what} does not fit: the checkpoint lacks {missing[:5]}, holds "
                              f"{unexpected[:5]} the {what} has not{note}")
    for k, t in have.items():
        if list(t.shape) != saved[k]["shape"]:
            raise CheckpointError(f"{where}: {k} has shape {saved[k]['shape']} in the checkpoint, "
                                  f"{list(t.shape)} here{note}")


def _loader_state(state: dict, loader, where: str) -> dict:
    """The saved loader state, re-addressed to this loader's rank and world size when the global batch is the same."""
    s = dict(state)
    if (s.get("world_size"), s.get("rank"), s.get("batch_size")) != (loader.world_size, loader.rank, loader.batch_size):
        saved_global = s.get("batch_size", 0) * s.get("world_size", 0)
        if saved_global != loader.batch_size * loader.world_size:
            raise CheckpointError(
                f"{where}: the loader was saved with batch_size {s.get('batch_size')} x world_size "
                f"{s.get('world_size')} = {saved_global} units per step, this one takes {loader.batch_size} x "
                f"{loader.world_size}; exact resume on another world size needs the same global batch")
        s.update(world_size=loader.world_size, rank=loader.rank, batch_size=loader.batch_size)
    return s


def _load_sharded(path: Path, state: dict, small: dict, listed: set[str], model, optimizer, loader, rng) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    where = str(path / STATE_JSON)
    saved = state["tensors"]
    flat: dict[str, torch.Tensor] = {}
    if optimizer is not None and model is None:
        raise ValueError("load_checkpoint: restoring the optimizer of a sharded checkpoint needs the model too (its "
                         "state is keyed by parameter name)")
    if model is not None:
        kind, weights, prefix = model_tensors(model)
        if kind != state["weights"]:
            raise CheckpointError(f"{where}: holds {state['weights']} weights, the model is a "
                                  f"{'LoRA' if kind == 'adapter' else 'full fine-tuning'} model")
        diff = adapter_config_diff(path, causal_lm(model)[0]) if kind == "adapter" else []
        note = f" (adapter settings saved -> this model's: {', '.join(diff)})" if diff else ""
        _check_fit(where, {k[6:]: v for k, v in saved.items() if k.startswith("model.")}, weights, "model", note)
        flat.update({f"model.{k}": v for k, v in weights.items()})
    if optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointError(f"{where}: no optimizer state was saved")
        inner, _ = train_optimizer_parts(optimizer)
        ostate, groups = optimizer_parts(model, inner, prefix)
        saved_groups = decode(state["optimizer"]["param_groups"], small, where)
        if [g["params"] for g in saved_groups] != [g["params"] for g in groups]:
            raise CheckpointError(f"{where}: the optimizer's parameter groups differ from the saved ones "
                                  f"({[len(g['params']) for g in saved_groups]} vs {[len(g['params']) for g in groups]} "
                                  "parameters per group)")
        wrapper = decode(state["optimizer"].get("wrapper"), small, where)
        if inner is not optimizer:  # a TrainOptimizer: its own load_state_dict checks and restores its state
            if wrapper is None:
                raise CheckpointError(f"{where}: saved from a plain torch optimizer, restored into a TrainOptimizer")
            try:  # before the inner state is touched; the inner optimizer's tensors follow through DCP
                optimizer.load_state_dict({**wrapper, "optimizer": inner.state_dict()})
            except (ValueError, KeyError, RuntimeError) as e:
                raise CheckpointError(f"{where}: optimizer state does not fit: {e}") from None
        structure = state["optimizer"]["state"]
        have = {f"optim.{fqn}.{key}": v for fqn, e in ostate.items() for key, v in e.items()
                if isinstance(v, torch.Tensor)}
        _check_fit(where, {k: v for k, v in saved.items() if k.startswith("optim.")}, have, "optimizer")
        flat.update(have)
    if flat:
        shards = {name.split("/", 1)[1] for name in listed if name.startswith(f"{SHARDS}/")}
        on = is_distributed()
        try:
            with quiet_single_process(on):
                dcp.load(flat, storage_reader=listed_shards_reader(str(path / SHARDS), shards), no_dist=not on)
        except Exception as e:  # noqa: BLE001 -- DCP raises CheckpointException and friends
            raise CheckpointError(f"{path / SHARDS}: could not read the shards: {e}") from None
    if model is not None:
        set_model_state_dict(model, {prefix + k[6:]: v for k, v in flat.items() if k.startswith("model.")},
                             options=StateDictOptions(strict=False))
    if optimizer is not None:
        new_state: dict[str, dict] = {}
        for fqn, entries in structure.items():
            new_state[prefix + fqn] = {key: (flat[v["__dcp__"]] if isinstance(v, dict) and "__dcp__" in v
                                             else decode(v, small, where)) for key, v in entries.items()}
        new_groups = []
        for g_saved, g_now in zip(saved_groups, groups):
            g = dict(g_saved, params=[prefix + k for k in g_now["params"]])
            if "param_names" in g_now:
                g["param_names"] = g_now["param_names"]
            new_groups.append(g)
        set_optimizer_state_dict(model, inner, {"state": new_state, "param_groups": new_groups})
    if loader is not None:
        per_rank, rsmall, rfile = _rank_part(path, state)
        if "loader" not in per_rank:
            raise CheckpointError(f"{rfile}: no loader state was saved, but a loader was given to restore")
        try:
            loader.load_state_dict(_loader_state(decode(per_rank["loader"], rsmall, str(rfile)), loader, str(rfile)))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{rfile}: loader state does not fit: {e}") from None


def _rank_part(path: Path, state: dict) -> tuple[dict, dict, Path]:
    """(this rank's saved JSON part, its tensors, the JSON file): saved rank r mod W for rank r of W'."""
    src = get_rank() % int(state["world_size"])
    rfile = path / rank_file(src, "json")
    try:
        per_rank = json.loads(rfile.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{rfile}: unreadable ({e})") from None
    return per_rank, read_tensors(path / rank_file(src, "safetensors")), rfile


def _load_rank_rng(path: Path, state: dict) -> None:
    per_rank, rsmall, rfile = _rank_part(path, state)
    if "rng" not in per_rank:
        raise CheckpointError(f"{rfile}: no RNG state was saved (saved with rng=False); pass rng=False")
    saved_world, world = int(state["world_size"]), get_world_size()
    if saved_world != world and get_rank() == 0:
        warnings.warn(f"{path}: saved by {saved_world} ranks, restored on {world}: rank r takes the "
                      f"RNG states of saved rank r mod {saved_world}, so random streams (dropout) are not "
                      f"those of a {saved_world}-rank continuation", CheckpointWarning, stacklevel=3)
    set_rng_state(decode(per_rank["rng"], rsmall, str(rfile)), str(rfile))
