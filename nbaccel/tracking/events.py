"""The events channel: how code inside a training function tells the kernel what it does.

:func:`publish` is what the runtime calls (``Accelerator.log``, progress bars, the step
clock); it is a no-op until a launcher installs a sink in the worker with
:func:`install_sink`. This keeps the runtime free of any launcher import: the launcher
points down at this module, never the other way round.

Events are batched: :func:`publish` queues an event and hands the queue to the sink at
most every :data:`FLUSH_S` seconds (from the publishing call, or from one flusher
thread when nothing else is published). Logging every step then wakes the kernel about ten
times a second rather than once per step per rank, which on a small machine costs
the training more than the sending itself (bench/README.md, "monitor"). The launcher
calls :func:`flush` before it sends a job's result, so every event of a job arrives
before the job's end. Each event carries ``at``: the time it was published.

Example:
    >>> publish("log", step=3, values={"loss": 0.5})  # no sink installed: nothing happens
    >>> seen = []
    >>> install_sink(lambda kind, data: seen.append((kind, data["total"])))
    >>> publish("progress", step=10, total=100)
    >>> flush()
    >>> seen
    [('progress', 100)]
    >>> install_sink(None)
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

#: Receives ``(kind, data)``; installed by the launcher in each worker.
Sink = Callable[[str, dict[str, Any]], None]

#: Seconds an event may wait in the queue.
FLUSH_S = 0.1

_sink: Sink | None = None
_lock = threading.Lock()  # the queue and the flags below
_send_lock = threading.Lock()  # one flush at a time: events leave in the order published
_queue: list[tuple[str, dict[str, Any]]] = []
_last_flush = 0.0
_armed = False  # the flusher thread will flush within FLUSH_S
_wake = threading.Event()
_flusher: threading.Thread | None = None
_flusher_pid = 0


def install_sink(sink: Sink | None) -> None:
    """Route published events to ``sink`` (``None`` turns publishing off again).

    Also forgets any queued event, the locks and the flusher thread: after a fork the
    child calls this, and must not inherit a lock held by one of the parent's threads.
    """
    global _sink, _lock, _send_lock, _queue, _armed, _wake, _flusher
    old_wake, ours = _wake, _flusher is not None and _flusher_pid == os.getpid()
    _sink, _queue, _armed, _flusher = sink, [], False, None
    _lock, _send_lock, _wake = threading.Lock(), threading.Lock(), threading.Event()
    if ours:  # let this process's old flusher end (after a fork it does not exist here)
        old_wake.set()


def _flush_later() -> None:
    """Body of the flusher thread: flush FLUSH_S after each time it is woken."""
    wake = _wake
    while True:
        wake.wait()
        if wake is not _wake:  # install_sink replaced it: a new sink has its own thread
            return
        wake.clear()
        time.sleep(FLUSH_S)
        if wake is not _wake:
            return
        flush()


def _arm() -> None:
    """Make sure queued events leave even if nothing is published for a while.

    One thread per worker, started at the first need and woken by an ``Event``: a
    ``threading.Timer`` per batch would start a thread each time, and ``Thread.start``
    waits until the new thread runs -- milliseconds on a loaded machine, every 0.1 s.
    """
    global _flusher, _flusher_pid
    if _flusher is None or not _flusher.is_alive():
        _flusher = threading.Thread(target=_flush_later, name="nbaccel-events", daemon=True)
        _flusher_pid = os.getpid()
        _flusher.start()
    _wake.set()


def active() -> bool:
    """True when a sink is installed (inside a launched worker): publishing reaches a kernel."""
    return _sink is not None


def _plain(value: Any) -> Any:
    """0-d tensors and numpy scalars -> Python numbers, so events stay small and picklable."""
    item = getattr(value, "item", None)
    if item is not None and getattr(value, "numel", lambda: getattr(value, "size", 2))() == 1:
        try:
            return item()
        except Exception:
            return value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def publish(kind: str, **data: Any) -> None:
    """Send an event (``kind`` plus keyword data) to the launching kernel.

    Conventions used by ``LaunchHandle.status()``: a ``step`` keyword sets the
    rank's current step; a ``values`` dict (as from ``Accelerator.log``) updates
    its latest scalars. Never raises; a no-op outside a launched worker.

    Example:
        >>> publish("progress", step=10, total=100)
    """
    global _armed
    if _sink is None:
        return
    now = time.monotonic()
    event = _plain(data)
    event["at"] = time.time()
    with _lock:
        _queue.append((kind, event))
        due = now - _last_flush >= FLUSH_S
        arm = not due and not _armed  # nothing may be published for a while: flush anyway
        _armed = _armed or arm
    if due:
        flush()
    elif arm:
        _arm()


def flush() -> None:
    """Hand every queued event to the sink now (the launcher calls it before a result)."""
    global _queue, _last_flush, _armed
    with _send_lock:
        sink = _sink
        with _lock:
            queued, _queue = _queue, []
            _last_flush, _armed = time.monotonic(), False
        if sink is None:
            return
        for kind, event in queued:
            try:
                sink(kind, event)
            except Exception:  # unpicklable data: keep the event, drop the payload
                with contextlib.suppress(Exception):
                    sink(kind, {"unpicklable": True, "at": event.get("at")})


__all__ = ["FLUSH_S", "Sink", "active", "flush", "install_sink", "publish"]
