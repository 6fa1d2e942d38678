"""Sharded train-state checkpoints through ``torch.distributed.checkpoint``: every rank writes its own shards.

The layout, marker, rotation, verification and fallback are those of ``ftlib.checkpoint`` (a
``ShardedCheckpointer`` is a ``Checkpointer``; ``latest_checkpoint``, ``list_checkpoints``,
``best_checkpoint`` and ``verify_checkpoint`` read both kinds); only the weights and optimizer
state are split by rank. ``<root>/step-00001200/``:

    shards/shard-00001-model-00001-of-00001.safetensors   rank 0's chunks (torch DCP, safetensors: each
    shards/shard-00002-model-00001-of-00001.safetensors   tensor's local chunk, its offsets in the header)
    adapter_config.json        LoRA runs: the whole adapter in PEFT's format (gathered by rank 0), so
    adapter_model.safetensors  a sharded checkpoint is also an adapter ``load_adapter`` and peft load
    state.json                 rank 0: step, world size, every saved tensor's global shape, optimizer
    state.safetensors          hyper-parameters, schedule, clipper (z-score EMA), loss scaler, metrics, extra
    rank-00000.json            per rank: the loader's position and the Python/NumPy RNG states,
    rank-00000.safetensors     and the torch CPU/CUDA RNG states
    COMPLETE                   written last by rank 0: the byte size and SHA-256 of every other file

What goes into the shards: the trainable parameters (LoRA runs: adapters and ``modules_to_save``;
full fine-tuning: every weight) under the names inside the causal LM (Hugging Face names, the
same whatever wraps the model: FSDP root, DDP, a loss module), and every tensor of the
optimizer's state (``get_optimizer_state_dict``: keyed by parameter name, not position). All in
safetensors with JSON beside it: DCP's default ``.metadata`` file is a pickle, so the
safetensors storage (``HuggingFaceStorageWriter`` / ``Reader``) is used, whose chunk offsets
live in each file's JSON header.

Atomicity. Ranks write into ``<root>/.tmp-step-00001200-<pid of rank 0>-<n>/``; each rank hashes
the files it wrote, rank 0 gathers the records, checks that no shard file is unaccounted for,
writes its own files and the marker, renames the directory to ``step-00001200``, rotates and
tells every rank the outcome. Any rank's failure fails the save on every rank (no marker). A
shared file system is assumed (as DCP does).

Background saves. ``save`` snapshots every tensor to CPU memory before it returns (DCP's
``async_save`` with a blocking stager: pinned buffers on CUDA, reused between saves) and
serialises the rest; ``torch``'s async executor writes the shards and a thread of ours then
hashes and finalises. Both talk over a gloo process group of their own, created by the
constructor (collectively: every rank builds the checkpointer at the same point), so they never
interleave with the training collectives. At most one save is in flight: the next ``save``,
``wait()`` and ``close()`` join it on every rank and raise its error. Call ``close()`` before
``destroy_process_group``.

Resume and resharding (``load_sharded_checkpoint``), from W ranks to W' ranks:

- weights and optimizer state: any W' (DCP reads the chunks each new shard overlaps; one process
  without torch.distributed loads a sharded checkpoint whole; FSDP2, HSDP, DDP and plain modules
  all load each other's);
- schedule, clipper, loss scaler, counters, metrics, extra: any W' (the same on every rank);
- the loader position: exact when the global batch (``batch_size * world_size``) is unchanged,
  refused otherwise (the order of the remaining data would differ);
- RNG states: per rank; with W' == W each rank gets its own back (a bit-exact continuation); with
  W' != W rank r gets saved rank r mod W's, with a ``CheckpointWarning`` (dropout masks then
  differ from a W-rank continuation).

Verification when loading is shared out: each rank hashes every W-th file of the marker, and the
ranks agree on the verdict; a failed newest checkpoint falls back to the previous good one on
every rank together.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import (
    _STEP_RE,
    FORMAT,
    MARKER,
    STATE_JSON,
    STATE_TENSORS,
    VERSION,
    Checkpoint,
    Checkpointer,
    CheckpointError,
    CheckpointWarning,
    _decode,
    _encode,
    _fsync_dir,
    _lora_config,
    _plain_metrics,
    _read_marker,
    _read_tensors,
    _rng_state,
    _set_rng_state,
    _sha256_file,
    _step_dirs,
    _write_bytes,
    _write_safetensors,
    step_dir_name,
)

__all__ = ["SHARDS", "ShardedCheckpointer", "load_sharded_checkpoint", "save_sharded_checkpoint"]

SHARDS = "shards"
KIND = "sharded"


@contextlib.contextmanager
def _quiet_single_process(on: bool):
    """DCP warns on every call without torch.distributed that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        if not on:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _rank_name(rank: int, ext: str) -> str:
    return f"rank-{rank:05d}.{ext}"


