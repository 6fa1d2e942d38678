"""The checkpoint format, written once for both kinds: names, marker, strict JSON, streamed safetensors,
fsync + SHA-256, and the life cycle of a step directory (temporary name, finalize, rotate).

One-process (``ftlib.checkpoint.Checkpointer``) and sharded (``ftlib.distributed.ShardedCheckpointer``)
checkpoints share all of it; only which files hold the weights differs (see ``local`` and
``sharded``).

Names. ``<root>/step-XXXXXXXX/`` (eight digits at least, so names sort by step). ``state.json``
holds the train state as strict JSON, ``state.safetensors`` its tensors; ``COMPLETE`` (the
marker) is written last and records the format, version, step, metrics and the byte size and
SHA-256 of every other file of the directory. A directory without a valid marker is never
resumed from.

Strict JSON. ``encode`` turns a state into JSON-able values, moving every tensor out into a
``{path: tensor}`` dict (stored in safetensors) and leaving ``{"__tensor__": path}`` behind;
non-finite floats, tuples, dicts with non-string keys, NumPy arrays and torch dtypes get tagged
forms (``__float__``, ``__tuple__``, ``__items__``, ``__ndarray__``, ``__dtype__``). ``decode``
inverts it: decode(json(encode(x))) == x. No pickle anywhere.

Safetensors (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian
header length N, N bytes of JSON header (``{name: {dtype, shape, data_offsets}}``, padded with
spaces to a multiple of 8), then the raw bytes of each tensor in order. ``write_safetensors``
writes the tensors one by one from their own memory (no serialised copy) and hashes as it goes.

Life cycle. A save fills ``<root>/.tmp-step-XXXXXXXX-<pid>-<n>/`` (``tmp_dir``), fsyncs every
file, writes and fsyncs the marker, then ``finalize`` fsyncs the directory, renames it to
``step-XXXXXXXX`` (atomic on POSIX; an earlier directory of the same step is replaced) and
fsyncs the root. A crash leaves a finished directory or a ``.tmp-*`` one, which
``remove_stale_tmp`` deletes once its process is gone. ``rotate`` keeps the newest ``keep``
good checkpoints and the best by a metric, and deletes the other good ones; a symlinked step
directory is unlinked (what it points to is not deleted), and step links left dangling are
removed. Directories that fail their marker are left for inspection.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "FORMAT",
    "MARKER",
    "MODEL_TENSORS",
    "OPTIM_TENSORS",
    "SERVING_FILES",
    "SHARDS",
    "STATE_JSON",
    "STATE_TENSORS",
    "TRAINABLE_TENSORS",
    "VERSION",
    "best_checkpoint",
    "decode",
    "encode",
    "file_record",
    "finalize",
    "fsync_dir",
    "list_checkpoints",
    "pid_alive",
    "plain_metrics",
    "read_marker",
    "read_state",
    "read_tensors",
    "remove_stale_tmp",
    "rng_state",
    "rotate",
    "set_rng_state",
    "sha256_file",
    "step_dir_name",
    "step_dirs",
    "step_of_name",
    "tmp_dir",
    "write_bytes",
    "write_marker",
    "write_safetensors",
]

MARKER = "COMPLETE"
FORMAT = "ftlib-checkpoint"
VERSION = 1
STATE_JSON = "state.json"
STATE_TENSORS = "state.safetensors"
OPTIM_TENSORS = "optimizer.safetensors"
MODEL_TENSORS = "model.safetensors"
TRAINABLE_TENSORS = "trainable.safetensors"
SHARDS = "shards"
# Written beside a checkpoint's adapter after the save, so the folder serves as it is (the training
# scripts' ftlib.train.copy_tokenizer_files): unlisted by design, never read by a load, never warned about.
SERVING_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_STEP_RE = re.compile(r"step-(\d{8,})")
_TMP_RE = re.compile(r"\.tmp-step-\d+-(\d+)(-\d+)*")


class CheckpointError(RuntimeError):
    """A checkpoint directory that is incomplete, corrupt, or does not fit what it is loaded into."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (incomplete or corrupt), or a part of it was not used as saved."""


