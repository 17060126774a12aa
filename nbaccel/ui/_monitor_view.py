"""The live monitor's pieces of HTML and its ipywidgets view (imported only with ipywidgets).

Everything here is drawing: :mod:`nbaccel.ui.monitor` decides what and when. Only
widgets that ipywidgets 7.7 and 8 both have are used (``HTML``, ``FloatProgress``,
``Button``, ``HBox``/``VBox``, ``Layout``), and scrolling is plain CSS inside the HTML.

Example:
    >>> table_html([["rank", "state"], ["0", "running"]], {})[:6]
    '<table'
"""

from __future__ import annotations

import html
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

COLORS = {
    "running": "#1565c0",
    "finished": "#2e7d32",
    "idle": "#2e7d32",
    "failed": "#c62828",
    "killed": "#c62828",
    "stopped": "#ef6c00",
    "terminated": "#ef6c00",
}
_CELL = "padding:0 10px 0 0"


def fmt(value: Any) -> str:
    """A table cell: floats to 4 significant digits, None as empty."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def progress_text(progress: Mapping[str, Any]) -> str:
    """``"desc: n/total (rate unit/s)"`` of a published progress bar."""
    n, total = progress.get("n", 0), progress.get("total")
    desc = f"{progress['desc']}: " if progress.get("desc") else ""
    count = f"{n}/{total}" if total else f"{n}"
    rate = progress.get("rate")
    speed = f" ({rate:.3g} {progress.get('unit') or 'it'}/s)" if rate else ""
    return f"{desc}{count}{speed}"


def rows(status: Mapping[int, Mapping[str, Any]]) -> list[list[str]]:
    """A header row (rank, state, step, every scalar logged so far), then one row per rank."""
    names: list[str] = []
    for entry in status.values():
        names.extend(k for k in entry.get("scalars", {}) if k not in names)
    table = [["rank", "state", "step", *names]]
    for rank in sorted(status):
        entry = status[rank]
        scalars = entry.get("scalars", {})
        cells = [str(rank), str(entry.get("state", "")), fmt(entry.get("step"))]
        table.append(cells + [fmt(scalars.get(n)) for n in names])
    return table


def text_table(
    table: list[list[str]], stragglers: Mapping[int, str], progress: Mapping[str, Any]
) -> str:
    """The plain-text view: the aligned table, then stragglers and rank 0's progress."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in table
    ]
    lines += [f"straggler: rank {r} ({why})" for r, why in sorted(stragglers.items())]
    if progress:
        lines.append(f"progress (rank {progress['rank']}): {progress_text(progress)}")
    return "\n".join(lines)


def table_html(table: list[list[str]], stragglers: dict[int, str]) -> str:
    """The per-rank table; a straggler's row is highlighted and says why."""
    head = "".join(f"<th style='text-align:left;{_CELL}'>{html.escape(c)}</th>" for c in table[0])
    body = []
    for row in table[1:]:
        note = stragglers.get(int(row[0])) if row[0].isdigit() else None
        cells = []
        for i, cell in enumerate(row):
            style = _CELL
            if i == 1:
                style += f";color:{COLORS.get(cell, '#555')}"
            cells.append(f"<td style='{style}'>{html.escape(cell)}</td>")
        if note:
            cells.append(
                f"<td class='nbaccel-straggler' style='color:#b71c1c;font-weight:bold' "
                f"title='{html.escape(note)}'>&#9888; straggler: {html.escape(note)}</td>"
            )
        body.append(f"<tr>{''.join(cells)}</tr>")
    return (
        "<table style='border-collapse:collapse;font-family:monospace'>"
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    )


def log_html(lines: Iterable[tuple[str, str]], live: str | None, height_em: int = 14) -> str:
    """A scrollable box of the run's last lines (stderr in red), newest at the bottom.

    ``flex-direction: column-reverse`` keeps the box scrolled to its end when the HTML is
    replaced, without any script (the ``pre`` must not shrink, or it overflows downwards).
    """
    text = "".join(
        f"<span style='color:#b71c1c'>{html.escape(line)}</span>"
        if stream == "stderr"
        else html.escape(line)
        for stream, line in lines
    )
    if live:
        text += f"<span class='nbaccel-live-line'>{html.escape(live)}</span>\n"
    if not text:
        return ""
    return (
        f"<div class='nbaccel-log' style='max-height:{height_em}em;overflow:auto;display:flex;"
        "flex-direction:column-reverse;border:1px solid #ddd;padding:2px 4px'>"
        f"<pre style='flex:none;margin:0;font-size:12px;white-space:pre-wrap'>{text}</pre></div>"
    )


