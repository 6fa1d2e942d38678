"""Checking a checkpoint against its marker, and finding the newest good one under a root.

A step directory passes when its marker is valid (format, version, and the step the directory is
named for), every file the marker lists exists with its recorded byte size and (``full``)
SHA-256, and ``state.json`` parses. Files the marker does not list (copied in after the save)
are not part of the checkpoint: ``unlisted_files`` names them, and loading ignores them with a
``CheckpointWarning`` (the tokenizer files ftlib's scripts put beside the adapter, ``SERVING_FILES``,
are ignored without one).

``verify_checkpoint`` checks one directory in this process. ``verify_shared`` is the same check
shared out among the ranks of a torch.distributed job (rank r hashes every W-th file of the
marker, sizes are checked by all) with one verdict for all; it is collective. A root resolves to
its newest step directory that passes, each newer failing one skipped with a warning naming it
and why.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from .._dist import all_gather_json, get_rank, get_world_size
from .format import (
    MARKER,
    CheckpointError,
    CheckpointWarning,
    read_marker,
    read_state,
    sha256_file,
    step_dirs,
)

__all__ = ["latest_checkpoint", "unlisted_files", "verify_checkpoint", "verify_shared"]


def _check(path: Path, marker: dict, full: bool, rank: int = 0, world: int = 1) -> None:
    for i, (name, rec) in enumerate(sorted(marker["files"].items())):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        size = f.stat().st_size
        if size != rec["bytes"]:
            raise CheckpointError(f"{f}: {size} bytes, the marker records {rec['bytes']} (truncated or replaced)")
        if full and i % world == rank and sha256_file(f) != rec["sha256"]:
            raise CheckpointError(f"{f}: SHA-256 differs from the marker's (corrupt)")
    read_state(path)


def verify_checkpoint(path: str | os.PathLike, *, full: bool = True) -> dict:
    """Check ``path`` against its marker; return the marker, or raise ``CheckpointError`` saying why.

    Every file the marker lists must exist with its recorded size and (``full=True``) SHA-256,
    and ``state.json`` must parse. ``full=False`` checks sizes only (no read of the tensors).
    """
    path = Path(path)
    marker = read_marker(path)
    _check(path, marker, full)
    return marker


def verify_shared(path: str | os.PathLike, *, full: bool = True, group=None) -> str | None:
    """None if ``path`` passes, else why; the hashing is shared among the ranks of ``group``. Collective."""
    path = Path(path)
    error = None
    try:
        _check(path, read_marker(path), full, get_rank(group), get_world_size(group))
    except CheckpointError as e:
        error = str(e)
    except OSError as e:
        error = f"{path}: unreadable ({e})"
    errors = [e for e in all_gather_json(error, group) if e]
    return errors[0] if errors else None


def unlisted_files(path: str | os.PathLike, marker: dict) -> list[str]:
    """Files under ``path`` (relative, ``/``-separated) that its marker does not list: not part of the checkpoint."""
    path = Path(path)
    listed = set(marker["files"]) | {MARKER}
    out = []
    for f in sorted(path.rglob("*")):
        rel = f.relative_to(path).as_posix()
        if f.is_file() and rel not in listed:
            out.append(rel)
    return out


def latest_checkpoint(root: str | os.PathLike, *, full: bool = True) -> Path | None:
    """The newest checkpoint under ``root`` that passes ``verify_checkpoint``, or None.

    Each newer one that fails is skipped with a ``CheckpointWarning`` naming it and the reason.
    """
    for _, p in reversed(step_dirs(root)):
        try:
            verify_checkpoint(p, full=full)
        except CheckpointError as e:
            warnings.warn(f"skipping checkpoint {p}: {e}; falling back to an earlier one", CheckpointWarning,
                          stacklevel=2)
            continue
        return p
    return None
