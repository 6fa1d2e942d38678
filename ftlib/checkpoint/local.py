"""The one-process ``Checkpointer``: the whole train state of this process, written in the background.

Layout of ``<root>/step-00001200/`` (names and marker: ``ftlib.checkpoint.format``):

    adapter_config.json        LoRA runs: the adapter in PEFT's format, so every checkpoint is also
    adapter_model.safetensors  an adapter ``ftlib.lora.load_adapter`` and ``peft`` load
    trainable.safetensors      LoRA runs: trainable parameters outside the adapter, if any
    model.safetensors          full fine-tuning: every weight (Hugging Face names; a tied lm_head is
    config.json                not stored), with the model's config.json: ``load_pretrained`` loads it
    optimizer.safetensors      every tensor of the optimizer's state (Adam moments, step counts)
    state.safetensors          the other tensors of the train state (torch CPU/CUDA RNG states, ...)
    state.json                 everything else: step, schedule, clipper (z-score EMA), loss scaler,
                               loader position, Python/NumPy RNG states, metrics, ``extra``, and the
                               structure of the optimizer state with references to its tensors
    COMPLETE                   the marker, written last: format version, step, metrics, and the byte
                               size and SHA-256 of every other file

Background writes. ``save`` copies every tensor off the training path before it returns (into
pinned CPU buffers with non-blocking copies on CUDA, reused from one save to the next; plain
copies on CPU) and serialises the rest of the state as it is at that moment; a thread then
writes, hashes, renames and rotates (``format.finalize``, ``format.rotate``). At most one save is
in flight (``BackgroundWriter``).

One writer per root. The constructor takes the root's lock (``ftlib.checkpoint.lock``: a second
live writer is refused naming the holder's pid and host; a dead one's lock is taken over) and
``close()`` gives it back.

Rotation. After each save the newest ``keep`` good checkpoints are kept, plus the best one by
``metric`` (``mode="min"`` or ``"max"``, read from the ``metrics`` given to ``save``; the first
to reach the best value wins ties); other good ones are deleted. Checkpoints that fail
verification are left in place for inspection (a later save of the same step replaces one).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import format as fmt
from .background import BackgroundWriter
from .format import (
    FORMAT,
    MODEL_TENSORS,
    OPTIM_TENSORS,
    STATE_JSON,
    STATE_TENSORS,
    TRAINABLE_TENSORS,
    VERSION,
    best_checkpoint,
    encode,
    plain_metrics,
    rng_state,
    step_dir_name,
)
from .lock import RootLock
from .verify import latest_checkpoint

__all__ = ["Checkpointer", "lora_config", "save_checkpoint", "unwrap"]


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside ``DistributedDataParallel`` / ``DataParallel`` wrappers (``model`` itself otherwise)."""
    while isinstance(getattr(model, "module", None), nn.Module) and type(model).__name__ in (
            "DistributedDataParallel", "DataParallel"):
        model = model.module
    return model


def lora_config(model: nn.Module):
    """The ``LoRAConfig`` ``apply_lora`` used on ``model``, or None for a model without adapters."""
    from ..lora import get_lora_config

    try:
        return get_lora_config(model)
    except ValueError:
        return None


def _model_files(model: nn.Module, base_model_name_or_path: str | None) -> tuple[str, dict, dict]:
    """(kind, {file: tensors to snapshot}, {file: JSON text}) for the model's weights."""
    cfg = lora_config(model)
    if cfg is not None:
        from ..lora.peft_io import (
            ADAPTER_CONFIG,
            ADAPTER_WEIGHTS,
            PEFT_PREFIX,
            adapter_params,
            model_name_or_path,
        )

        adapter = adapter_params(model)
        targets = cfg.target_modules if isinstance(cfg.target_modules, str) else sorted(set(cfg.target_modules))
        peft = cfg.to_peft_dict(targets, base_model_name_or_path or model_name_or_path(model), None)
        files = {ADAPTER_WEIGHTS: {PEFT_PREFIX + k: p for k, p in adapter.items()}}
        in_adapter = {id(p) for p in adapter.values()}
        others = {n: p for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_adapter}
        if others:
            files[TRAINABLE_TENSORS] = others
        return "lora", files, {ADAPTER_CONFIG: json.dumps(peft, indent=2, sort_keys=True) + "\n"}
    state = dict(model.state_dict(keep_vars=True))
    config = getattr(model, "config", None)
    texts = {}
    if getattr(config, "tie_word_embeddings", False):
        head, emb = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
        if head is not None and emb is not None and head is emb:
            del state["lm_head.weight"]  # as save_pretrained: the config ties it back
    if hasattr(config, "to_hf_dict"):
        from ..models.config import ARCHITECTURES

        d = {"architectures": [ARCHITECTURES[config.model_type]], **config.to_hf_dict()}
        texts["config.json"] = json.dumps(d, indent=2) + "\n"
    seen: dict[int, str] = {}
    for k, t in list(state.items()):  # other shared tensors: store once (safetensors refuses aliases)
        if id(t) in seen:
            del state[k]
        else:
            seen[id(t)] = k
    return "full", {MODEL_TENSORS: state}, texts


@dataclass
class _Job:
    step: int
    final: Path
    tensors: dict[str, dict[str, torch.Tensor]]  # file -> name -> CPU tensor
    texts: dict[str, str]  # file -> content
    metrics: dict
    events: list = field(default_factory=list)  # CUDA events the copies must reach first