# ---- names ----------------------------------------------------------------------------------


def step_dir_name(step: int) -> str:
    """``step-00001200``: eight digits at least, so names sort by step."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return f"step-{step:08d}"


def step_of_name(name: str) -> int | None:
    """The step a ``step-XXXXXXXX`` directory name stands for; None for any other name."""
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def step_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-*`` directory (or link to one) under ``root``, by step."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(s, p) for p in root.iterdir() if (s := step_of_name(p.name)) is not None and p.is_dir()]
    return sorted(out)


def tmp_dir(root: Path, final: Path, pid: int, count: int) -> Path:
    """The temporary directory a save of ``final`` fills: ``.tmp-<final name>-<pid>-<count>``."""
    return root / f".tmp-{final.name}-{pid}-{count}"


# ---- strict JSON + tensors ------------------------------------------------------------------


def encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
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
            data = [encode(v, path, tensors) for v in data]
        return {"__ndarray__": obj.dtype.str, "shape": list(obj.shape), "data": data}
    if isinstance(obj, np.generic):
        return encode(obj.item(), path, tensors)
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, f"{path}.{k}", tensors) for k, v in obj.items()}
        return {"__items__": [[encode(k, f"{path}.key{i}", tensors), encode(v, f"{path}.{k}", tensors)]
                              for i, (k, v) in enumerate(obj.items())]}
    raise TypeError(f"checkpoint state at {path!r}: cannot store a {type(obj).__name__} without pickle "
                    "(use tensors, numbers, strings, lists, tuples and dicts)")


def decode(obj: Any, tensors: dict[str, torch.Tensor] | None, where: str) -> Any:
    """Inverse of ``encode``; ``tensors`` holds the referenced tensors, ``where`` names the file in errors."""
    if isinstance(obj, list):
        return [decode(v, tensors, where) for v in obj]
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
        return tuple(decode(v, tensors, where) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {decode(k, tensors, where): decode(v, tensors, where) for k, v in obj["__items__"]}
    if "__ndarray__" in obj:
        data = [decode(v, tensors, where) for v in obj["data"]]
        return np.asarray(data, dtype=np.dtype(obj["__ndarray__"])).reshape(obj["shape"])
    if "__dtype__" in obj:
        return getattr(torch, obj["__dtype__"])
    return {k: decode(v, tensors, where) for k, v in obj.items()}


# ---- files: streamed safetensors, fsync, hashes ---------------------------------------------

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes, no copy


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> tuple[int, str]:
    """Write a safetensors file tensor by tensor (no serialised copy in memory), fsynced; return (bytes, sha256).

    The tensors must be contiguous CPU tensors.
    """
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


def write_bytes(path: Path, data: bytes) -> tuple[int, str]:
    """Write ``data`` to ``path`` and fsync it; return (bytes, sha256)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data), hashlib.sha256(data).hexdigest()


