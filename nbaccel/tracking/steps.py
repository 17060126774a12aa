"""Per-rank step time and memory, sent to the launching kernel at most twice a second.

The runtime marks the training step's phases (:func:`backward_started`,
:func:`backward_finished`, :func:`optimizer_stepped`); this module times them and
publishes one ``"system"`` event per :data:`WINDOW_S` seconds on the events channel
(:mod:`nbaccel.tracking.events`), never one per step, so the hot path costs a few
``perf_counter`` calls. Outside a launched worker (no sink installed) every mark
returns at once.

An event carries, over the steps of its window:

* ``step_time``: the median wall time between two optimizer updates;
* ``busy``: the median of that time *outside* ``accelerator.backward`` -- data
  loading, forward, optimizer and the user's own code. Under DDP a fast rank waits
  for a slow one inside the backward pass (the gradient all-reduce), so every rank
  has the same ``step_time``; ``busy`` still tells the slow rank apart (the live
  monitor marks stragglers by it);
* ``updates`` (optimizer updates so far), ``rss`` (bytes) and, once CUDA is
  initialised in the worker, ``cuda`` (bytes allocated by torch).

Example:
    >>> from nbaccel.tracking import events, steps
    >>> seen = []
    >>> events.install_sink(lambda kind, data: seen.append(kind))
    >>> clock = steps.StepClock(window=0.0)
    >>> clock.backward_started(); clock.backward_finished(); clock.optimizer_stepped(1)
    >>> events.flush(); seen
    ['system']
    >>> events.install_sink(None)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

from . import events

#: Seconds between two published windows.
WINDOW_S = 0.5


def _rss() -> int | None:
    try:
        import psutil

        return int(psutil.Process(os.getpid()).memory_info().rss)
    except Exception:
        return None


def _cuda_allocated() -> int | None:
    torch = sys.modules.get("torch")  # never import (or initialise) anything for this
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and cuda.is_initialized():
            return int(cuda.memory_allocated())
    except Exception:
        pass
    return None


class StepClock:
    """Times the steps of one process and publishes a summary per window.

    Args:
        window: seconds between two published summaries.
    """

    def __init__(self, window: float = WINDOW_S) -> None:
        self.window = window
        now = time.perf_counter()
        self._last_step = now
        self._last_sent = now
        self._backward_start: float | None = None
        self._in_backward = 0.0
        self._walls: list[float] = []
        self._busy: list[float] = []

    def backward_started(self) -> None:
        self._backward_start = time.perf_counter()

    def backward_finished(self) -> None:
        start = self._backward_start
        if start is not None:
            self._in_backward += time.perf_counter() - start
            self._backward_start = None

    def optimizer_stepped(self, updates: int) -> None:
        now = time.perf_counter()
        wall = now - self._last_step
        self._walls.append(wall)
        self._busy.append(max(wall - self._in_backward, 0.0))
        self._last_step, self._in_backward = now, 0.0
        if now - self._last_sent >= self.window:
            self._send(updates, now)

    def _send(self, updates: int, now: float) -> None:
        data: dict[str, Any] = {
            "updates": updates,
            "steps": len(self._walls),
            "step_time": statistics.median(self._walls),
            "busy": statistics.median(self._busy),
        }
        rss, cuda = _rss(), _cuda_allocated()
        if rss is not None:
            data["rss"] = rss
        if cuda is not None:
            data["cuda"] = cuda
        self._walls, self._busy, self._last_sent = [], [], now
        events.publish("system", **data)


_clock: StepClock | None = None


def _current() -> StepClock | None:
    """The process's clock, created at the first mark made inside a launched worker."""
    global _clock
    if not events.active():
        return None
    if _clock is None:
        _clock = StepClock()
    return _clock


def backward_started() -> None:
    """``accelerator.backward`` begins (the runtime calls it)."""
    clock = _current()
    if clock is not None:
        clock.backward_started()


def backward_finished() -> None:
    """``accelerator.backward`` returned."""
    clock = _current()
    if clock is not None:
        clock.backward_finished()


def optimizer_stepped(updates: int) -> None:
    """A prepared optimizer made update number ``updates``."""
    clock = _current()
    if clock is not None:
        clock.optimizer_stepped(updates)


def reset() -> None:
    """Forget the current clock (a new job in a warm worker starts a fresh one)."""
    global _clock
    _clock = None


__all__ = [
    "WINDOW_S",
    "StepClock",
    "backward_finished",
    "backward_started",
    "optimizer_stepped",
    "reset",
]
