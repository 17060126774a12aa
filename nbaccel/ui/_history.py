"""What the live charts draw: every rank's logged values by step, in bounded memory.

The monitor feeds it every event of a run (:meth:`History.record`): ``"log"`` events
(``Accelerator.log``: ``step`` and ``values``) and ``"system"`` events (the worker's
step clock, :mod:`nbaccel.tracking.steps`: step time, time outside the backward pass,
memory). A run may log millions of steps; each series keeps at most ``limit`` points
by decimation (when full, every other point is dropped and only every second new one
is kept from then on), plus its latest point, so a chart always ends at the current
value and memory stays bounded whatever the logging rate.

Example:
    >>> history = History()
    >>> for step in range(5):
    ...     _ = history.record(0, "log", {"step": step, "values": {"loss": 1.0 / (step + 1)}})
    >>> history.metrics()
    ['loss']
    >>> history.data()["loss"][0][-1]
    (4.0, 0.2)
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

#: System charts: event field -> (chart title, scale applied to the value).
SYSTEM_CHARTS = {
    "step_time": ("step time (s)", 1.0),
    "rss": ("RSS (MiB)", 1.0 / 2**20),
    "cuda": ("CUDA memory (MiB)", 1.0 / 2**20),
}
#: How many recent step-time reports per rank the straggler rule looks at.
RECENT = 5


def _number(value: Any, *, finite: bool = True) -> float | None:
    """A plottable number; ``finite=False`` keeps NaN/inf (a diverging loss is shown)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) or not finite else None


class Series:
    """``(step, value)`` points of one metric on one rank, at most ``limit`` (+ the latest)."""

    def __init__(self, limit: int = 1000) -> None:
        self.limit = max(int(limit), 4)
        self._points: list[tuple[float, float]] = []
        self._stride = 1
        self._count = 0
        self.last: tuple[float, float] | None = None

    def add(self, step: float, value: float) -> None:
        self.last = (step, value)
        if self._count % self._stride == 0:
            self._points.append((step, value))
            if len(self._points) > self.limit:
                self._points = self._points[::2]
                self._stride *= 2
        self._count += 1

    def points(self) -> list[tuple[float, float]]:
        """The kept points, ending with the latest one."""
        if self.last is None or (self._points and self._points[-1] == self.last):
            return list(self._points)
        return [*self._points, self.last]

    def __len__(self) -> int:
        return self._count


class History:
    """Per-metric, per-rank series plus each rank's recent step times.

    Args:
        limit: points kept per series (see :class:`Series`).
    """

    def __init__(self, limit: int = 1000) -> None:
        self.limit = limit
        self._series: dict[str, dict[int, Series]] = {}
        self._system: dict[str, dict[int, Series]] = {}
        self._busy: dict[int, deque[float]] = {}
        self._log_times: dict[int, deque[float]] = {}
        self._last_log: dict[int, tuple[int, float]] = {}

    def _add(
        self, table: dict[str, dict[int, Series]], name: str, rank: int, x: float, y: float
    ) -> None:
        ranks = table.setdefault(name, {})
        series = ranks.get(rank)
        if series is None:
            series = ranks[rank] = Series(self.limit)
        series.add(x, y)

    def record(self, rank: int, kind: str, data: dict[str, Any]) -> bool:
        """Take one event; True when it added a point (the charts changed)."""
        if kind == "log":
            return self._record_log(rank, data)
        if kind == "system":
            return self._record_system(rank, data)
        return False

    def _record_log(self, rank: int, data: dict[str, Any]) -> bool:
        step = data.get("step")
        values = data.get("values")
        if not isinstance(step, int) or isinstance(step, bool) or not isinstance(values, dict):
            return False
        changed = False
        for name, raw in values.items():
            value = _number(raw, finite=False)
            if value is not None:
                self._add(self._series, str(name), rank, float(step), value)
                changed = True
        when = _number(data.get("at", data.get("time")))  # published at (events are batched)
        previous = self._last_log.get(rank)
        if when is not None:  # seconds per step between two logs: the fallback step time
            if previous is not None and step > previous[0] and when >= previous[1]:
                per_step = (when - previous[1]) / (step - previous[0])
                self._log_times.setdefault(rank, deque(maxlen=RECENT * 4)).append(per_step)
            self._last_log[rank] = (step, when)
        return changed

    def _record_system(self, rank: int, data: dict[str, Any]) -> bool:
        updates = _number(data.get("updates"))
        if updates is None:
            return False
        for field, (title, scale) in SYSTEM_CHARTS.items():
            value = _number(data.get(field))
            if value is not None:
                self._add(self._system, title, rank, updates, value * scale)
        busy = _number(data.get("busy"))
        if busy is not None:
            self._busy.setdefault(rank, deque(maxlen=RECENT)).append(busy)
        return True

    # ------------------------------------------------------------------ reading
    def metrics(self, *, system: bool = False) -> list[str]:
        """Chart names in first-seen order (``system``: also the step clock's)."""
        names = list(self._series)
        if system:
            names += list(self._system)
        return names

    def data(self, *, system: bool = False) -> dict[str, dict[int, list[tuple[float, float]]]]:
        """``{chart: {rank: [(step, value), ...]}}`` -- what the charts draw."""
        tables = [self._series, self._system] if system else [self._series]
        return {
            name: {rank: series.points() for rank, series in sorted(ranks.items())}
            for table in tables
            for name, ranks in table.items()
        }

    def step_times(self) -> tuple[str, dict[int, list[float]]]:
        """Each rank's recent step times for the straggler rule, and which kind they are.

        ``"busy"`` (time per step outside the backward pass, from the step clock) when
        any rank reported it, else ``"log interval"`` (seconds per step between two
        ``Accelerator.log`` calls).
        """
        if self._busy:
            return "busy", {rank: list(q) for rank, q in self._busy.items()}
        return "log interval", {rank: list(q)[-RECENT:] for rank, q in self._log_times.items()}


__all__ = ["RECENT", "SYSTEM_CHARTS", "History", "Series"]
