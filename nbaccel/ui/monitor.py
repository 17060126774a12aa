"""The live view of a run: per-rank state, step, latest logged scalars and rank 0's progress.

:class:`RunMonitor` follows a :class:`~nbaccel.launcher.LaunchHandle` through its
``status()`` snapshot and ``add_listener`` events (``Accelerator.log`` and
``nbaccel.tqdm`` in the workers publish them). In a notebook kernel it is an
ipywidgets component (a table and a progress bar) that updates while the workers
train; elsewhere it renders as a plain-text table, printed at most every
``text_interval`` seconds and once when the run ends. The widget panel's output
area reuses the same component.

Example:
    >>> from nbaccel import notebook_launcher  # doctest: +SKIP
    >>> from nbaccel.monitor import watch  # doctest: +SKIP
    >>> handle = notebook_launcher(train, num_processes=2, block=False)  # doctest: +SKIP
    >>> monitor = watch(handle)  # the table appears in this cell and keeps updating  # doctest: +SKIP
    >>> handle.result()  # doctest: +SKIP
"""

from __future__ import annotations

import html
import importlib.util
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol, TextIO

from ._widgets_compat import widget_mimebundle

_TERMINAL = ("finished", "failed", "killed", "stopped", "terminated")
_COLORS = {
    "running": "#1565c0",
    "finished": "#2e7d32",
    "failed": "#c62828",
    "killed": "#c62828",
    "stopped": "#ef6c00",
    "terminated": "#ef6c00",
}


class _Handle(Protocol):
    """What the monitor needs from a ``LaunchHandle``."""

    def status(self) -> dict[int, dict[str, Any]]: ...

    def add_listener(self, callback: Any) -> Any: ...

    def remove_listener(self, callback: Any) -> None: ...


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _progress_text(progress: Mapping[str, Any]) -> str:
    n, total = progress.get("n", 0), progress.get("total")
    desc = f"{progress['desc']}: " if progress.get("desc") else ""
    count = f"{n}/{total}" if total else f"{n}"
    rate = progress.get("rate")
    speed = f" ({rate:.3g} {progress.get('unit') or 'it'}/s)" if rate else ""
    return f"{desc}{count}{speed}"


def _widgets_here() -> bool:
    from ..platform.environment import in_kernel_process

    return importlib.util.find_spec("ipywidgets") is not None and in_kernel_process()


