"""Train-state checkpoints: atomic, verified, rotated, written off the training path; exact resume.

    ckpt = Checkpointer("runs/x/checkpoints", keep=3, metric="eval_loss", mode="min")
    step = 0
    if resume and (path := latest_checkpoint(ckpt.root)) is not None:
        step = load_checkpoint(path, model=model, optimizer=opt, scheduler=sched, clipper=clip,
                               loader=loader).step
    while step < total:
        ...                                        # one optimizer step (a whole accumulation window)
        step += 1
        if step % save_every == 0 or step == total:
            ckpt.save(step, model=model, optimizer=opt, scheduler=sched, clipper=clip, loader=loader,
                      metrics={"eval_loss": eval_loss})
    ckpt.close()                                   # waits for the last write

Layout of ``<root>/step-00001200/``:

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

No pickle: tensors go through safetensors (written here as a stream, no second copy in memory),
the rest through strict JSON (non-finite floats, tuples, non-string keys and NumPy arrays have
tagged encodings, see ``_encode``).

Atomicity. A save writes into ``<root>/.tmp-step-00001200-<pid>/``: every file is fsynced, the
marker is written last and fsynced, then the directory itself, which is then renamed to
``step-00001200`` (an atomic rename on POSIX) and the root fsynced. A crash at any point leaves
either the finished directory or a ``.tmp-*`` one that is never taken for a checkpoint (and is
removed by the next ``Checkpointer`` on that root once its process is gone). A ``step-*``
directory without a valid marker, or with a file whose size or SHA-256 differs from the marker's
record, is never resumed from: ``latest_checkpoint`` warns (``CheckpointWarning``) naming the
directory and why, and falls back to the previous good one.

Rotation. After each save the newest ``keep`` good checkpoints are kept, plus the best one by
``metric`` (``mode="min"`` or ``"max"``, read from the ``metrics`` given to ``save``; the first
to reach the best value wins ties); other good ones are deleted. Checkpoints that fail
verification are left in place for inspection (a later save of the same step replaces one).

Background writes. ``save`` copies every tensor off the training path before it returns (into
pinned CPU buffers with non-blocking copies on CUDA, reused from one save to the next; plain
copies on CPU) and serialises the rest of the state as it is at that moment; a thread then
writes, hashes, renames and rotates. At most one save is in flight: the next ``save``,
``wait()``, ``close()`` and interpreter exit join it, and an exception raised in the thread is
raised again by the next of these calls.

Exact resume. A resumed run continues bit for bit when it gets back: the trainable weights; the
optimizer's state and, through ``TrainOptimizer.state_dict``, its update and skipped-window
counters and fp16 loss scaler; the schedule's progress and state; the clipper's state (the
z-score EMA); the loader's position (epoch, batches handed out, and the settings its order
depends on, which it checks); the Python, NumPy (legacy global) and torch CPU and CUDA RNG
states (LoRA dropout masks come from the torch RNG). Save between optimizer steps, after
``step()`` has closed the accumulation window; everything the loop itself keeps (token
counters, the best eval metric) goes into ``extra``. Restore the RNG states last, after anything
that draws random numbers while being built (``load_checkpoint`` does so after loading the rest).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import random
import re
import shutil
import struct
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointWarning",
    "Checkpointer",
    "MARKER",
    "best_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "step_dir_name",
    "verify_checkpoint",
]

MARKER = "COMPLETE"
FORMAT = "ftlib-checkpoint"
VERSION = 1
STATE_JSON = "state.json"
STATE_TENSORS = "state.safetensors"
OPTIM_TENSORS = "optimizer.safetensors"
MODEL_TENSORS = "model.safetensors"
TRAINABLE_TENSORS = "trainable.safetensors"
_STEP_RE = re.compile(r"step-(\d{8,})")
_TMP_RE = re.compile(r"\.tmp-step-\d+-(\d+)(-\d+)?")


class CheckpointError(RuntimeError):
    """A checkpoint directory that is incomplete, corrupt, or does not fit what it is loaded into."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (incomplete or corrupt) and an earlier one is used instead."""


