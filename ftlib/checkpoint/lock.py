"""One writer per checkpoint root: a lock file naming its holder, stale locks taken over.

Two trainers writing checkpoints under one root would rotate each other's checkpoints away
(each keeps its own newest ``keep``) and race on the same step names. A ``Checkpointer`` (one
process) or ``ShardedCheckpointer`` (rank 0 for all ranks) therefore holds ``<root>/.lock``
from construction to ``close()``:

    {"pid": 4711, "host": "node-3", "started": "2026-12-01T23:10:00+0000"}

Taking it: the file is created with ``O_CREAT | O_EXCL`` (atomic: of two processes one wins).
When it exists, its holder decides:

- same host, process gone (no such pid): stale (a killed run); it is taken over with a
  ``CheckpointWarning`` naming the dead holder;
- same host and this process, held by a ``Checkpointer`` that was closed or garbage collected:
  taken over silently;
- otherwise (a live process, or another host, whose processes cannot be checked from here): a
  ``CheckpointError`` naming the holder's pid and host and the lock file, to be deleted by hand
  if that process is known to be gone.

A takeover renames the stale file away first (``os.rename`` succeeds for one process only), so
two processes that find the same stale lock cannot both take it. The lock is released by
``close()``, when its ``Checkpointer`` is garbage collected, and at interpreter exit; a killed
process leaves it behind, stale. File locks (``flock``) are not used: they are unreliable on the
network file systems checkpoints often live on, and they say nothing about who holds them.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
import weakref
from pathlib import Path

from .format import CheckpointError, CheckpointWarning, pid_alive

__all__ = ["LOCK", "RootLock"]

LOCK = ".lock"

_HELD: dict[str, int] = {}  # lock file (real path) -> id of the RootLock of this process holding it


class RootLock:
    """The writer's lock on a checkpoint root (see the module doc); ``release()`` gives it back."""

    def __init__(self, root: str | os.PathLike):
        self.path = Path(root) / LOCK
        self._key = str(self.path.resolve())
        self._token = f"{os.getpid()}-{id(self)}-{time.monotonic_ns()}"
        self._acquire()
        _HELD[self._key] = id(self)
        self._finalizer = weakref.finalize(self, _release, self.path, self._key, id(self), self._token)

    def release(self) -> None:
        """Give the lock back (idempotent)."""
        self._finalizer()

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    def _acquire(self) -> None:
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "token": self._token}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read(self.path)
                if holder is None:  # vanished or half-written between our open and read: look again
                    time.sleep(0.05)
                    holder = _read(self.path)
                    if holder is None:
                        continue
                why = self._stale(holder)
                if why is None:
                    raise CheckpointError(
                        f"{self.path.parent}: another writer holds this checkpoint root (pid "
                        f"{holder.get('pid')} on host {holder.get('host')!r}, since {holder.get('started')}); "
                        "two trainers writing one root rotate each other's checkpoints away. Use another root, "
                        f"or delete {self.path} if that process is gone") from None
                try:  # one process wins the rename; the others look again and find the winner's lock
                    os.rename(self.path, self.path.with_name(f"{LOCK}.stale-{os.getpid()}"))
                except FileNotFoundError:
                    continue
                os.unlink(self.path.with_name(f"{LOCK}.stale-{os.getpid()}"))
                if why:
                    warnings.warn(f"{self.path}: took over a stale lock ({why})", CheckpointWarning, stacklevel=4)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
            return
        raise CheckpointError(f"{self.path}: could not take the checkpoint root's lock (it keeps changing hands)")

    def _stale(self, holder: dict) -> str | None:
        """Why ``holder`` no longer holds the lock ('' for a silent takeover), or None when it still does."""
        pid, host = holder.get("pid"), holder.get("host")
        if host != socket.gethostname() or not isinstance(pid, int):
            return None  # another host's process cannot be checked from here
        if pid == os.getpid():
            return None if self._key in _HELD else ""  # ours: held by a live RootLock of this process?
        if not pid_alive(pid):
            return f"pid {pid} on host {host!r}, which has exited"
        return None


def _read(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {"pid": None, "host": None, "started": "(unreadable lock file)"}
    return d if isinstance(d, dict) else {"pid": None, "host": None, "started": "(unreadable lock file)"}


def _release(path: Path, key: str, owner: int, token: str) -> None:
    if _HELD.get(key) == owner:
        del _HELD[key]
    holder = _read(path)
    if holder is not None and holder.get("token") == token:  # never remove a lock someone took over
        try:
            path.unlink()
        except FileNotFoundError:
            pass