# ---- small collectives over JSON (no pickle on the wire either) ---------------------------------


class _Comm:
    """Rank, world and JSON all-gather over ``group`` (the default group when None); trivial without dist."""

    def __init__(self, group=None):
        self.on = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.on else 0
        self.world = dist.get_world_size(group) if self.on else 1
        backend = dist.get_backend(group) if self.on else "gloo"
        self.device = torch.device("cuda", torch.cuda.current_device()) if (
            "nccl" in backend and "gloo" not in backend) else torch.device("cpu")

    def all_gather_json(self, obj: Any) -> list:
        if self.world == 1:
            return [json.loads(json.dumps(obj))]
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(self.device)
        n = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        dist.all_gather(sizes, n, group=self.group)
        longest = max(int(s) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        buf[: data.numel()] = data
        outs = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(outs, buf, group=self.group)
        return [json.loads(bytes(o[: int(s)].cpu().numpy())) for o, s in zip(outs, sizes)]

    def from_rank0(self, obj: Any) -> Any:
        return self.all_gather_json(obj)[0]


# ---- what is saved ----------------------------------------------------------------------------


def _plain_module(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _causal_lm(model: nn.Module) -> tuple[nn.Module, str]:
    """(the causal LM inside ``model``, its name prefix): the first module with an HF config."""
    for name, mod in _plain_module(model).named_modules():
        if hasattr(getattr(mod, "config", None), "to_hf_dict"):
            return mod, (name + "." if name else "")
    return _plain_module(model), ""


def _strip(key: str, prefix: str) -> str:
    return key[len(prefix):] if prefix and key.startswith(prefix) else key


def _is_train_optimizer(opt) -> bool:
    return hasattr(opt, "optimizer") and hasattr(opt, "prepare_grads")


def _meta(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _model_tensors(model: nn.Module) -> tuple[str, dict[str, torch.Tensor], str]:
    """(weights kind, {canonical name: tensor (DTensor when sharded)}, prefix of the causal LM)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    lm, prefix = _causal_lm(model)
    lora = _lora_config(lm) is not None
    sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=lora))
    return ("adapter" if lora else "full"), {_strip(k, prefix): v for k, v in sd.items()}, prefix


def _optimizer_parts(model: nn.Module, optimizer, prefix: str):
    """(torch optimizer, {canonical fqn: {key: value}}, param groups with canonical names)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    inner = optimizer.optimizer if _is_train_optimizer(optimizer) else optimizer
    osd = get_optimizer_state_dict(model, inner)
    state = {_strip(k, prefix): v for k, v in osd["state"].items()}
    groups = [dict(g, params=[_strip(k, prefix) for k in g["params"]]) for g in osd["param_groups"]]
    return inner, state, groups


def _wrapper_state(optimizer) -> dict | None:
    if not _is_train_optimizer(optimizer):
        return None
    return {"precision": optimizer.precision, "steps": optimizer.steps, "skipped_steps": optimizer.skipped_steps,
            "scaler": None if optimizer.scaler is None else optimizer.scaler.state_dict()}


@dataclass
class _ShardJob:
    step: int
    final: Path
    tmp: Path
    future: Any  # DCP's Future (background) or None (written already)
    rank_tensors: dict[str, torch.Tensor]
    rank_text: str
    texts: dict[str, str]  # rank 0: file -> JSON text
    tensors: dict[str, dict[str, torch.Tensor]]  # rank 0: file -> CPU tensors
    metrics: dict
    presaved: list = field(default_factory=list)  # rank 0: files already written into tmp


class ShardedCheckpointer(Checkpointer):
    """A ``Checkpointer`` for sharded (FSDP2/HSDP) or replicated (DDP) models: every rank saves its part.

    Build it on every rank at the same point (it creates a process group); call ``save``,
    ``wait`` and ``close`` on every rank. Arguments as ``ftlib.checkpoint.Checkpointer``;
    ``model`` in ``save`` is what the loop trains (the FSDP2 root, the DDP wrapper or the plain
    module) and ``optimizer`` a ``TrainOptimizer`` or a ``torch.optim`` optimizer over its
    parameters. Works in one process without torch.distributed too (then it writes one shard).
    """

    def __init__(self, root: str | os.PathLike, *, keep: int | None = 3, metric: str | None = None,
                 mode: str = "min", background: bool = True):
        on = dist.is_available() and dist.is_initialized()
        # a gloo group of our own: background writes never share a communicator with training
        self._group = dist.new_group(backend="gloo") if on else None
        self._comm = _Comm(self._group)
        self._pid0 = int(self._comm.from_rank0(os.getpid()))
        self._stager, self._stager_keys = None, None
        super().__init__(root, keep=keep, metric=metric, mode=mode, background=background)
        if background:
            self._stager = self._new_stager()

    @staticmethod
    def _new_stager():
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        # pinned host buffers, reused from one save to the next (pinning needs CUDA)
        return BlockingAsyncStager(cache_staged_state_dict=torch.cuda.is_available())

    # -- public ---------------------------------------------------------------------------------

    def save(self, step: int, *, model: nn.Module, optimizer=None, scheduler=None, clipper=None, loader=None,
             scaler=None, rng: bool = True, metrics: dict | None = None, extra: dict | None = None,
             base_model_name_or_path: str | None = None) -> Path:
        """Snapshot the train state at ``step`` on every rank; write it to ``<root>/step-XXXXXXXX``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        final = self.root / step_dir_name(step)
        self.wait()
        comm = self._comm
        self._count += 1
        tmp = self.root / f".tmp-{final.name}-{self._pid0}-{self._count}"
        kind, weights, prefix = _model_tensors(model)
        flat: dict[str, torch.Tensor] = {f"model.{k}": v for k, v in weights.items()}
        small: dict[str, torch.Tensor] = {}
        state: dict[str, Any] = {"format": FORMAT, "version": VERSION, "step": step, "model_kind": KIND,
                                 "weights": kind, "world_size": comm.world,
                                 "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                 "tensors": {k: _meta(v) for k, v in flat.items()}}
        if optimizer is not None:
            _, ostate, groups = _optimizer_parts(model, optimizer, prefix)
            structure: dict[str, dict] = {}
            for fqn, entries in ostate.items():
                structure[fqn] = {}
                for key, v in entries.items():
                    if isinstance(v, torch.Tensor):
                        flat[f"optim.{fqn}.{key}"] = v
                        state["tensors"][f"optim.{fqn}.{key}"] = _meta(v)
                        structure[fqn][key] = {"__dcp__": f"optim.{fqn}.{key}"}
                    else:
                        structure[fqn][key] = _encode(v, f"optimizer.state.{fqn}.{key}", small)
            state["optimizer"] = {"state": structure, "param_groups": _encode(groups, "optimizer.param_groups", small),
                                  "wrapper": _encode(_wrapper_state(optimizer), "optimizer.wrapper", small)}
        for name, obj in (("scheduler", scheduler), ("clipper", clipper), ("scaler", scaler)):
            if obj is not None:
                state[name] = _encode(obj.state_dict(), name, small)
        state["metrics"] = _encode(_plain_metrics(metrics), "metrics", {})
        state["extra"] = _encode(dict(extra or {}), "extra", small)
        # what must be the same everywhere is checked, not assumed: a diverged rank fails loudly
        same = {k: state.get(k) for k in ("step", "scheduler", "clipper", "scaler", "tensors")}
        same["wrapper"] = state.get("optimizer", {}).get("wrapper")
        views = comm.all_gather_json({k: _sha(v) for k, v in same.items()})
        for k in same:
            if len({v[k] for v in views}) > 1:
                raise CheckpointError(f"checkpoint at step {step}: the ranks disagree on the {k} state "
                                      f"({[v[k][:8] for v in views]}); they have diverged")
        rank_small: dict[str, torch.Tensor] = {}
        per_rank = {"rank": comm.rank, "world_size": comm.world}
        if loader is not None:
            per_rank["loader"] = _encode(loader.state_dict(), "loader", rank_small)
        if rng:
            per_rank["rng"] = _encode(_rng_state(), "rng", rank_small)
        texts: dict[str, str] = {}
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        presaved: list[str] = []
        if kind == "adapter":  # the whole adapter in PEFT's format, written now by rank 0 (small)
            from ..lora.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS
            from .export import save_adapter_gathered

            save_kw = {} if base_model_name_or_path is None else {"base_model_name_or_path": base_model_name_or_path}
            if comm.rank == 0:
                tmp.mkdir(parents=True, exist_ok=True)
            save_adapter_gathered(_causal_lm(model)[0], tmp, **save_kw)  # collective
            presaved = [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
        if comm.rank == 0:
            texts[STATE_JSON] = json.dumps(state, indent=1, allow_nan=False) + "\n"
            tensors[STATE_TENSORS] = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in small.items()}
        job = _ShardJob(step, final, tmp, None, {k: v.detach().to("cpu", copy=True).contiguous()
                                                  for k, v in rank_small.items()},
                        json.dumps(per_rank, indent=1, allow_nan=False) + "\n", texts, tensors, state["metrics"],
                        presaved)
        writer = HuggingFaceStorageWriter(str(tmp / SHARDS), save_distributed=True)
        kw = dict(storage_writer=writer, process_group=self._group, no_dist=not comm.on)
        if self.background:
            if self._stager_keys not in (None, sorted(flat)):  # its reused buffers fit one layout
                self._stager.close()
                self._stager = self._new_stager()
            self._stager_keys = sorted(flat)
            with _quiet_single_process(comm.on):  # copies to CPU before returning
                job.future = dcp.async_save(flat, async_stager=self._stager, **kw)
            self._thread = threading.Thread(target=self._run, args=(job,), name=f"ftlib-sharded-checkpoint-{step}")
            self._thread.start()
        else:
            with _quiet_single_process(comm.on):
                dcp.save(flat, **kw)
            self._write(job)
        return final

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    # -- internals ------------------------------------------------------------------------------

    def _remove_stale_tmp(self) -> None:
        if self._comm.rank == 0:  # only rank 0 names temporary directories (with its pid)
            super()._remove_stale_tmp()

    def _write(self, job: _ShardJob) -> None:
        comm = self._comm
        files: dict[str, dict] = {}
        error = None
        try:
            if job.future is not None:
                job.future.result()
            job.tmp.mkdir(parents=True, exist_ok=True)
            for name, write in ((_rank_name(comm.rank, "safetensors"),
                                 lambda p: _write_safetensors(p, job.rank_tensors, {"format": "pt"})),
                                (_rank_name(comm.rank, "json"), lambda p: _write_bytes(p, job.rank_text.encode()))):
                size, sha = write(job.tmp / name)
                files[name] = {"bytes": size, "sha256": sha}
            for f in sorted((job.tmp / SHARDS).glob(f"shard-{comm.rank + 1:05d}-*.safetensors")):
                files[f"{SHARDS}/{f.name}"] = {"bytes": f.stat().st_size, "sha256": _sha256_file(f)}
        except BaseException as e:  # noqa: BLE001 -- reported to rank 0, raised below on every rank
            error = f"rank {comm.rank}: {e!r}"
        reports = comm.all_gather_json({"files": files, "error": error})
        status: dict[str, Any] = {"ok": True}
        if comm.rank == 0:
            try:
                errors = [r["error"] for r in reports if r["error"]]
                if errors:
                    raise CheckpointError("; ".join(errors))
                for r in reports:
                    files.update(r["files"])
                on_disk = {f"{SHARDS}/{p.name}" for p in (job.tmp / SHARDS).iterdir()}
                if on_disk - set(files):
                    raise CheckpointError(f"{job.tmp / SHARDS}: files no rank accounts for: {sorted(on_disk - set(files))}")
                self._finish_rank0(job, files)
            except BaseException as e:  # noqa: BLE001
                status = {"ok": False, "error": repr(e)}
                shutil.rmtree(job.tmp, ignore_errors=True)
        status = comm.from_rank0(status)
        if not status["ok"]:
            raise CheckpointError(f"sharded checkpoint {job.final}: {status['error']}")
        self.last_saved = job.final

    def _finish_rank0(self, job: _ShardJob, files: dict) -> None:
        for fname in job.presaved:
            f = job.tmp / fname
            files[fname] = {"bytes": f.stat().st_size, "sha256": _sha256_file(f)}
        for fname, ts in job.tensors.items():
            size, sha = _write_safetensors(job.tmp / fname, ts, {"format": "pt"})
            files[fname] = {"bytes": size, "sha256": sha}
        for fname, text in job.texts.items():
            size, sha = _write_bytes(job.tmp / fname, text.encode())
            files[fname] = {"bytes": size, "sha256": sha}
        marker = {"format": FORMAT, "version": VERSION, "step": job.step, "metrics": job.metrics,
                  "files": dict(sorted(files.items()))}
        _write_bytes(job.tmp / MARKER, (json.dumps(marker, indent=1, allow_nan=False) + "\n").encode())
        _fsync_dir(job.tmp / SHARDS)
        _fsync_dir(job.tmp)
        if job.final.exists():  # an earlier (maybe incomplete) save of this step: replace it
            trash = self.root / f"{job.tmp.name}-old"
            os.replace(job.final, trash)
            os.replace(job.tmp, job.final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(job.tmp, job.final)
        _fsync_dir(self.root)
        self._rotate()


def save_sharded_checkpoint(root: str | os.PathLike, step: int, *, model: nn.Module, optimizer=None,
                            scheduler=None, clipper=None, loader=None, scaler=None, rng: bool = True,
                            metrics: dict | None = None, extra: dict | None = None, keep: int | None = None,
                            metric: str | None = None, mode: str = "min",
                            base_model_name_or_path: str | None = None) -> Path:
    """Write one sharded checkpoint now, on every rank, and rotate; return its directory."""
    ck = ShardedCheckpointer(root, keep=keep, metric=metric, mode=mode, background=False)
    try:
        return ck.save(step, model=model, optimizer=optimizer, scheduler=scheduler, clipper=clipper, loader=loader,
                       scaler=scaler, rng=rng, metrics=metrics, extra=extra,
                       base_model_name_or_path=base_model_name_or_path)
    finally:
        ck.close()
        if ck._group is not None:
            dist.destroy_process_group(ck._group)


# ---- load ---------------------------------------------------------------------------------------


def _verify_shared(path: Path, comm: _Comm, full: bool) -> str | None:
    """None if ``path`` passes verification, else why; rank r hashes every W-th file of the marker."""
    error = None
    try:
        marker = _read_marker(path)
        for i, (name, rec) in enumerate(sorted(marker["files"].items())):
            f = path / name
            if not f.is_file():
                raise CheckpointError(f"{path}: {name} is missing")
            if f.stat().st_size != rec["bytes"]:
                raise CheckpointError(f"{f}: {f.stat().st_size} bytes, the marker records {rec['bytes']} "
                                      "(truncated or replaced)")
            if full and i % comm.world == comm.rank and _sha256_file(f) != rec["sha256"]:
                raise CheckpointError(f"{f}: SHA-256 differs from the marker's (corrupt)")
        json.loads((path / STATE_JSON).read_text())
    except CheckpointError as e:
        error = str(e)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        error = f"{path / STATE_JSON}: unreadable train state ({e})"
    errors = [e for e in comm.all_gather_json(error) if e]
    return errors[0] if errors else None


def _resolve(path: Path, comm: _Comm, verify: bool) -> Path:
    if (path / MARKER).exists() or _STEP_RE.fullmatch(path.name):
        error = _verify_shared(path, comm, full=verify)
        if error:
            raise CheckpointError(error)
        return path
    candidates = comm.from_rank0([str(p) for _, p in reversed(_step_dirs(path))])
    for p in map(Path, candidates):
        error = _verify_shared(p, comm, full=True)
        if error is None:
            return p
        if comm.rank == 0:
            warnings.warn(f"skipping checkpoint {p}: {error}; falling back to an earlier one", CheckpointWarning,
                          stacklevel=3)
    raise FileNotFoundError(f"{path}: no complete checkpoint to resume from")


def _check_fit(where: str, saved: dict, have: dict[str, torch.Tensor], what: str) -> None:
    missing = sorted(set(have) - set(saved))
    unexpected = sorted(set(saved) - set(have))
    if missing or unexpected:
        raise CheckpointError(f"{where}: the {what} does not fit: the checkpoint lacks {missing[:5]}, holds "
                              f"{unexpected[:5]} the {what} has not")
    for k, t in have.items():
        if list(t.shape) != saved[k]["shape"]:
            raise CheckpointError(f"{where}: {k} has shape {saved[k]['shape']} in the checkpoint, "
                                  f"{list(t.shape)} here")


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


def load_sharded_checkpoint(path: str | os.PathLike, *, model: nn.Module | None = None, optimizer=None,
                            scheduler=None, clipper=None, loader=None, scaler=None, rng: bool = True,
                            verify: bool = True) -> Checkpoint:
    """Restore a sharded checkpoint on every rank (any world size, see the module doc); ``path`` is a
    ``step-*`` directory or a root (then the newest good one, falling back past bad ones).

    Call it on every rank with the same arguments, after sharding the model and building the
    optimizer. Objects left ``None`` are not restored; RNG states are restored last. Raises
    ``CheckpointError`` naming the file and what does not fit.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    comm = _Comm(None)
    path = _resolve(Path(path), comm, verify)
    where = str(path / STATE_JSON)
    try:
        state = json.loads((path / STATE_JSON).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: unreadable train state ({e})") from None
    if state.get("model_kind") != KIND:
        raise CheckpointError(f"{path}: a one-process checkpoint of ftlib.checkpoint; load it with "
                              "ftlib.checkpoint.load_checkpoint")
    small = _read_tensors(path / STATE_TENSORS) if (path / STATE_TENSORS).is_file() else {}
    saved = state["tensors"]

    def part(name: str) -> Any:
        if name not in state:
            raise CheckpointError(f"{where}: no {name} state was saved, but a {name} was given to restore")
        return _decode(state[name], small, where)

    flat: dict[str, torch.Tensor] = {}
    if optimizer is not None and model is None:
        raise ValueError("load_sharded_checkpoint: restoring the optimizer needs the model too (its state is "
                         "keyed by parameter name)")
    if model is not None:
        kind, weights, prefix = _model_tensors(model)
        if kind != state["weights"]:
            raise CheckpointError(f"{where}: holds {state['weights']} weights, the model is a "
                                  f"{'LoRA' if kind == 'adapter' else 'full fine-tuning'} model")
        _check_fit(where, {k[6:]: v for k, v in saved.items() if k.startswith("model.")}, weights, "model")
        flat.update({f"model.{k}": v for k, v in weights.items()})
    if optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointError(f"{where}: no optimizer state was saved")
        inner, ostate, groups = _optimizer_parts(model, optimizer, prefix)
        saved_groups = _decode(state["optimizer"]["param_groups"], small, where)
        if [g["params"] for g in saved_groups] != [g["params"] for g in groups]:
            raise CheckpointError(f"{where}: the optimizer's parameter groups differ from the saved ones "
                                  f"({[len(g['params']) for g in saved_groups]} vs {[len(g['params']) for g in groups]} "
                                  "parameters per group)")
        structure = state["optimizer"]["state"]
        have = {f"optim.{fqn}.{key}": v for fqn, e in ostate.items() for key, v in e.items()
                if isinstance(v, torch.Tensor)}
        _check_fit(where, {k: v for k, v in saved.items() if k.startswith("optim.")}, have, "optimizer")
        flat.update(have)
    if flat:
        try:
            with _quiet_single_process(comm.on):
                dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(path / SHARDS)), no_dist=not comm.on)
        except Exception as e:  # noqa: BLE001 -- DCP raises CheckpointException and friends
            raise CheckpointError(f"{path / SHARDS}: could not read the shards: {e}") from None
    if model is not None:
        set_model_state_dict(model, {prefix + k[6:]: v for k, v in flat.items() if k.startswith("model.")},
                             options=StateDictOptions(strict=False))
    if optimizer is not None:
        new_state: dict[str, dict] = {}
        for fqn, entries in structure.items():
            new_state[prefix + fqn] = {key: (flat[v["__dcp__"]] if isinstance(v, dict) and "__dcp__" in v
                                             else _decode(v, small, where)) for key, v in entries.items()}
        new_groups = []
        for g_saved, g_now in zip(saved_groups, groups):
            g = dict(g_saved, params=[prefix + k for k in g_now["params"]])
            if "param_names" in g_now:
                g["param_names"] = g_now["param_names"]
            new_groups.append(g)
        set_optimizer_state_dict(model, inner, {"state": new_state, "param_groups": new_groups})
        wrapper = _decode(state["optimizer"]["wrapper"], small, where)
        if _is_train_optimizer(optimizer):
            if wrapper is None:
                raise CheckpointError(f"{where}: saved from a plain torch optimizer, restored into a TrainOptimizer")
            if wrapper["precision"] != optimizer.precision:
                raise CheckpointError(f"{where}: saved with precision={wrapper['precision']!r}, this TrainOptimizer "
                                      f"uses {optimizer.precision!r}")
            if optimizer.scaler is not None:
                optimizer.scaler.load_state_dict(wrapper["scaler"])
            optimizer.steps, optimizer.skipped_steps = int(wrapper["steps"]), int(wrapper["skipped_steps"])
    for name, obj in (("scheduler", scheduler), ("clipper", clipper), ("scaler", scaler)):
        if obj is not None:
            try:
                obj.load_state_dict(part(name))
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{where}: {name} state does not fit: {e}") from None
    if loader is not None or rng:
        saved_world = int(state["world_size"])
        src = comm.rank % saved_world
        rfile = path / _rank_name(src, "json")
        try:
            per_rank = json.loads(rfile.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{rfile}: unreadable ({e})") from None
        rsmall = _read_tensors(path / _rank_name(src, "safetensors"))
        if loader is not None:
            if "loader" not in per_rank:
                raise CheckpointError(f"{rfile}: no loader state was saved, but a loader was given to restore")
            try:
                loader.load_state_dict(_loader_state(_decode(per_rank["loader"], rsmall, str(rfile)), loader, str(rfile)))
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{rfile}: loader state does not fit: {e}") from None
        if rng:
            if "rng" not in per_rank:
                raise CheckpointError(f"{rfile}: no RNG state was saved (saved with rng=False); pass rng=False")
            if saved_world != comm.world and comm.rank == 0:
                warnings.warn(f"{path}: saved by {saved_world} ranks, restored on {comm.world}: rank r takes the "
                              f"RNG states of saved rank r mod {saved_world}, so random streams (dropout) are not "
                              f"those of a {saved_world}-rank continuation", CheckpointWarning, stacklevel=2)
            _set_rng_state(_decode(per_rank["rng"], rsmall, str(rfile)), str(rfile))
    return Checkpoint(path=path, step=int(state["step"]), metrics=_decode(state.get("metrics", {}), None, where),
                      extra=_decode(state.get("extra", {}), small, where))