def step_dir_name(step: int) -> str:
    """``step-00001200``: eight digits at least, so names sort by step."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return f"step-{step:08d}"


# ---- strict JSON + tensors ------------------------------------------------------------------


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able form of ``obj``; tensors are moved to ``tensors`` under their path and referenced."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj
        return {"__tensor__": path}
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, np.ndarray):
        data = obj.reshape(-1).tolist()
        if obj.dtype.kind in "fc":
            data = [_encode(v, path, tensors) for v in data]
        return {"__ndarray__": obj.dtype.str, "shape": list(obj.shape), "data": data}
    if isinstance(obj, np.generic):
        return _encode(obj.item(), path, tensors)
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, f"{path}.{k}", tensors) for k, v in obj.items()}
        return {"__items__": [[_encode(k, f"{path}.key{i}", tensors), _encode(v, f"{path}.{k}", tensors)]
                              for i, (k, v) in enumerate(obj.items())]}
    raise TypeError(f"checkpoint state at {path!r}: cannot store a {type(obj).__name__} without pickle "
                    "(use tensors, numbers, strings, lists, tuples and dicts)")


def _decode(obj: Any, tensors: dict[str, torch.Tensor] | None, where: str) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, where) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        key = obj["__tensor__"]
        if tensors is None or key not in tensors:
            raise CheckpointError(f"{where}: state references tensor {key!r}, which its tensor file lacks")
        return tensors[key]
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors, where) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in obj["__items__"]}
    if "__ndarray__" in obj:
        data = [_decode(v, tensors, where) for v in obj["data"]]
        return np.asarray(data, dtype=np.dtype(obj["__ndarray__"])).reshape(obj["shape"])
    if "__dtype__" in obj:
        return getattr(torch, obj["__dtype__"])
    return {k: _decode(v, tensors, where) for k, v in obj.items()}


# ---- files: streamed safetensors, fsync, hashes ---------------------------------------------

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes, no copy


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> tuple[int, str]:
    """Write a safetensors file tensor by tensor (no serialised copy in memory); return (bytes, sha256)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{path.name}: tensor {name!r} has dtype {t.dtype}, which safetensors cannot hold")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes
    sha = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(head)), head):
            f.write(chunk)
            sha.update(chunk)
        for t in tensors.values():
            buf = _tensor_bytes(t)
            f.write(buf)
            sha.update(buf)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(head) + offset, sha.hexdigest()


def _write_bytes(path: Path, data: bytes) -> tuple[int, str]:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data), hashlib.sha256(data).hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms that cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from .models._safetensors_io import SafetensorsReader

    try:
        with SafetensorsReader(path) as r:
            return {k: r.read(k) for k in r.keys()}
    except ValueError as e:
        raise CheckpointError(str(e)) from None


# ---- verification and discovery -------------------------------------------------------------


def _read_marker(path: Path) -> dict:
    m = path / MARKER
    if not m.is_file():
        raise CheckpointError(f"{path}: no {MARKER} marker (the save did not finish)")
    try:
        marker = json.loads(m.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{m}: corrupt marker ({e})") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT or not isinstance(marker.get("files"), dict):
        raise CheckpointError(f"{m}: not an ftlib checkpoint marker")
    if marker.get("version") != VERSION:
        raise CheckpointError(f"{m}: checkpoint format version {marker.get('version')}, this ftlib reads {VERSION}")
    return marker


def verify_checkpoint(path: str | os.PathLike, *, full: bool = True) -> dict:
    """Check ``path`` against its marker; return the marker, or raise ``CheckpointError`` saying why.

    Every file the marker lists must exist with its recorded size and (``full=True``) SHA-256,
    and ``state.json`` must parse. ``full=False`` checks sizes only (no read of the tensors).
    """
    path = Path(path)
    marker = _read_marker(path)
    for name, rec in marker["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        size = f.stat().st_size
        if size != rec["bytes"]:
            raise CheckpointError(f"{f}: {size} bytes, the marker records {rec['bytes']} (truncated or replaced)")
        if full and _sha256_file(f) != rec["sha256"]:
            raise CheckpointError(f"{f}: SHA-256 differs from the marker's (corrupt)")
    try:
        json.loads((path / STATE_JSON).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / STATE_JSON}: unreadable train state ({e})") from None
    return marker


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.fullmatch(p.name))]
    return sorted(out)


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path, dict]]:
    """``(step, path, metrics)`` of every checkpoint under ``root`` with a valid marker, by step.

    Only the marker is read (cheap); ``verify_checkpoint`` checks the files.
    """
    out = []
    for step, p in _step_dirs(Path(root)):
        try:
            marker = _read_marker(p)
        except CheckpointError:
            continue
        out.append((step, p, marker.get("metrics") or {}))
    return out