def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries: a rename into it survives a crash); a no-op where impossible."""
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


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes (read in 16 MiB chunks)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def file_record(path: Path) -> dict:
    """The marker's record of an existing file: ``{"bytes": size, "sha256": hash}``."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; a malformed file raises ``CheckpointError`` naming it."""
    from ..models import SafetensorsReader

    try:
        with SafetensorsReader(path) as r:
            return {k: r.read(k) for k in r.keys()}
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def read_state(path: Path) -> dict:
    """``<path>/state.json`` parsed; unreadable or not JSON raises ``CheckpointError`` naming the file."""
    try:
        state = json.loads((path / STATE_JSON).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / STATE_JSON}: unreadable train state ({e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / STATE_JSON}: unreadable train state (not a JSON object)")
    return state


# ---- the marker -----------------------------------------------------------------------------


def write_marker(directory: Path, step: int, metrics: dict, files: dict[str, dict]) -> None:
    """Write and fsync the marker of a filled directory (last, after every file it records)."""
    marker = {"format": FORMAT, "version": VERSION, "step": step, "metrics": metrics,
              "files": dict(sorted(files.items()))}
    write_bytes(directory / MARKER, (json.dumps(marker, indent=1, allow_nan=False) + "\n").encode())


def read_marker(path: Path) -> dict:
    """The marker of step directory ``path``; ``CheckpointError`` if it is missing, corrupt or of another format.

    A directory named ``step-N`` whose marker records another step was copied or renamed from
    another checkpoint; it is refused too (its optimizer, schedule and loader state are step's).
    """
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
    named = step_of_name(path.name)
    if named is not None and named != marker.get("step"):
        raise CheckpointError(f"{path}: the directory is named for step {named} but its marker records step "
                              f"{marker.get('step')} (copied or renamed from another checkpoint); load it under "
                              f"its own name {step_dir_name(int(marker.get('step') or 0))} or by a path not "
                              "named step-*")
    return marker


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path, dict]]:
    """``(step, path, metrics)`` of every checkpoint under ``root`` with a valid marker, by step.

    Only the marker is read (cheap); ``verify_checkpoint`` checks the files.
    """
    out = []
    for step, p in step_dirs(root):
        try:
            marker = read_marker(p)
        except CheckpointError:
            continue
        out.append((step, p, marker.get("metrics") or {}))
    return out


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


# ---- directory life cycle -------------------------------------------------------------------


def finalize(tmp: Path, final: Path) -> None:
    """fsync the filled ``tmp`` and rename it to ``final`` (replacing an earlier save of the step); fsync the root."""
    fsync_dir(tmp)
    root = final.parent
    if final.is_symlink():  # a linked step directory: the link goes, what it points to stays
        final.unlink()
    if final.exists():  # an earlier (maybe incomplete) save of this step: replace it
        trash = root / f"{tmp.name}-old"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)


def _remove_step_dir(p: Path) -> None:
    if p.is_symlink():
        p.unlink()  # never delete what a link points to (it may lie outside the root)
    else:
        shutil.rmtree(p, ignore_errors=True)


def rotate(root: Path, keep: int | None, metric: str | None = None, mode: str = "min") -> list[Path]:
    """Keep the newest ``keep`` good checkpoints and the best by ``metric``; delete the other good ones.

    A symlinked step directory is removed as a link; afterwards every ``step-*`` link whose
    target is gone is removed too. Returns what was removed.
    """
    removed: list[Path] = []
    if keep is not None:
        good = list_checkpoints(root)
        kept = {p for _, p, _ in good[-keep:]}
        best = None if metric is None else best_checkpoint(root, metric, mode)
        if best is not None:
            kept.add(best)
        for _, p, _ in good:
            if p not in kept:
                _remove_step_dir(p)
                removed.append(p)
    for p in root.iterdir():
        if step_of_name(p.name) is not None and p.is_symlink() and not p.exists():
            p.unlink()  # dangling: its target was rotated away (or removed by hand)
            removed.append(p)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_tmp(root: Path) -> None:
    """Delete ``.tmp-*`` directories under ``root`` left by processes that are gone (or by this one)."""
    for p in root.iterdir():
        m = _TMP_RE.match(p.name)
        if not (m and p.is_dir()):
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and pid_alive(pid):
            continue  # another live process is writing it
        shutil.rmtree(p, ignore_errors=True)


# ---- train-state parts that are not weights ---------------------------------------------------


def plain_metrics(metrics: dict | None) -> dict:
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


def rng_state() -> dict:
    """The Python, NumPy (legacy global), torch CPU and (when initialised) CUDA RNG states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, where: str) -> None:
    """Restore what ``rng_state`` returned; CUDA states that do not fit this machine warn (``CheckpointWarning``)."""
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
