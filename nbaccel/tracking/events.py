"""The events channel: how code inside a training function tells the kernel what it does.

:func:`publish` is what the runtime calls (``Accelerator.log``, progress bars, the step
clock); it is a no-op until a launcher installs a sink in the worker with
:func:`install_sink`. This keeps the runtime free of any launcher import: the launcher
points down at this module, never the other way round.

Events are batched: :func:`publish` queues an event and hands the queue to the sink at
most every :data:`FLUSH_S` seconds (from the publishing call, or from a timer when
nothing else is published). Logging every step then wakes the kernel about ten
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
import threading
import time
from collections.abc import Callable
from typing import Any

#: Receives ``(kind, data)``; installed by the launcher in each worker.
Sink = Callable[[str, dict[str, Any]], None]

#: Seconds an event may wait in the queue.
FLUSH_S = 0.1

_sink: Sink | None = None
_lock = threading.Lock()  # the queue
_send_lock = threading.Lock()  # one flush at a time: events leave in the order published
_queue: list[tuple[str, dict[str, Any]]] = []
_last_flush = 0.0
_timer: threading.Timer | None = None


def install_sink(sink: Sink | None) -> None:
    """Route published events to ``sink`` (``None`` turns publishing off again).

    Also forgets any queued event and the queue's lock: after a fork the child calls
    this, and must not inherit a lock held by one of the parent's threads.
    """
    global _sink, _lock, _send_lock, _queue, _timer
    _sink, _queue, _timer = sink, [], None
    _lock, _send_lock = threading.Lock(), threading.Lock()


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
    global _timer
    if _sink is None:
        return
    now = time.monotonic()
    event = _plain(data)
    event["at"] = time.time()
    with _lock:
        _queue.append((kind, event))
        due = now - _last_flush >= FLUSH_S
        if not due and _timer is None:  # nothing may publish for a while: flush anyway
            _timer = threading.Timer(FLUSH_S, flush)
            _timer.daemon = True
            _timer.start()
    if due:
        flush()


def flush() -> None:
    """Hand every queued event to the sink now (the launcher calls it before a result)."""
    global _queue, _last_flush, _timer
    with _send_lock:
        sink = _sink
        with _lock:
            queued, _queue = _queue, []
            _last_flush = time.monotonic()
            timer, _timer = _timer, None
        if timer is not None:
            timer.cancel()
        if sink is None:
            return
        for kind, event in queued:
            try:
                sink(kind, event)
            except Exception:  # unpicklable data: keep the event, drop the payload
                with contextlib.suppress(Exception):
                    sink(kind, {"unpicklable": True, "at": event.get("at")})


__all__ = ["FLUSH_S", "Sink", "active", "flush", "install_sink", "publish"]
