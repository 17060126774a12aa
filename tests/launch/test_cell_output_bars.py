"""A progress bar a cell drew before the live monitor took its output is not left beside the
monitor's own (the slow-machine rehearsal of 02c891e: rank 0's first bar reached the cell
before ``watch(handle)`` ran, and stayed there at 1/10 under the monitor's finished bar)."""

from __future__ import annotations

from typing import Any

from nbaccel.launch.cell._cell_output import CellOutput


class _Session:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send(self, socket: object, msg_type: str, content: dict[str, Any], **_: object) -> None:
        self.sent.append((msg_type, content))


class _Kernel:
    def __init__(self) -> None:
        self.session, self.iopub_socket = _Session(), object()


def _shown(sent: list[tuple[str, dict[str, Any]]]) -> dict[str, str]:
    """What the cell shows at the end: each display's last state, by display id."""
    state: dict[str, str] = {}
    for kind, content in sent:
        if kind in ("display_data", "update_display_data"):
            state[content["transient"]["display_id"]] = content["data"]["text/plain"]
    return state


def test_a_bar_drawn_before_the_monitor_took_over_is_blanked() -> None:
    kernel = _Kernel()
    cell = CellOutput(kernel, {"header": {"msg_id": "launch"}})
    cell.redraw("stderr", 0, "chatty:  10%|#         | 1/10", done=False)
    assert list(_shown(kernel.session.sent).values()) == ["chatty:  10%|#         | 1/10"]
    taken: list[tuple[str, str, str]] = []
    cell.set_listener(lambda kind, stream, text: taken.append((kind, stream, text)))
    assert list(_shown(kernel.session.sent).values()) == [""]  # the monitor draws it now
    cell.redraw("stderr", 0, "chatty: 100%|##########| 10/10", done=True)
    assert taken == [("redraw-end", "stderr", "chatty: 100%|##########| 10/10")]
    assert list(_shown(kernel.session.sent).values()) == [""]  # nothing drawn twice


def test_without_a_listener_the_cell_keeps_drawing_its_bar_in_place() -> None:
    kernel = _Kernel()
    cell = CellOutput(kernel, {"header": {"msg_id": "launch"}})
    cell.redraw("stderr", 0, "a:  50%", done=False)
    cell.set_listener(None)
    cell.redraw("stderr", 0, "a: 100%", done=True)
    assert list(_shown(kernel.session.sent).values()) == ["a: 100%"]