def latest_checkpoint(root: str | os.PathLike, *, full: bool = True) -> Path | None:
    """The newest checkpoint under ``root`` that passes ``verify_checkpoint``, or None.

    Each newer one that fails is skipped with a ``CheckpointWarning`` naming it and the reason.
    """
    for _, p in reversed(_step_dirs(Path(root))):
        try:
            verify_checkpoint(p, full=full)
        except CheckpointError as e:
            warnings.warn(f"skipping checkpoint {p}: {e}; falling back to an earlier one", CheckpointWarning,
                          stacklevel=2)
            continue
        return p
    return None


def _metric_value(metrics: dict, metric: str) -> float | None:
    v = metrics.get(metric)
    if isinstance(v, dict) and "__float__" in v:
        v = float(v["__float__"])
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


def best_checkpoint(root: str | os.PathLike, metric: str, mode: str = "min") -> Path | None:
    """The checkpoint under ``root`` with the best ``metric`` in its marker (the earliest on ties)."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    best, best_v = None, None
    for _, p, metrics in list_checkpoints(root):
        v = _metric_value(metrics, metric)
        if v is not None and (best_v is None or (v < best_v if mode == "min" else v > best_v)):
            best, best_v = p, v
    return best


# ---- what goes into a checkpoint -------------------------------------------------------------


def _unwrap(model: nn.Module) -> nn.Module:
    while isinstance(getattr(model, "module", None), nn.Module) and type(model).__name__ in (
            "DistributedDataParallel", "DataParallel"):
        model = model.module
    return model


def _lora_config(model: nn.Module):
    from .lora.apply import _CONFIG_ATTR

    return getattr(model, _CONFIG_ATTR, None)


def _model_files(model: nn.Module, base_model_name_or_path: str | None) -> tuple[str, dict, dict]:
    """(kind, {file: tensors to snapshot}, {file: JSON text}) for the model's weights."""
    cfg = _lora_config(model)
    if cfg is not None:
        from .lora.peft_io import (
            _PREFIX,
            ADAPTER_CONFIG,
            ADAPTER_WEIGHTS,
            _adapter_params,
            _model_name_or_path,
        )

        adapter = _adapter_params(model)
        targets = cfg.target_modules if isinstance(cfg.target_modules, str) else sorted(set(cfg.target_modules))
        peft = cfg.to_peft_dict(targets, base_model_name_or_path or _model_name_or_path(model), None)
        files = {ADAPTER_WEIGHTS: {_PREFIX + k: p for k, p in adapter.items()}}
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
        from .models.config import ARCHITECTURES

        d = {"architectures": [ARCHITECTURES[config.model_type]], **config.to_hf_dict()}
        texts["config.json"] = json.dumps(d, indent=2) + "\n"
    seen: dict[int, str] = {}
    for k, t in list(state.items()):  # other shared tensors: store once (safetensors refuses aliases)
        if id(t) in seen:
            del state[k]
        else:
            seen[id(t)] = k
    return "full", {MODEL_TENSORS: state}, texts


def _plain_metrics(metrics: dict | None) -> dict:
    """Metrics as numbers and strings (0-d tensors become floats): they go into the marker too."""
    out = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, np.generic):
            v = v.item()
        if not (v is None or isinstance(v, (bool, int, float, str))):
            raise TypeError(f"metric {k!r}: expected a number or string, got {type(v).__name__}")
        out[str(k)] = v
    return out


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict, where: str) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None:
        if not torch.cuda.is_available():
            warnings.warn(f"{where}: the checkpoint holds CUDA RNG states but CUDA is not available; "
                          "GPU random streams are not restored", CheckpointWarning, stacklevel=3)
        elif len(cuda) != torch.cuda.device_count():
            warnings.warn(f"{where}: {len(cuda)} CUDA RNG states saved, {torch.cuda.device_count()} devices "
                          "here; restoring the first ones", CheckpointWarning, stacklevel=3)
            for i, s in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)
        else:
            torch.cuda.set_rng_state_all(cuda)


