"""At most one checkpoint write in flight, off the training path; its error raised by the next call.

Both checkpointers snapshot the state on the calling thread (so training may change it right
after ``save`` returns) and hand the writing to a ``BackgroundWriter``: ``submit`` joins the
previous write first, ``wait`` joins the one in flight, and an exception raised in the thread is
raised again (as ``CheckpointError``, chained) by the next ``submit`` or ``wait``, once. Writers
still open at interpreter exit are joined then, and a failure is printed (nothing is left to raise
into).
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable

from .format import CheckpointError

__all__ = ["BackgroundWriter"]


class BackgroundWriter:
    """Runs one write at a time in a thread; ``what`` names the writer in errors (e.g. its root)."""

    def __init__(self, what: str):
        self.what = what
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        _LIVE.add(self)

    def submit(self, write: Callable[[], None], name: str) -> None:
        """``wait()``, then run ``write()`` in a new thread called ``name``."""
        self.wait()
        _LIVE.add(self)
        self._thread = threading.Thread(target=self._run, args=(write,), name=name)
        self._thread.start()

    def wait(self) -> None:
        """Join the write in flight (if any) and raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"background checkpoint save under {self.what} failed: {err!r}") from err

    def close(self) -> None:
        """``wait()``; the writer is no longer joined at exit."""
        try:
            self.wait()
        finally:
            _LIVE.discard(self)

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as e:  # noqa: BLE001 -- raised again by the next wait()/submit()
            self._error = e


_LIVE: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()


@atexit.register
def _join_at_exit() -> None:
    for w in list(_LIVE):
        try:
            w.wait()
        except CheckpointError as e:  # nothing left to raise into: say it
            print(f"ftlib.checkpoint: {e}", flush=True)
