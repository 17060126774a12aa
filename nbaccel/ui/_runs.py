"""Which run a monitor shows, and how it ended: for the charts' title and the bar's colour.

A monitor follows one ``LaunchHandle``, or a pool call after call; each run gets a number,
the label of what runs (``"notebook_launcher(train)"``, ``"pool.call(train)"``) and its
start time, and ends "finished", "stopped" (``handle.stop()``) or "failed".

Example:
    >>> runs = RunTitle()
    >>> runs.title(ended=False)
    ''
"""

from __future__ import annotations

import html
import re
import time
import uuid
from typing import Any, Protocol


class _Handle(Protocol):
    """What the monitor needs from a ``LaunchHandle`` (or a ``WorkerPool``)."""

    def status(self) -> dict[int, dict[str, Any]]: ...

    def add_listener(self, callback: Any, *, replay: bool = False) -> Any: ...

    def remove_listener(self, callback: Any) -> None: ...


class RunTitle:
    """The run being shown (see the module docstring)."""

    def __init__(self) -> None:
        self.count = 0
        self.outcome = "finished"
        self._text = ""
        self._run: Any = None

    def begin(self, followed: Any, bar_drawn: Any = None) -> None:
        """A run begins on ``followed`` (a ``LaunchHandle``, or a pool: its current call).

        ``bar_drawn``: returns True once the monitor draws the run's progress bar; a pool
        call's own cell then draws none (a bar is drawn once).
        """
        run = getattr(followed, "_handle", None) or followed
        cell = getattr(run, "cell_output", None)
        if bar_drawn is not None and cell is not None and run is not followed:
            cell.hide_bars = bar_drawn
        self.count += 1
        self._run, self.outcome = run, "finished"
        label = getattr(run, "label", None) or "pool call"
        started = time.strftime("%H:%M:%S", time.localtime(getattr(run, "started", time.time())))
        self._text = f"run {self.count}: {label}, started {started}"

    def note(self, state: Any) -> None:
        """A rank's new state: how the run ends (a stop wins over the failures it causes)."""
        if state is None:
            return
        stop = getattr(self._run, "stop_requested", None)
        if state == "stopped" or (stop is not None and stop.is_set()):
            self.outcome = "stopped"
        elif state in ("failed", "killed", "terminated") and self.outcome != "stopped":
            self.outcome = "failed"

    def title(self, *, ended: bool) -> str:
        """ "run 2: notebook_launcher(train), started 13:42:05, failed" ("" before a run)."""
        if not self._text:
            return ""
        return f"{self._text}, {self.outcome if ended else 'running'}"


class FinalCharts:
    """The image of the charts a monitor leaves in its cell: one per monitor, each run's
    replacing the last one's (``update_display_data``), so charts never pile up."""

    def __init__(self) -> None:
        self._id = uuid.uuid4().hex
        self._shown = False

    def show(self, cell: Any, svg: str, text: str) -> None:
        bundle = {"image/svg+xml": svg, "text/plain": text}
        if self._shown:
            cell.update(self._id, bundle)
        else:
            cell.display(bundle, display_id=self._id)
            self._shown = True


class LiveView:
    """The monitor's widget in its cell, shown under a display id: live while a run goes,
    replaced by a static copy (table, bar, log as HTML and text) when the run ends, so a
    saved and reopened notebook shows it without kernel or widget state; brought back
    live when the monitor follows another run (a pool's next call)."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex
        self.shown_in: str | None = None  # the request (cell execution) it was shown in

    def show(self, bundle: dict[str, Any]) -> None:
        """Display ``bundle`` (the widget's) in the cell being executed now."""
        from IPython.display import display

        from ..launch.cell._cell_output import CellOutput

        display(bundle, raw=True, display_id=self.id)
        self.shown_in = request_id(CellOutput.here())

    def shown_here(self) -> bool:
        """Already shown in the cell being executed now (``watch()`` as its last line)."""
        from ..launch.cell._cell_output import CellOutput

        return self.shown_in is not None and request_id(CellOutput.here()) == self.shown_in

    def replace(self, cell: Any, bundle: dict[str, Any]) -> None:
        """Show ``bundle`` instead, wherever the view was shown (``cell``: a CellOutput)."""
        if self.shown_in is not None and cell is not None:
            cell.update(self.id, bundle)


def svg_title(svg: str) -> str:
    """The title :func:`~nbaccel.ui._chart.render_svg` wrote into ``svg`` ("" if none)."""
    found = re.search(r'<text class="nbaccel-title"[^>]*>([^<]*)</text>', svg)
    return html.unescape(found.group(1)) if found else ""


def request_id(cell: Any) -> str | None:
    """The id of the request (cell execution) ``cell`` (a ``CellOutput``) belongs to."""
    return None if cell is None else str(cell.parent.get("header", {}).get("msg_id", ""))


__all__ = ["FinalCharts", "LiveView", "RunTitle", "request_id", "svg_title"]