# ---- snapshot (main thread) and write (background) -------------------------------------------


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
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pinned: dict[tuple[str, str], torch.Tensor] = {}
        self._count = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_tmp()
        _LIVE.add(self)

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
        model = _unwrap(model)
        kind, weights, texts = _model_files(model, base_model_name_or_path)
        state_tensors: dict[str, torch.Tensor] = {}
        optim_tensors: dict[str, torch.Tensor] = {}
        state = {"format": FORMAT, "version": VERSION, "step": step, "model_kind": kind,
                 "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if optimizer is not None:
            state["optimizer"] = _encode(optimizer.state_dict(), "optimizer", optim_tensors)
        components = {"scheduler": scheduler, "clipper": clipper, "scaler": scaler, "loader": loader}
        for name, obj in components.items():
            if obj is not None:
                state[name] = _encode(obj.state_dict(), name, state_tensors)
        if rng:
            state["rng"] = _encode(_rng_state(), "rng", state_tensors)
        state["metrics"] = _encode(_plain_metrics(metrics), "metrics", {})
        state["extra"] = _encode(dict(extra or {}), "extra", state_tensors)
        texts[STATE_JSON] = json.dumps(state, indent=1, allow_nan=False) + "\n"
        weights[OPTIM_TENSORS] = optim_tensors
        weights[STATE_TENSORS] = state_tensors
        job = _Job(step, final, {}, texts, state["metrics"])
        job.tensors = {f: self._snapshot(f, ts, job) for f, ts in weights.items()}
        self._count += 1
        if self.background:
            self._thread = threading.Thread(target=self._run, args=(job,), name=f"ftlib-checkpoint-{step}")
            self._thread.start()
        else:
            self._write(job)
        return final

    def wait(self) -> Path | None:
        """Join the save in flight (if any); raise its error; return the last checkpoint written."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"background checkpoint save under {self.root} failed: {err!r}") from err
        return self.last_saved

    def close(self) -> None:
        """``wait()``, then release the pinned buffers."""
        try:
            self.wait()
        finally:
            self._pinned.clear()
            _LIVE.discard(self)

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
            if hasattr(t, "full_tensor"):  # DTensor: the full value (sharded saves are ftlib.distributed's)
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

    def _run(self, job: _Job) -> None:
        try:
            self._write(job)
        except BaseException as e:  # noqa: BLE001 -- re-raised by the next wait()/save()
            self._error = e

    def _write(self, job: _Job) -> None:
        for ev in job.events:
            ev.synchronize()
        tmp = self.root / f".tmp-{job.final.name}-{os.getpid()}-{self._count}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        try:
            files = {}
            for fname, tensors in job.tensors.items():
                size, sha = _write_safetensors(tmp / fname, tensors, {"format": "pt"})
                files[fname] = {"bytes": size, "sha256": sha}
            for fname, text in job.texts.items():
                size, sha = _write_bytes(tmp / fname, text.encode())
                files[fname] = {"bytes": size, "sha256": sha}
            marker = {"format": FORMAT, "version": VERSION, "step": job.step, "metrics": job.metrics, "files": files}
            _write_bytes(tmp / MARKER, (json.dumps(marker, indent=1, allow_nan=False) + "\n").encode())
            _fsync_dir(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed save leaves nothing behind (a kill leaves .tmp-*)
            raise
        if job.final.exists():  # an earlier (maybe incomplete) save of this step: replace it
            trash = self.root / f".tmp-{job.final.name}-{os.getpid()}-{self._count}-old"
            os.replace(job.final, trash)
            os.replace(tmp, job.final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, job.final)
        _fsync_dir(self.root)
        self.last_saved = job.final
        self._rotate()

    def _rotate(self) -> None:
        if self.keep is None:
            return
        good = list_checkpoints(self.root)
        keep = {p for _, p, _ in good[-self.keep:]}
        best = self.best()
        if best is not None:
            keep.add(best)
        for _, p, _ in good:
            if p not in keep:
                shutil.rmtree(p, ignore_errors=True)

    def _remove_stale_tmp(self) -> None:
        for p in self.root.iterdir():
            m = _TMP_RE.match(p.name)
            if not (m and p.is_dir()):
                continue
            pid = int(m.group(1))
            if pid != os.getpid() and _pid_alive(pid):
                continue  # another live process is writing it
            shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_LIVE: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


@atexit.register
def _join_at_exit() -> None:
    for ck in list(_LIVE):
        try:
            ck.wait()
        except CheckpointError as e:  # nothing left to raise into: say it
            print(f"ftlib.checkpoint: {e}", flush=True)


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


# ---- load -----------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """What ``load_checkpoint`` restored: where from, the step, and the saved metrics and extra."""

    path: Path
    step: int
    metrics: dict
    extra: dict


def _load_model(model: nn.Module, path: Path, kind: str) -> None:
    has_lora = _lora_config(model) is not None
    if kind == "lora":
        if not has_lora:
            raise CheckpointError(f"{path}: holds a LoRA adapter but the model has none; apply_lora with the "
                                  "run's config first (or load the adapter alone with ftlib.lora.load_adapter)")
        from .lora import load_adapter

        try:
            load_adapter(model, path, check_base=False)
        except (ValueError, RuntimeError, FileNotFoundError) as e:
            raise CheckpointError(f"{path}: adapter does not fit the model: {e}") from None
        if (path / TRAINABLE_TENSORS).is_file():
            extra = _read_tensors(path / TRAINABLE_TENSORS)
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
    tensors = _read_tensors(path / MODEL_TENSORS)
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


def load_checkpoint(path: str | os.PathLike, *, model: nn.Module | None = None, optimizer=None, scheduler=None,
                    clipper=None, loader=None, scaler=None, rng: bool = True, verify: bool = True) -> Checkpoint:
    """Restore a checkpoint into the given objects; ``path`` is a ``step-*`` directory or a root.

    A root resolves to ``latest_checkpoint(root)`` (falling back past incomplete or corrupt
    ones, with a warning). Each object given must have been saved; objects left ``None`` are not
    restored. RNG states are restored last. Raises ``CheckpointError`` (or FileNotFoundError when
    a root holds no usable checkpoint) naming the file and what does not fit.
    """
    path = Path(path)
    if not (path / MARKER).exists() and not _STEP_RE.fullmatch(path.name):
        root = path
        path = latest_checkpoint(root)
        if path is None:
            raise FileNotFoundError(f"{root}: no complete checkpoint to resume from")
    elif verify:
        verify_checkpoint(path)
    where = str(path / STATE_JSON)
    try:
        state = json.loads((path / STATE_JSON).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: unreadable train state ({e})") from None
    if state.get("model_kind") == "sharded":
        raise CheckpointError(f"{path}: a sharded checkpoint (saved by several ranks); load it with "
                              "ftlib.distributed.load_sharded_checkpoint, on any number of processes")
    small = _read_tensors(path / STATE_TENSORS) if (path / STATE_TENSORS).is_file() else {}

    def part(name: str) -> Any:
        if name not in state:
            raise CheckpointError(f"{where}: no {name} state was saved, but a {name} was given to restore")
        return _decode(state[name], small, where)

    if model is not None:
        _load_model(_unwrap(model), path, state["model_kind"])
    if optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointError(f"{where}: no optimizer state was saved")
        optim_tensors = _read_tensors(path / OPTIM_TENSORS)
        try:
            optimizer.load_state_dict(_decode(state["optimizer"], optim_tensors, where))
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"{path / OPTIM_TENSORS}: optimizer state does not fit: {e}") from None
    for name, obj in (("scheduler", scheduler), ("clipper", clipper), ("scaler", scaler), ("loader", loader)):
        if obj is not None:
            try:
                obj.load_state_dict(part(name))
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{where}: {name} state does not fit: {e}") from None
    if rng:
        if "rng" not in state:
            raise CheckpointError(f"{where}: no RNG state was saved (saved with rng=False); pass rng=False")
        _set_rng_state(_decode(state["rng"], small, where), where)
    return Checkpoint(path=path, step=int(state["step"]), metrics=_decode(state.get("metrics", {}), None, where),
                      extra=_decode(state.get("extra", {}), small, where))
