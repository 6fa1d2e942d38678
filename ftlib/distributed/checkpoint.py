"""Sharded train-state checkpoints through ``torch.distributed.checkpoint``: every rank writes its own shards.

The format is ``ftlib.checkpoint``'s (names, marker, verification, rotation, the root's lock,
fallback past bad checkpoints); the sharded layout (which tensors go into the shards and the
per-rank files) is ``ftlib.checkpoint.sharded``'s, and ``ftlib.checkpoint.load_checkpoint``
reads these checkpoints on any number of ranks (one loader for both kinds). ``latest_checkpoint``, ``list_checkpoints``, ``best_checkpoint`` and
``verify_checkpoint`` read both kinds.

Atomicity. Ranks write into ``<root>/.tmp-step-00001200-<pid of rank 0>-<n>/``; each rank hashes
the files it wrote, rank 0 gathers the records, checks that no shard file is unaccounted for,
writes its own files and the marker, renames the directory to ``step-00001200``, rotates and
tells every rank the outcome. Any rank's failure fails the save on every rank (no marker). A
shared file system is assumed (as DCP does). Rank 0 holds the root's lock for all ranks.

What is saved of the optimizer: its tensors through DCP (keyed by parameter name), and the
rest of a ``TrainOptimizer``'s state (precision and fp16 fallback, counters, loss scaler) as its
own ``state_dict`` gives it, restored by its own ``load_state_dict``; the ranks must agree on it.

Background saves. ``save`` snapshots every tensor to CPU memory before it returns (DCP's
``async_save`` with a blocking stager: pinned buffers on CUDA, reused between saves) and
serialises the rest; ``torch``'s async executor writes the shards and a thread of ours then
hashes and finalises. Both talk over a gloo process group of their own, created by the
constructor (collectively: every rank builds the checkpointer at the same point), so they never
interleave with the training collectives. At most one save is in flight: the next ``save``,
``wait()`` and ``close()`` join it on every rank and raise its error. Call ``close()`` before
``destroy_process_group``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._dist import all_gather_json, from_rank0, get_rank, get_world_size, is_distributed
from ..checkpoint.background import BackgroundWriter
from ..checkpoint.format import (
    FORMAT,
    SHARDS,
    STATE_JSON,
    STATE_TENSORS,
    VERSION,
    CheckpointError,
    best_checkpoint,
    encode,
    file_record,
    finalize,
    fsync_dir,
    plain_metrics,
    remove_stale_tmp,
    rng_state,
    rotate,
    step_dir_name,
    tmp_dir,
    write_bytes,
    write_marker,
    write_safetensors,
)
from ..checkpoint.lock import RootLock
from ..checkpoint.sharded import (
    KIND,
    causal_lm,
    model_tensors,
    optimizer_parts,
    quiet_single_process,
    rank_file,
    tensor_meta,
    train_optimizer_parts,
)
from ..checkpoint.verify import latest_checkpoint
from .export import save_adapter_gathered

__all__ = ["SHARDS", "ShardedCheckpointer", "save_sharded_checkpoint"]


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


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


class ShardedCheckpointer:
    """Checkpoints of sharded (FSDP2/HSDP) or replicated (DDP) models: every rank saves its part.

    Build it on every rank at the same point (it creates a process group); call ``save``,
    ``wait`` and ``close`` on every rank. Arguments as ``ftlib.checkpoint.Checkpointer``;
    ``model`` in ``save`` is what the loop trains (the FSDP2 root, the DDP wrapper or the plain
    module) and ``optimizer`` a ``TrainOptimizer`` or a ``torch.optim`` optimizer over its
    parameters. Works in one process without torch.distributed too (then it writes one shard).
    """

    def __init__(self, root: str | os.PathLike, *, keep: int | None = 3, metric: str | None = None,
                 mode: str = "min", background: bool = True):
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be an int >= 1 or None (keep all), got {keep!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.root = Path(root)
        self.keep, self.metric, self.mode, self.background = keep, metric, mode, background
        self.last_saved: Path | None = None
        self._count = 0
        # a gloo group of our own: background writes never share a communicator with training
        self._group = dist.new_group(backend="gloo") if is_distributed() else None
        self.rank, self.world_size = get_rank(self._group), get_world_size(self._group)
        self._pid0 = int(self._from_rank0(os.getpid()))
        self._lock: RootLock | None = None
        self._take_lock()
        self._writer = BackgroundWriter(str(self.root))
        self._stager, self._stager_keys = None, None
        if background:
            self._stager = self._new_stager()

    def _take_lock(self) -> None:
        """Rank 0 takes the root's lock (and names temporary directories with its pid); every rank learns the outcome."""
        error = None
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self._lock = RootLock(self.root)
                remove_stale_tmp(self.root)
            except (CheckpointError, OSError) as e:
                error = str(e)
        error = self._from_rank0(error)
        if error is not None:
            raise CheckpointError(error)
        self._closed = False

    def _gather(self, obj: Any) -> list:
        return all_gather_json(obj, self._group)

    def _from_rank0(self, obj: Any) -> Any:
        return from_rank0(obj, self._group)

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
        if self._closed:  # saving again after close(): take the root's lock again (collective, as close() was)
            self._take_lock()
        self._count += 1
        tmp = tmp_dir(self.root, final, self._pid0, self._count)
        kind, weights, prefix = model_tensors(model)
        flat: dict[str, torch.Tensor] = {f"model.{k}": v for k, v in weights.items()}
        small: dict[str, torch.Tensor] = {}
        state: dict[str, Any] = {"format": FORMAT, "version": VERSION, "step": step, "model_kind": KIND,
                                 "weights": kind, "world_size": self.world_size,
                                 "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                 "tensors": {k: tensor_meta(v) for k, v in flat.items()}}
        if optimizer is not None:
            inner, wrapper = train_optimizer_parts(optimizer)
            ostate, groups = optimizer_parts(model, inner, prefix)
            structure: dict[str, dict] = {}
            for fqn, entries in ostate.items():
                structure[fqn] = {}
                for key, v in entries.items():
                    if isinstance(v, torch.Tensor):
                        flat[f"optim.{fqn}.{key}"] = v
                        state["tensors"][f"optim.{fqn}.{key}"] = tensor_meta(v)
                        structure[fqn][key] = {"__dcp__": f"optim.{fqn}.{key}"}
                    else:
                        structure[fqn][key] = encode(v, f"optimizer.state.{fqn}.{key}", small)
            state["optimizer"] = {"state": structure, "param_groups": encode(groups, "optimizer.param_groups", small),
                                  "wrapper": encode(wrapper, "optimizer.wrapper", small)}
        for name, obj in (("scheduler", scheduler), ("clipper", clipper), ("scaler", scaler)):
            if obj is not None:
                state[name] = encode(obj.state_dict(), name, small)
        state["metrics"] = encode(plain_metrics(metrics), "metrics", {})
        state["extra"] = encode(dict(extra or {}), "extra", small)
        # what must be the same everywhere is checked, not assumed: a diverged rank fails loudly
        same = {k: state.get(k) for k in ("step", "scheduler", "clipper", "scaler", "tensors")}
        same["wrapper"] = state.get("optimizer", {}).get("wrapper")
        views = self._gather({k: _sha(v) for k, v in same.items()})
        for k in same:
            if len({v[k] for v in views}) > 1:
                raise CheckpointError(f"checkpoint at step {step}: the ranks disagree on the {k} state "
                                      f"({[v[k][:8] for v in views]}); they have diverged")
        rank_small: dict[str, torch.Tensor] = {}
        per_rank = {"rank": self.rank, "world_size": self.world_size}
        if loader is not None:
            per_rank["loader"] = encode(loader.state_dict(), "loader", rank_small)
        if rng:
            per_rank["rng"] = encode(rng_state(), "rng", rank_small)
        texts: dict[str, str] = {}
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        presaved: list[str] = []
        if kind == "adapter":  # the whole adapter in PEFT's format, written now by rank 0 (small)
            from ..lora.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS

            save_kw = {} if base_model_name_or_path is None else {"base_model_name_or_path": base_model_name_or_path}
            if self.rank == 0:
                tmp.mkdir(parents=True, exist_ok=True)
            save_adapter_gathered(causal_lm(model)[0], tmp, **save_kw)  # collective
            presaved = [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
        if self.rank == 0:
            texts[STATE_JSON] = json.dumps(state, indent=1, allow_nan=False) + "\n"
            tensors[STATE_TENSORS] = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in small.items()}
        job = _ShardJob(step, final, tmp, None, {k: v.detach().to("cpu", copy=True).contiguous()
                                                  for k, v in rank_small.items()},
                        json.dumps(per_rank, indent=1, allow_nan=False) + "\n", texts, tensors, state["metrics"],
                        presaved)
        on = is_distributed()
        writer = HuggingFaceStorageWriter(str(tmp / SHARDS), save_distributed=True)
        kw = dict(storage_writer=writer, process_group=self._group, no_dist=not on)
        if self.background:
            if self._stager_keys not in (None, sorted(flat)):  # its reused buffers fit one layout
                self._stager.close()
                self._stager = self._new_stager()
            self._stager_keys = sorted(flat)
            with quiet_single_process(on):  # copies to CPU before returning
                job.future = dcp.async_save(flat, async_stager=self._stager, **kw)
            self._writer.submit(lambda: self._write(job), name=f"ftlib-sharded-checkpoint-{step}")
        else:
            with quiet_single_process(on):
                dcp.save(flat, **kw)
            self._write(job)
        return final

    def wait(self) -> Path | None:
        """Join the save in flight (if any) on this rank; raise its error; return the last checkpoint written."""
        self._writer.wait()
        return self.last_saved

    def close(self) -> None:
        """``wait()``, then release the stager's buffers and (rank 0) the root's lock."""
        try:
            self._writer.close()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._lock is not None:
                self._lock.release()
            self._closed = True

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def best(self) -> Path | None:
        """The best checkpoint by ``metric`` (None without a metric or before one was recorded)."""
        return None if self.metric is None else best_checkpoint(self.root, self.metric, self.mode)

    def __enter__(self) -> ShardedCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _write(self, job: _ShardJob) -> None:
        files: dict[str, dict] = {}
        error = None
        try:
            if job.future is not None:
                job.future.result()
            job.tmp.mkdir(parents=True, exist_ok=True)
            for name, write in ((rank_file(self.rank, "safetensors"),
                                 lambda p: write_safetensors(p, job.rank_tensors, {"format": "pt"})),
                                (rank_file(self.rank, "json"), lambda p: write_bytes(p, job.rank_text.encode()))):
                size, sha = write(job.tmp / name)
                files[name] = {"bytes": size, "sha256": sha}
            for f in sorted((job.tmp / SHARDS).glob(f"shard-{self.rank + 1:05d}-*.safetensors")):
                files[f"{SHARDS}/{f.name}"] = file_record(f)
        except BaseException as e:  # noqa: BLE001 -- reported to rank 0, raised below on every rank
            error = f"rank {self.rank}: {e!r}"
        reports = self._gather({"files": files, "error": error})
        status: dict[str, Any] = {"ok": True}
        if self.rank == 0:
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
        status = self._from_rank0(status)
        if not status["ok"]:
            raise CheckpointError(f"sharded checkpoint {job.final}: {status['error']}")
        self.last_saved = job.final

    def _finish_rank0(self, job: _ShardJob, files: dict) -> None:
        for fname in job.presaved:
            files[fname] = file_record(job.tmp / fname)
        for fname, ts in job.tensors.items():
            size, sha = write_safetensors(job.tmp / fname, ts, {"format": "pt"})
            files[fname] = {"bytes": size, "sha256": sha}
        for fname, text in job.texts.items():
            size, sha = write_bytes(job.tmp / fname, text.encode())
            files[fname] = {"bytes": size, "sha256": sha}
        write_marker(job.tmp, job.step, job.metrics, files)
        fsync_dir(job.tmp / SHARDS)
        finalize(job.tmp, job.final)
        rotate(self.root, self.keep, self.metric, self.mode)


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

