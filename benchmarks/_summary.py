"""One headline number per line, appended to ``$FTLIB_SUMMARY`` the moment it is measured.

``gpu_check.sh`` points ``FTLIB_SUMMARY`` at ``OUT/summary.txt``: each line is written, flushed and
fsynced on its own, so a run cut at any point (a step at its limit, the lease ending) leaves a file
whose every line is true. Without the variable the line is only printed.
"""

from __future__ import annotations

import os


def summary(line: str) -> None:
    """Print ``line`` and append it to ``$FTLIB_SUMMARY`` (when set) as one flushed, fsynced write."""
    print(f"summary: {line}", flush=True)
    path = os.environ.get("FTLIB_SUMMARY")
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line.rstrip("\n") + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def append_row(path: str, header: list[str], row: list) -> None:
    """Append one CSV row to ``path`` (the header first when the file is new), flushed at once: a
    benchmark killed after a case keeps that case's row."""
    import csv

    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(header)
        w.writerow(row)
        f.flush()
        os.fsync(f.fileno())