class Checkpointer:
    """Save train-state checkpoints under ``root``, in a background thread (see the module doc).

    ``keep``: newest good checkpoints kept (None keeps all); ``metric`` / ``mode``: also keep the
    best by that entry of ``save(metrics=...)``; ``background=False`` writes inside ``save``.
    Holds the root's lock until ``close()`` (a second writer on the root is refused).
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
        self._pinned: dict[tuple[str, str], torch.Tensor] = {}
        self._count = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = RootLock(self.root)
        fmt.remove_stale_tmp(self.root)
        self._writer = BackgroundWriter(str(self.root))

    # -- public ---------------------------------------------------------------------------------

    def save(self, step: int, *, model: nn.Module, optimizer=None, scheduler=None, clipper=None, loader=None,
             scaler=None, rng: bool = True, metrics: dict | None = None, extra: dict | None = None,
             base_model_name_or_path: str | None = None) -> Path:
        """Snapshot the train state at ``step`` and write it to ``<root>/step-XXXXXXXX``; return that path.

        Components left ``None`` are not saved. Every stateful object is saved through its
        ``state_dict()``. With ``background=True`` the files exist once ``wait()`` returns.
        """
        final = self.root / step_dir_name(step)
        self.wait()  # one save in flight; raises an earlier background error
        if not self._lock.held:  # saving again after close(): take the root's lock again
            self._lock = RootLock(self.root)
        model = unwrap(model)
        kind, weights, texts = _model_files(model, base_model_name_or_path)
        state_tensors: dict[str, torch.Tensor] = {}
        optim_tensors: dict[str, torch.Tensor] = {}
        state = {"format": FORMAT, "version": VERSION, "step": step, "model_kind": kind,
                 "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if optimizer is not None:
            state["optimizer"] = encode(optimizer.state_dict(), "optimizer", optim_tensors)
        components = {"scheduler": scheduler, "clipper": clipper, "scaler": scaler, "loader": loader}
        for name, obj in components.items():
            if obj is not None:
                state[name] = encode(obj.state_dict(), name, state_tensors)
        if rng:
            state["rng"] = encode(rng_state(), "rng", state_tensors)
        state["metrics"] = encode(plain_metrics(metrics), "metrics", {})
        state["extra"] = encode(dict(extra or {}), "extra", state_tensors)
        texts[STATE_JSON] = json.dumps(state, indent=1, allow_nan=False) + "\n"
        weights[OPTIM_TENSORS] = optim_tensors
        weights[STATE_TENSORS] = state_tensors
        job = _Job(step, final, {}, texts, state["metrics"])
        job.tensors = {f: self._snapshot(f, ts, job) for f, ts in weights.items()}
        self._count += 1
        if self.background:
            self._writer.submit(lambda: self._write(job), name=f"ftlib-checkpoint-{step}")
        else:
            self._write(job)
        return final

    def wait(self) -> Path | None:
        """Join the save in flight (if any); raise its error; return the last checkpoint written."""
        self._writer.wait()
        return self.last_saved

    def close(self) -> None:
        """``wait()``, then release the pinned buffers and the root's lock."""
        try:
            self._writer.close()
        finally:
            self._pinned.clear()
            self._lock.release()

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def best(self) -> Path | None:
        """The best checkpoint by ``metric`` (None without a metric or before one was recorded)."""
        return None if self.metric is None else best_checkpoint(self.root, self.metric, self.mode)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _snapshot(self, fname: str, tensors: dict[str, torch.Tensor], job: _Job) -> dict[str, torch.Tensor]:
        out = {}
        cuda_devices = set()
        for name, t in tensors.items():
            t = t.detach()
            if hasattr(t, "full_tensor"):  # DTensor: the full value (sharded saves are ShardedCheckpointer's)
                t = t.full_tensor()
            if t.device.type == "cuda":
                key = (fname, name)
                buf = self._pinned.get(key)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    self._pinned[key] = buf
                buf.copy_(t, non_blocking=True)  # ordered before later in-place updates on this stream
                cuda_devices.add(t.device)
                out[name] = buf
            else:
                out[name] = t.to("cpu", copy=True).contiguous()
        for dev in cuda_devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            job.events.append(ev)
        return out

    def _write(self, job: _Job) -> None:
        for ev in job.events:
            ev.synchronize()
        tmp = fmt.tmp_dir(self.root, job.final, os.getpid(), self._count)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        try:
            files = {}
            for fname, tensors in job.tensors.items():
                size, sha = fmt.write_safetensors(tmp / fname, tensors, {"format": "pt"})
                files[fname] = {"bytes": size, "sha256": sha}
            for fname, text in job.texts.items():
                size, sha = fmt.write_bytes(tmp / fname, text.encode())
                files[fname] = {"bytes": size, "sha256": sha}
            fmt.write_marker(tmp, job.step, job.metrics, files)
            fmt.finalize(tmp, job.final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed save leaves nothing behind (a kill leaves .tmp-*)
            raise
        self.last_saved = job.final
        fmt.rotate(self.root, self.keep, self.metric, self.mode)


def save_checkpoint(root: str | os.PathLike, step: int, *, model: nn.Module, optimizer=None, scheduler=None,
                    clipper=None, loader=None, scaler=None, rng: bool = True, metrics: dict | None = None,
                    extra: dict | None = None, keep: int | None = None, metric: str | None = None,
                    mode: str = "min", base_model_name_or_path: str | None = None) -> Path:
    """Write one checkpoint now (no background thread) and rotate; return its directory.

    A loop that saves often should hold a ``Checkpointer`` instead: it writes in the background.
    """
    ck = Checkpointer(root, keep=keep, metric=metric, mode=mode, background=False)
    try:
        return ck.save(step, model=model, optimizer=optimizer, scheduler=scheduler, clipper=clipper, loader=loader,
                       scaler=scaler, rng=rng, metrics=metrics, extra=extra,
                       base_model_name_or_path=base_model_name_or_path)
    finally:
        ck.close()
