"""Keep a run's output in the notebook cell that started it, whatever cell runs later.

ipykernel sends ``sys.stdout`` writes with the parent header of the request running *now*,
so a background run's output moved into whichever cell ran next; front ends route output by
its parent header, also for a finished cell. :meth:`CellOutput.here` captures the launching
request's header, and everything the run shows later goes on the kernel's IOPub socket
(thread-safe in ipykernel 6 and 7) with it: ``stream`` messages batched every
:data:`FLUSH_S` (:meth:`CellOutput.streams`), a carriage-return redraw as a
``display_data`` updated in place (one per bar), other displays with
:meth:`CellOutput.display`. A listener (:meth:`CellOutput.set_listener`, the live monitor)
may take the lines instead of the cell.

Example:
    >>> CellOutput.here() is None  # not in a notebook kernel: nothing to capture
    True
"""

from __future__ import annotations

import contextlib
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

#: Seconds between two stream messages (a busy run's lines are batched, as ipykernel does).
FLUSH_S = 0.1

#: ``callback(kind, stream, text)``: kind is "line" (whole lines, prefixed and ending in a
#: newline), "redraw" (a progress bar's new state), "redraw-end" (its last state) or
#: "moved" (the cell ran again: see :meth:`CellOutput.move_to`).
OutputListener = Callable[[str, str, str], Any]


def running_kernel() -> Any:
    """The running ipykernel kernel object, if this process is one (not a forked child)."""
    if "IPython" not in sys.modules:
        return None
    from ...platform.environment import in_kernel_process

    if not in_kernel_process():
        return None
    shell = sys.modules["IPython"].get_ipython()
    kernel = getattr(shell, "kernel", None)
    if getattr(kernel, "session", None) is None or getattr(kernel, "iopub_socket", None) is None:
        return None
    return kernel


