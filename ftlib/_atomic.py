"""Atomic file writes: every file ftlib writes appears whole under its final name or not at all.

``write(tmp)`` fills a temporary file beside the target, the data is flushed to disk (fsync),
and ``os.replace`` renames it over the target, which POSIX makes atomic: a reader sees the old
file or the new one, and a crash leaves at most a stray ``.<name>.tmp-<pid>`` that is never
taken for the real file. Without the fsync a crash just after the rename can leave an empty file
under the final name on some file systems.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write"]


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` to fill a temporary file, fsync it, then rename it onto ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
