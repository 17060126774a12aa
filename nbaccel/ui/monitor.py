"""The live view of a run: per-rank state and scalars, live charts, stragglers, log.

:class:`RunMonitor` follows a :class:`~nbaccel.launcher.LaunchHandle` (or a warm
pool) through its ``status()`` snapshot and ``add_listener`` events. It shows:

* a table: each rank's state, step and latest scalars; stragglers marked (``_stragglers``),
  and "where are the ranks?" shows each running rank's Python stack (``handle.stacks()``);
* rank 0's progress bar (``nbaccel.tqdm`` or a ``tqdm.auto`` bar in the function);
* live charts of every value passed to ``Accelerator.log`` -- one per metric, step on
  the x axis, a line per rank (or the ranks' mean and spread for many ranks) -- and,
  with ``system=True``, of each rank's step time and memory; redrawn at most every
  ``chart_interval`` seconds whatever the logging rate, from bounded memory (``_history``).
  When the run ends the final charts stay in the cell as a static ``image/svg+xml``
  output, which saved notebooks, nbviewer and GitHub show;
* the run's output (what it would print in its cell): a log of the last ``log_lines``.

In a kernel with ipywidgets it is a widget; in a kernel without, one output updated in
place; elsewhere a plain-text table printed at most every ``text_interval`` seconds and
once when the run ends. The LaunchPanel reuses the same component.

Example:
    >>> from nbaccel import notebook_launcher  # doctest: +SKIP
    >>> from nbaccel.monitor import watch  # doctest: +SKIP
    >>> handle = notebook_launcher(train, num_processes=2, block=False)  # doctest: +SKIP
    >>> monitor = watch(handle)  # table, charts and log appear in this cell  # doctest: +SKIP
    >>> handle.result()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
import time
import uuid
from collections import deque
from typing import Any, TextIO

from ..launch.cell._cell_output import CellOutput
from . import _monitor_view as view
from ._chart import render_svg
from ._deferred import DeferredCall
from ._history import History
from ._runs import FinalCharts, LiveView, RunTitle, _Handle, request_id, svg_title
from ._stragglers import find_stragglers
from ._widgets_compat import widget_mimebundle

_ENDED = ("finished", "failed", "killed", "stopped", "terminated", "idle")


def _widgets_here() -> bool:
    from ..platform.environment import in_kernel_process

    return importlib.util.find_spec("ipywidgets") is not None and in_kernel_process()


class RunMonitor:
    """Live per-rank status, charts and log of a launch (see the module docstring).

    Args:
        handle: the ``LaunchHandle`` or ``WorkerPool`` to follow (or :meth:`attach` later).
        widget: build the ipywidgets view (default: in a kernel with ipywidgets).
        interval: minimum seconds between two redraws of the table (events are merged).
        stream: where the text view prints (default ``sys.stdout``); ``None``: nowhere.
        text_interval: minimum seconds between two printed tables while the run goes on.
        charts: draw charts of the logged values.
        chart_interval: minimum seconds between two chart redraws.
        lines: ``"ranks"`` (a line per rank), ``"mean"`` (mean and min-max band) or
            ``"auto"`` (per rank up to 8 ranks).
        system: also chart each rank's step time, RSS and CUDA memory.
        log_lines: how many output lines the log keeps.

    Attributes:
        widget: the ``ipywidgets.VBox`` (None without the widget view).
        final_svg: the charts left in the cell when the run ended (None before).
    """

    def __init__(
        self,
        handle: _Handle | None = None,
        *,
        widget: bool | None = None,
        interval: float = 0.25,
        stream: TextIO | bool | None = True,
        text_interval: float = 10.0,
        charts: bool = True,
        chart_interval: float = 1.0,
        lines: str = "auto",
        system: bool = False,
        log_lines: int = 500,
    ) -> None:
        if lines not in ("auto", "ranks", "mean"):
            raise ValueError(f"lines={lines!r}: choose 'auto', 'ranks' or 'mean'.")
        self.interval, self.text_interval = interval, text_interval
        self.charts, self.chart_interval, self.lines, self.system = (
            charts, chart_interval, lines, system)  # fmt: skip
        self._stream: TextIO | None = sys.stdout if stream is True else (stream or None)
        self._cell = CellOutput.here()  # the cell this monitor shows in: the final charts go there
        self._lock = threading.RLock()
        self._handle: _Handle | None = None
        self._diverted: Any = None
        self._status: dict[int, dict[str, Any]] = {}
        self._history = History()
        self._log: deque[tuple[str, str]] = deque(maxlen=max(int(log_lines), 1))
        self._live_line: str | None = None
        self._redrawn: list[tuple[str, str]] = []  # redrawn lines' last states in the log
        self._progress: dict[str, Any] = {}
        self._last_draw = self._last_print = self._last_chart = float("-inf")
        self._redraw = DeferredCall(self._deferred, "nbaccel-monitor")
        self._charts_dirty = self._ended = self._log_dirty = False
        self._display_id: str | None = None
        self._live = LiveView()  # the widget in its cell, left as plain outputs at the end
        self._final, self._runs = FinalCharts(), RunTitle()  # one chart image per monitor
        self.final_svg: str | None = None
        self.widget: Any = None
        self._view: view.MonitorWidgets | None = None
        if _widgets_here() if widget is None else widget:
            self._view = view.MonitorWidgets(self._stacks_html)
            self.widget = self._view.box
        elif stream is True and self._cell is not None:  # a kernel without ipywidgets
            self._display_id = uuid.uuid4().hex
            self._stream = None
        self._bar_drawn = (lambda: bool(self._progress)) if self._view is not None else None
        if handle is not None:
            self.attach(handle)

    # ------------------------------------------------------------------ wiring
    def attach(self, handle: _Handle) -> RunMonitor:
        """Follow ``handle`` (detaching from a previous one); returns ``self``."""
        self.detach()
        with self._lock:
            self._handle = handle
            self._new_run()
            # the values logged so far in this run (or pool call) too, under our lock
            handle.add_listener(self._on_event, replay=True)
            self._status = handle.status()  # after add_listener: no event falls in between
            self._ended = self._all_ended()
            if not self._ended:
                self._runs.begin(handle, self._bar_drawn)
            cell = getattr(handle, "cell_output", None)
            if self._view is not None and cell is not None:  # the log takes the cell's lines
                cell.set_listener(self._on_output)
                self._diverted = cell
            if self._display_id is not None and self._cell is not None:
                self._cell.display(self._bundle(), display_id=self._display_id)
            self.refresh()
        return self

    def detach(self) -> None:
        """Stop following the current handle (the view keeps its last state)."""
        with self._lock:
            handle, self._handle = self._handle, None
            diverted, self._diverted = self._diverted, None
            self._redraw.cancel()
        if diverted is not None:
            diverted.set_listener(None)
        if handle is not None:
            handle.remove_listener(self._on_event)

    def _new_run(self) -> None:
        self._history = History()
        self._log.clear()
        self._redrawn.clear()
        self._live_line, self._progress, self.final_svg = None, {}, None
        self._charts_dirty, self._log_dirty = False, True

    def _all_ended(self) -> bool:
        return bool(self._status) and all(s.get("state") in _ENDED for s in self._status.values())

    def _on_event(self, rank: int, kind: str, data: dict[str, Any]) -> None:
        """Listener (on the launcher's supervising thread): record, redraw when due."""
        with self._lock:
            if self._handle is None:
                return
            if kind == "state" and data.get("state") == "running" and self._ended:
                self._new_run()  # a pool's next call
                self._ended = False
                self._runs.begin(self._handle, self._bar_drawn)
                self._live.replace(self._cell, self._repr_mimebundle_())  # live again
            self._runs.note(data.get("state") if kind == "state" else None)
            if self._history.record(rank, kind, data):
                self._charts_dirty = True
            if kind == "progress":  # the view's bar draws it: no text bar in the log too
                self._progress, self._live_line = dict(data, rank=rank), None
                for entry in self._redrawn:  # a fast bar's lines came before its events
                    with contextlib.suppress(ValueError):
                        self._log.remove(entry)
                self._redrawn.clear()
            self._schedule(now=kind == "state")

    def _on_output(self, kind: str, stream: str, text: str) -> None:
        """Lines and progress redraws of the run (instead of the cell's output)."""
        with self._lock:
            if kind == "moved":  # the launching cell ran again (refused): show this there too
                moved = self._cell is not None and self._cell.move_to(CellOutput.here())
                if moved and self._live.shown_in is not None:
                    self._live.show(self._repr_mimebundle_())
            elif kind == "line":
                self._log.extend((stream, line) for line in text.splitlines(keepends=True))
            elif kind == "redraw" and not self._progress:  # a tqdm bar: the view's bar only
                self._live_line = text
            elif not self._progress:  # another redrawn line's last state stays (not red)
                self._live_line = None
                self._redrawn.append(("stdout", text + "\n"))  # unless a bar's, known later
                self._log.append(self._redrawn[-1])
            self._log_dirty = True
            self._schedule(now=False)

    def _schedule(self, *, now: bool) -> None:
        wait = self.interval - (time.monotonic() - self._last_draw)
        if now or wait <= 0:
            self.refresh()
        elif not self._redraw.pending:  # redraw once at the end of the quiet period
            self._redraw.later(wait)

    def _deferred(self) -> None:
        with self._lock:
            if self._handle is not None:
                self.refresh()

    # ------------------------------------------------------------------ reading
    @property
    def finished(self) -> bool:
        """True when every rank reached a final state."""
        return self._all_ended()

    @property
    def draws_progress(self) -> bool:  # the view draws the run's bar (rank 0's tqdm)
        return bool(self._progress)

    def chart_data(self) -> dict[str, dict[int, list[tuple[float, float]]]]:
        """``{metric: {rank: [(step, value), ...]}}``: what the charts draw."""
        with self._lock:
            return self._history.data(system=self.system)

    def chart_svg(self) -> str:
        """The charts as an SVG string (empty when nothing was logged)."""
        data = self.chart_data()
        title = self._runs.title(ended=self._ended)  # which run, and how it ended
        return render_svg(data, lines=self.lines, title=title) if data else ""

    def stragglers(self) -> dict[int, str]:
        """``{rank: why}`` for each running rank the straggler rule marks now."""
        with self._lock:
            kind, recent = self._history.step_times()
            running = {r for r, s in self._status.items() if s.get("state") == "running"}
        marked = find_stragglers({r: v for r, v in recent.items() if r in running})
        return {
            rank: f"{kind} {mine:.3g} s/step vs {others:.3g} s on the other ranks"
            for rank, (mine, others) in marked.items()
        }

    def stacks(self, ranks: list[int] | None = None) -> dict[int, str]:
        """Each running rank's current Python stack (``handle.stacks()``), by rank."""
        handle = self._handle
        ask = getattr(handle, "stacks", None)
        return dict(ask(ranks)) if callable(ask) else {}

    def log(self) -> str:
        """The lines the monitor's log holds (the run's output it took over)."""
        with self._lock:
            return "".join(line for _, line in self._log)

    def rows(self) -> list[list[str]]:
        """The table: a header row, then one row per rank."""
        return view.rows(self._status)

    def text(self) -> str:
        """The plain-text view: an aligned table, stragglers and rank 0's progress line."""
        with self._lock:
            table, progress = self.rows(), dict(self._progress)
        return view.text_table(table, self.stragglers(), progress)

    __str__ = text

    def __repr__(self) -> str:
        return f"<RunMonitor\n{self.text()}\n>"

    # ------------------------------------------------------------------ drawing
    def refresh(self) -> None:
        """Redraw now (charts when due), and leave the final charts in the cell at the end."""
        with self._lock:
            handle = self._handle
            if handle is not None:
                self._status = handle.status()
            self._last_draw = now = time.monotonic()
            ending = self._all_ended() and not self._ended
            late = self._ended and not ending and self._log_dirty  # lines after the end
            self._ended = self._ended or ending
            charts_due = self.charts and self._charts_dirty
            if charts_due and not ending and now - self._last_chart < self.chart_interval:
                charts_due = False
                self._redraw.later(self.chart_interval - (now - self._last_chart))
            svg = None
            if charts_due:
                svg = self.chart_svg()
                self._last_chart, self._charts_dirty = now, False
            if self._view is not None:
                self._draw_widget(svg)
            elif self._display_id is not None:
                if charts_due or ending or not self.charts:
                    self._draw_display(svg)
            else:
                self._print_if_due(ending)
            if ending:
                self._leave_final_charts()
            if ending or late:  # a worker's last lines may be read after its end: kept too
                ended = dict(self._progress, outcome=self._runs.outcome) if self._progress else {}
                frozen = view.static_bundle(self.text(), self.rows(), ended, self._log)
                self._live.replace(self._cell, frozen)  # plain outputs: saved with the notebook
                self._log_dirty = False

    def _draw_widget(self, svg: str | None) -> None:
        assert self._view is not None
        self._view.table.value = view.table_html(self.rows(), self.stragglers())
        self._view.stacks_button.layout.display = "none" if self._ended else None
        if self._progress:
            self._view.show_progress(self._progress, view.progress_text(self._progress))
            if self._ended:
                self._view.end_progress(self._runs.outcome, view.progress_text(self._progress))
        if svg is not None:
            self._view.charts.value = svg
        if self._log_dirty:  # up to log_lines lines: only rebuilt when they changed
            self._view.log.value = view.log_html(self._log, self._live_line)
            self._log_dirty = False

    def _bundle(self, svg: str | None = None) -> dict[str, Any]:
        progress = view.progress_text(self._progress) if self._progress else ""
        table = view.table_html(self.rows(), self.stragglers())
        return view.display_bundle(self.text(), table, progress, svg)

    def _draw_display(self, svg: str | None) -> None:
        if self._cell is not None and self._display_id is not None:
            self._cell.update(self._display_id, self._bundle(svg or self.chart_svg()))

    def _leave_final_charts(self) -> None:
        """The run ended: its charts stay in the cell as a static image."""
        if not self.charts:
            return
        svg = self.chart_svg()
        if not svg:
            return
        self.final_svg = svg
        if self._cell is not None:  # the image below shows them from now on, once
            if self._view is not None:
                self._view.charts.value = ""
            elif self._display_id is not None:
                self._cell.update(self._display_id, self._bundle())
            names = ", ".join(self.chart_data())
            self._final.show(self._cell, svg, f"<nbaccel charts: {names} ({svg_title(svg)})>")

    def _stacks_html(self) -> str:  # what "where are the ranks?" shows (on a thread)
        return view.stacks_html(self.stacks(), self.stragglers())

    def _print_if_due(self, ending: bool) -> None:
        if self._stream is None or (self._ended and not ending):
            return
        now = time.monotonic()
        if not ending and now - self._last_print < self.text_interval:
            return
        self._last_print = now
        try:
            self._stream.write(self.text() + "\n")
            self._stream.flush()
        except Exception:  # a closed stream must not break the run
            pass

    def _ipython_display_(self) -> None:
        """Once per cell: after ``watch()`` showed it, the cell's result adds nothing."""
        if not self._live.shown_here():
            self._live.show(self._repr_mimebundle_())

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle: dict[str, Any] = {}
        if self.widget is not None:
            bundle.update(widget_mimebundle(self.widget, **kwargs))
        bundle["text/plain"] = self.text()  # the table, not the widget's repr
        return bundle


def watch(handle: _Handle, **kwargs: Any) -> RunMonitor:
    """Show a live :class:`RunMonitor` for ``handle`` in the current cell and return it.

    ``handle`` is a ``LaunchHandle`` or a warm ``WorkerPool`` (``watch(pool)`` follows
    every call made on the pool; its ranks show "idle" between calls).

    In a kernel the view is displayed at once; elsewhere the text table is printed as
    the run goes (see ``text_interval``). Keyword arguments go to :class:`RunMonitor`
    (e.g. ``system=True`` for step-time and memory charts, ``lines="mean"``).

    Example:
        >>> monitor = watch(handle, system=True)  # doctest: +SKIP
    """
    monitor = RunMonitor(handle, **kwargs)
    if monitor.widget is not None:
        monitor._live.show(monitor._repr_mimebundle_())
    elif monitor._display_id is not None:  # shown already (attach): not again as the result
        monitor._live.shown_in = request_id(CellOutput.here())
    return monitor


__all__ = ["RunMonitor", "watch"]