def stacks_html(stacks: dict[int, str], stragglers: Iterable[int]) -> str:
    """Each rank's current stack, stragglers first."""
    marked = set(stragglers)
    order = sorted(stacks, key=lambda r: (r not in marked, r))
    parts = []
    for rank in order:
        title = f"rank {rank}" + (" (straggler)" if rank in marked else "")
        parts.append(
            f"<details open><summary><b>{title}</b></summary>"
            f"<pre style='margin:0 0 4px 0;font-size:11px;max-height:16em;overflow:auto'>"
            f"{html.escape(stacks[rank])}</pre></details>"
        )
    return f"<div class='nbaccel-stacks'>{''.join(parts)}</div>"


def display_bundle(text: str, table: str, progress: str, svg: str | None) -> dict[str, Any]:
    """The view without ipywidgets: one output (table, progress, charts), updated in place."""
    parts = [table, f"<div>{html.escape(progress)}</div>" if progress else "", svg or ""]
    return {"text/plain": text, "text/html": "".join(parts)}


def static_bundle(
    text: str, table: list[list[str]], progress: dict[str, Any], lines: Iterable[tuple[str, str]]
) -> dict[str, Any]:
    """The widget view once its run ended, as plain outputs: table, bar's last text, log.

    ``progress["outcome"]``: how the run ended; a stopped or failed run's bar says so.
    """
    lines = list(lines)
    log = "".join(line for _, line in lines)
    outcome = progress.get("outcome", "finished")
    bar_text = progress_text(progress) + ("" if outcome == "finished" else f" ({outcome})")
    bar = f"<div>{html.escape(bar_text)}</div>" if progress else ""
    shown = [table_html(table, {}), bar, log_html(lines, None)]
    page = f"<div class='nbaccel-run-monitor nbaccel-ended'>{''.join(shown)}</div>"
    return {"text/plain": f"{text}\n{log}".rstrip("\n"), "text/html": page}


class MonitorWidgets:
    """The ipywidgets view: table, progress bar, charts, stacks button, log.

    Args:
        on_stacks: returns the HTML "where are the ranks?" shows (called on a thread).
    """

    def __init__(self, on_stacks: Callable[[], Any]) -> None:
        import ipywidgets as widgets

        self.table = widgets.HTML()
        self.bar = widgets.FloatProgress(
            value=0.0, min=0.0, max=1.0, layout=widgets.Layout(width="320px", display="none")
        )
        self.bar_label = widgets.HTML()
        self.charts = widgets.HTML()
        self.stacks_button = widgets.Button(
            description="where are the ranks?",
            tooltip="show each running rank's current Python stack",
            icon="search",
            layout=widgets.Layout(width="auto"),
        )
        self.stacks_button.on_click(lambda _b: self._ask_stacks(on_stacks))
        self.stacks = widgets.HTML()
        self.log = widgets.HTML()
        self.box = widgets.VBox(
            [
                self.table,
                widgets.HBox([self.bar, self.bar_label]),
                self.charts,
                widgets.HBox([self.stacks_button]),
                self.stacks,
                self.log,
            ],
            layout=widgets.Layout(padding="2px"),
        )
        self.box.add_class("nbaccel-run-monitor")

    def _ask_stacks(self, ask: Callable[[], str]) -> None:
        """Ask on a thread (the dumps take up to seconds); show the answer when it comes."""
        self.stacks.value = "<i>asking the running ranks for their stacks&hellip;</i>"

        def run() -> None:
            try:
                self.stacks.value = ask()
            except Exception as err:  # shown: an exception in a widget callback is lost
                self.stacks.value = f"<pre>{html.escape(repr(err))}</pre>"

        threading.Thread(target=run, name="nbaccel-monitor-stacks", daemon=True).start()

    def show_progress(self, progress: dict[str, Any], text: str) -> None:
        total = progress.get("total") or 0
        self.bar.layout.display = None
        self.bar.max = float(total or max(progress.get("n", 0), 1))
        self.bar.value = float(progress.get("n", 0))
        self.bar.bar_style = "success" if progress.get("closed") else ""
        self.bar_label.value = html.escape(text)

    def end_progress(self, outcome: str, text: str) -> None:
        """The run ended: a bar left short of its end says how (not a frozen green bar)."""
        if self.bar.layout.display == "none" or outcome == "finished":
            return
        self.bar.bar_style = "warning" if outcome == "stopped" else "danger"
        self.bar_label.value = html.escape(f"{text} ({outcome})")


__all__ = [
    "MonitorWidgets",
    "display_bundle",
    "fmt",
    "log_html",
    "progress_text",
    "rows",
    "stacks_html",
    "static_bundle",
    "table_html",
    "text_table",
]