class RunMonitor:
    """Live per-rank status of a launch, as a widget (kernel) or a text table.

    Args:
        handle: the ``LaunchHandle`` to follow (or call :meth:`attach` later).
        widget: build the ipywidgets view (default: when running in a kernel with ipywidgets).
        interval: minimum seconds between two redraws (events in between are merged).
        stream: where the text view is printed (default: ``sys.stdout`` at creation);
            ``None`` disables printing. Not used when the widget view is active.
        text_interval: minimum seconds between two printed tables while the run goes on.

    Attributes:
        widget: the ``ipywidgets.VBox`` (None without the widget view).
    """

    def __init__(
        self,
        handle: _Handle | None = None,
        *,
        widget: bool | None = None,
        interval: float = 0.25,
        stream: TextIO | bool | None = True,
        text_interval: float = 10.0,
    ) -> None:
        self.interval = interval
        self.text_interval = text_interval
        self._stream: TextIO | None = sys.stdout if stream is True else (stream or None)
        self._lock = threading.RLock()
        self._handle: _Handle | None = None
        self._status: dict[int, dict[str, Any]] = {}
        self._progress: dict[str, Any] = {}
        self._last_draw = float("-inf")
        self._last_print = float("-inf")
        self._timer: threading.Timer | None = None
        self._finished_printed = False
        self.widget: Any = None
        if _widgets_here() if widget is None else widget:
            self._build_widget()
        if handle is not None:
            self.attach(handle)

    # ------------------------------------------------------------------ wiring
    def attach(self, handle: _Handle) -> RunMonitor:
        """Follow ``handle`` (detaching from a previous one); returns ``self``."""
        self.detach()
        with self._lock:
            self._handle = handle
            self._progress = {}
            self._finished_printed = False
            handle.add_listener(self._on_event)
            self._status = handle.status()  # after add_listener: no event falls in between
            self.refresh()
        return self

    def detach(self) -> None:
        """Stop following the current handle (the view keeps its last state)."""
        with self._lock:
            handle, self._handle = self._handle, None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if handle is not None:
            handle.remove_listener(self._on_event)

    def _on_event(self, rank: int, kind: str, data: dict[str, Any]) -> None:
        """Listener (runs on the launcher's supervising thread): merge, then redraw if due."""
        with self._lock:
            handle = self._handle
            if handle is None:
                return
            self._status = handle.status()
            if kind == "progress":
                self._progress = dict(data, rank=rank)
            wait = self.interval - (time.monotonic() - self._last_draw)
            if kind == "state" or wait <= 0:
                self.refresh()
            elif self._timer is None:  # redraw once at the end of the quiet period
                self._timer = threading.Timer(wait, self._deferred)
                self._timer.daemon = True
                self._timer.start()

    def _deferred(self) -> None:
        with self._lock:
            self._timer = None
            self.refresh()

    # ------------------------------------------------------------------ reading
    @property
    def finished(self) -> bool:
        """True when every rank reached a final state."""
        return bool(self._status) and all(
            s.get("state") in _TERMINAL for s in self._status.values()
        )

    def _scalar_names(self) -> list[str]:
        names: list[str] = []
        for entry in self._status.values():
            names.extend(k for k in entry.get("scalars", {}) if k not in names)
        return names

    def rows(self) -> list[list[str]]:
        """The table: a header row, then one row per rank."""
        names = self._scalar_names()
        table = [["rank", "state", "step", *names]]
        for rank in sorted(self._status):
            entry = self._status[rank]
            scalars = entry.get("scalars", {})
            table.append(
                [
                    str(rank),
                    str(entry.get("state", "")),
                    _fmt(entry.get("step")),
                    *(_fmt(scalars.get(n)) for n in names),
                ]
            )
        return table

    def text(self) -> str:
        """The plain-text view: an aligned table plus rank 0's progress line."""
        with self._lock:
            table = self.rows()
            progress = dict(self._progress)
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in table
        ]
        if progress:
            lines.append(f"progress (rank {progress['rank']}): {_progress_text(progress)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return f"<RunMonitor\n{self.text()}\n>"

    # ------------------------------------------------------------------ drawing
    def _build_widget(self) -> None:
        import ipywidgets as widgets

        self._table = widgets.HTML()
        self._bar = widgets.FloatProgress(
            value=0.0, min=0.0, max=1.0, layout=widgets.Layout(width="320px", display="none")
        )
        self._bar_label = widgets.HTML()
        self.widget = widgets.VBox(
            [self._table, widgets.HBox([self._bar, self._bar_label])],
            layout=widgets.Layout(padding="2px"),
        )
        self.widget.add_class("nbaccel-run-monitor")

    def _html(self) -> str:
        table = self.rows()
        head = "".join(
            f"<th style='text-align:left;padding:0 10px 0 0'>{html.escape(c)}</th>"
            for c in table[0]
        )
        body = []
        for row in table[1:]:
            cells = []
            for i, cell in enumerate(row):
                style = "padding:0 10px 0 0"
                if i == 1:
                    style += f";color:{_COLORS.get(cell, '#555')}"
                cells.append(f"<td style='{style}'>{html.escape(cell)}</td>")
            body.append(f"<tr>{''.join(cells)}</tr>")
        return (
            "<table style='border-collapse:collapse;font-family:monospace'>"
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        )

    def refresh(self) -> None:
        """Redraw now (the widget, or the text view when it is due)."""
        with self._lock:
            self._last_draw = time.monotonic()
            if self.widget is not None:
                self._table.value = self._html()
                progress = self._progress
                if progress:
                    total = progress.get("total") or 0
                    self._bar.layout.display = None
                    self._bar.max = float(total or max(progress.get("n", 0), 1))
                    self._bar.value = float(progress.get("n", 0))
                    self._bar.bar_style = "success" if progress.get("closed") else ""
                    self._bar_label.value = html.escape(_progress_text(progress))
                return
            self._print_if_due()

    def _print_if_due(self) -> None:
        if self._stream is None or self._finished_printed:
            return
        now = time.monotonic()
        if self.finished:
            self._finished_printed = True
        elif now - self._last_print < self.text_interval:
            return
        self._last_print = now
        try:
            self._stream.write(self.text() + "\n")
            self._stream.flush()
        except Exception:  # a closed stream must not break the run
            pass

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

    In a kernel the widget is displayed at once; elsewhere the text table is
    printed as the run goes (see ``text_interval``). Keyword arguments go to
    :class:`RunMonitor`.
    """
    monitor = RunMonitor(handle, **kwargs)
    if monitor.widget is not None:
        from IPython.display import display

        display(monitor.widget)
    return monitor


__all__ = ["RunMonitor", "watch"]
