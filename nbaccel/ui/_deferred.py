"""Call a function a little later, from one reused thread: the monitor's redraw timer.

The live monitor redraws at most every ``interval`` seconds; an event inside the quiet
period asks for one redraw at its end. A ``threading.Timer`` per quiet period starts a
thread each time, and ``Thread.start`` waits until the new thread runs -- on a machine
whose cores train, a wait of milliseconds on the launcher's supervising thread, several
times a second. :class:`DeferredCall` keeps one thread that sleeps on a condition, and
lets it end after :data:`IDLE_S` seconds without work (a finished run costs nothing).

Example:
    >>> import threading
    >>> done = threading.Event()
    >>> call = DeferredCall(done.set, "example")
    >>> call.later(0.01)
    >>> done.wait(5)
    True
    >>> call.close()
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

#: Seconds the thread waits for new work before it ends (the next call starts a new one).
IDLE_S = 30.0


class DeferredCall:
    """Calls ``callback()`` once per :meth:`later`, at the earliest time asked for.

    Args:
        callback: what to call (on the thread; exceptions are swallowed).
        name: the thread's name.
    """

    def __init__(self, callback: Callable[[], Any], name: str) -> None:
        self._callback, self._name = callback, name
        self._cond = threading.Condition()
        self._due: float | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def pending(self) -> bool:
        """A call is scheduled and has not run yet."""
        return self._due is not None

    def later(self, delay: float) -> None:
        """Call ``callback`` in ``delay`` seconds (or earlier, if already scheduled so)."""
        with self._cond:
            if self._closed:
                return
            due = time.monotonic() + max(delay, 0.0)
            if self._due is not None and self._due <= due:
                return
            self._due = due
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def cancel(self) -> None:
        """Forget the scheduled call, if any."""
        with self._cond:
            self._due = None
            self._cond.notify()

    def close(self) -> None:
        """Cancel, and let the thread end."""
        with self._cond:
            self._closed, self._due = True, None
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._due is None:
                    if not self._cond.wait(IDLE_S) and self._due is None:
                        break  # idle: end; later() starts a new thread
                    continue
                wait = self._due - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                self._due = None
                self._cond.release()  # the callback takes its own locks
                try:
                    with contextlib.suppress(Exception):
                        self._callback()
                finally:
                    self._cond.acquire()
            self._thread = None


__all__ = ["IDLE_S", "DeferredCall"]
