"""The launch panel's parts: one control per LaunchConfig field, sized so nothing is cut
off, and the file-like sink that shows the workers' lines in an ``Output`` widget.

Widths: every control of the panel is as wide as its longest label plus its widest
choice (in ``ch``, the width of a digit, which covers the average letter of the
widget's font), so "fsdp reshard after forward" and "SHARDED_STATE_DICT" show whole at
the default width (they were cut to "fsdp reshard after f..." and "SHARDED_STATE_DI").
Only widgets and layout keys that ipywidgets 7.7 and 8 both have are used.

Example:
    >>> LABEL_CH >= len("fsdp cpu ram efficient loading")
    True
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets

from ..config import (
    INT_MINIMUMS,
    MAX_PORT,
    field_help,
    field_kind,
    field_names,
    field_optional,
)
from ..platform.hardware import Hardware, precision_choices
from ._widgets_compat import tooltip_kwargs

_INT_MAXIMUMS = {
    "master_port": MAX_PORT,
    "fsdp_min_num_params": 10**15,
    "deepspeed_zero_stage": 3,
}  # others: effectively unbounded, kept sane for typing
_SANE_MAX = 4096


def label(name: str) -> str:
    """A field's label: ``fsdp_cpu_offload`` -> ``fsdp cpu offload``."""
    if name == "deepspeed_gradient_clipping":  # a norm, not seconds
        return "deepspeed gradient clipping (0 = off)"
    if field_kind(name)[0] is float:  # timeout; 0 means "no timeout"
        return f"{name.replace('_', ' ')} (s, 0 = none)"
    return name.replace("_", " ")


def _widest_choice() -> int:
    return max((len(str(c)) for n in field_names() for c in field_kind(n)[1] or ()), default=8)


LABEL_CH = max(len(label(name)) for name in field_names()) + 2
#: room for the widest dropdown value plus the dropdown's arrow, and for numbers
VALUE_CH = max(_widest_choice(), 12) + 6


def make_control(name: str, value: Any, *, hardware: Hardware | None = None) -> widgets.ValueWidget:
    """The widget for one LaunchConfig field (dropdown, checkbox, number or text).

    ``hardware``: offer only the precisions its GPUs run natively (a T4: no bf16).
    """
    kind, choices = field_kind(name)
    if name == "mixed_precision" and choices and hardware is not None:
        choices = precision_choices(hardware, choices, value)
    common: dict[str, Any] = {
        "description": label(name),
        **tooltip_kwargs(field_help().get(name, "")),  # ipywidgets 7: description_tooltip
        "style": {"description_width": f"{LABEL_CH}ch"},
        "layout": widgets.Layout(width=f"{LABEL_CH + VALUE_CH}ch"),
    }
    if choices:
        return widgets.Dropdown(options=list(choices), value=value, **common)
    if kind is bool:
        return widgets.Checkbox(value=bool(value), indent=True, **common)
    if kind is int:
        minimum = INT_MINIMUMS.get(name, 0)
        maximum = _INT_MAXIMUMS.get(name, _SANE_MAX)
        if name == "cpus_per_rank":  # 0 shown for None: each node's cores / its ranks
            minimum, value = 0, value or 0
        if value is None:  # master_port: shown only for several nodes, where it is required
            value = 29500
        return widgets.BoundedIntText(value=value, min=minimum, max=maximum, **common)
    if kind is float:
        return widgets.BoundedFloatText(value=value or 0.0, min=0.0, max=1e7, **common)
    placeholder = "all" if name == "gpu_ids" else "none"
    return widgets.Text(value=value or "", placeholder=placeholder, **common)


def field_value(name: str, value: Any) -> Any:
    """A control's value as its LaunchConfig field takes it: for an optional field an
    empty text, 0 seconds, or 0 CPUs per rank, is None."""
    kind, choices = field_kind(name)
    if field_optional(name) and kind is str and not choices:
        return (value or "").strip() or None
    return (value or None) if field_optional(name) and kind in (int, float) else value


class OutputSink:
    """A file-like object that shows what is written to it in an ``Output`` widget.

    The launcher writes the workers' lines here (``output=`` of ``notebook_launcher``),
    from its forwarding thread. Carriage returns redraw the last line, so text
    progress bars update in place; only the last ``max_lines`` lines are kept.

    Args:
        output: the ``Output`` widget.
        max_lines: how many lines it keeps.
        hide_bars: when it returns True, a progress bar's redraws (``redraw``) are not
            shown: the panel's monitor draws that bar already (a bar is drawn once).
    """

    def __init__(
        self,
        output: widgets.Output,
        max_lines: int = 1000,
        *,
        hide_bars: Callable[[], bool] | None = None,
    ) -> None:
        self.output = output
        self.max_lines = max_lines
        self.hide_bars = hide_bars
        self._lines: list[str] = [""]
        self._live: dict[int, str] = {}  # rank -> its bar's current state, below the lines
        self._return = False
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            for piece in re.split(r"(\r\n|\r|\n)", text):
                if piece in ("\n", "\r\n"):
                    self._lines.append("")
                    self._return = False
                elif piece == "\r":
                    self._return = True  # the next text overwrites this line (a redraw)
                elif piece:
                    if self._return:
                        self._lines[-1], self._return = "", False
                    self._lines[-1] += piece
            self._show()
        return len(text)

    def redraw(self, rank: int, text: str, done: bool) -> None:
        """A progress bar of ``rank`` drawn again in place (``done``: its last state, kept
        as a line); nothing while ``hide_bars()`` says the monitor draws it."""
        with self._lock:
            self._live.pop(rank, None)
            if self.hide_bars is not None and self.hide_bars():
                pass
            elif done:
                self._lines.insert(len(self._lines) - 1, text)
            else:
                self._live[rank] = text
            self._show()

    def _show(self) -> None:
        if self._live and self.hide_bars is not None and self.hide_bars():
            self._live.clear()  # drawn before the monitor knew the bar
        del self._lines[: -self.max_lines]
        self.output.outputs = ({"output_type": "stream", "name": "stdout",
                                "text": self.getvalue()},)  # fmt: skip

    def flush(self) -> None:
        pass

    def clear(self) -> None:
        with self._lock:
            self._lines, self._live, self._return = [""], {}, False
            self.output.outputs = ()

    def getvalue(self) -> str:
        shown = "\n".join(self._lines)
        if self._live:
            gap = "\n" if shown and not shown.endswith("\n") else ""
            shown += gap + "\n".join(self._live.values())
        return shown


__all__ = [
    "LABEL_CH",
    "VALUE_CH",
    "OutputSink",
    "field_value",
    "label",
    "make_control",
]