class CellOutput:
    """Where one run's output goes: the cell that started it (``parent``: its request,
    whose header the output carries), sent with ipykernel ``kernel``'s session."""

    def __init__(self, kernel: Any, parent: dict[str, Any]) -> None:
        self._session = kernel.session
        self._socket = kernel.iopub_socket
        self.parent = parent
        self._lock = threading.RLock()
        self._pending: dict[str, list[str]] = {}
        self._timer: threading.Timer | None = None
        self._bars: dict[tuple[str, int], str] = {}  # (stream, rank) -> display id
        self._listener: OutputListener | None = None
        #: when it returns True, progress bars are not drawn here: a monitor draws them
        self.hide_bars: Callable[[], bool] | None = None

    @property
    def key(self) -> str:
        """Which notebook cell this is, across re-runs: the front end's cell id where it
        sends one (JupyterLab, Notebook 7, VS Code), else the cell's source."""
        metadata = self.parent.get("metadata") or {}
        content = self.parent.get("content") or {}
        return str(metadata.get("cellId") or content.get("code") or "")

    def move_to(self, other: CellOutput | None) -> bool:
        """When ``other`` is this same notebook cell run again, show there from now on (a
        front end clears a cell that runs again and drops what arrives for its earlier run);
        True if moved."""
        if other is None or other is self or other.key != self.key:
            return False
        self.flush()
        self.parent = other.parent
        if (listener := self._listener) is not None:  # a live monitor shows the run: it follows too
            listener("moved", "", "")
        return True

    @classmethod
    def here(cls) -> CellOutput | None:
        """The cell being executed now, or None outside a notebook kernel's request."""
        if (kernel := running_kernel()) is None:
            return None
        if not (parent := kernel.get_parent("shell")) or not parent.get("header"):
            return None  # not in a request
        for stream in (sys.stdout, sys.stderr):  # what the cell printed so far comes first
            with contextlib.suppress(Exception):
                stream.flush()
        return cls(kernel, dict(parent))

    # ------------------------------------------------------------------ sending
    def send(self, msg_type: str, content: dict[str, Any]) -> None:
        """Send one IOPub message as output of the captured cell (never raises)."""
        topic = f"stream.{content.get('name')}" if msg_type == "stream" else msg_type
        with contextlib.suppress(Exception):  # a closed kernel must not break the run
            self._session.send(
                self._socket, msg_type, content, parent=self.parent, ident=topic.encode()
            )

    def display(self, data: dict[str, Any], *, display_id: str) -> None:
        """Add a ``display_data`` output to the cell (:meth:`update` replaces it)."""
        self.flush()  # after the text written before it
        content = {"data": data, "metadata": {}, "transient": {"display_id": display_id}}
        self.send("display_data", content)

    def update(self, display_id: str, data: dict[str, Any]) -> None:
        """Replace the output shown by :meth:`display` with ``display_id``."""
        content = {"data": data, "metadata": {}, "transient": {"display_id": display_id}}
        self.send("update_display_data", content)

    # ------------------------------------------------------------------ streams
    def write(self, name: str, text: str) -> None:
        """Queue stream text (sent within :data:`FLUSH_S`) or hand it to the listener."""
        if not text:
            return
        if (listener := self._listener) is not None:
            listener("line", name, text)
            return
        with self._lock:
            self._pending.setdefault(name, []).append(text)
            if self._timer is None:
                self._timer = threading.Timer(FLUSH_S, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Send the queued stream text now."""
        with self._lock:
            pending, self._pending = self._pending, {}
            timer, self._timer = self._timer, None
            if timer is not None:
                timer.cancel()
            for name, pieces in pending.items():
                self.send("stream", {"name": name, "text": "".join(pieces)})

    def redraw(self, name: str, rank: int, text: str, done: bool) -> None:
        """Show a progress bar's new state in place (``done``: its last one)."""
        if (listener := self._listener) is not None:
            listener("redraw-end" if done else "redraw", name, text)
            return
        with self._lock:
            key = (name, rank)
            if self.hide_bars is not None and self.hide_bars():
                text = ""  # a monitor elsewhere draws this bar (watch(pool)): blank here
                if key not in self._bars:
                    return
            if (display_id := self._bars.get(key)) is None:
                display_id = self._bars[key] = uuid.uuid4().hex
                self.display({"text/plain": text}, display_id=display_id)
            else:
                self.update(display_id, {"text/plain": text})
            if done:
                del self._bars[key]

    def set_listener(self, listener: OutputListener | None) -> None:
        """Send lines and redraws to ``listener`` instead of the cell (None: the cell again).

        A progress bar this cell drew before ``listener`` took over is blanked: the listener
        (the live monitor) draws the bars from now on, and the cell's copy would stay at its
        old state beside it (a loaded machine drew rank 0's bar before ``watch()`` ran).
        """
        self.flush()
        with self._lock:
            if listener is not None:
                for display_id in self._bars.values():
                    self.update(display_id, {"text/plain": ""})
                self._bars.clear()
            self._listener = listener

    def streams(self) -> tuple[CellStream, CellStream]:
        """File-like ``(stdout, stderr)`` writing into this cell."""
        return CellStream(self, "stdout"), CellStream(self, "stderr")


class CellStream:
    """A file-like stream into a :class:`CellOutput` for the line forwarder, which hands
    it carriage-return redraws through ``redraw(rank, text, done)``."""

    def __init__(self, cell: CellOutput, name: str) -> None:
        self.cell, self.name = cell, name

    def write(self, text: str) -> int:
        self.cell.write(self.name, text)
        return len(text)

    def flush(self) -> None:
        self.cell.flush()

    def redraw(self, rank: int, text: str, done: bool) -> None:
        self.cell.redraw(self.name, rank, text, done)

    def isatty(self) -> bool:
        return False


__all__ = ["FLUSH_S", "CellOutput", "CellStream", "OutputListener", "running_kernel"]
