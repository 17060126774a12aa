"""``LaunchHandle``: one job running (or finished) on a group of workers.

``notebook_launcher(..., block=False)`` and ``pool.call(..., block=False)`` return one at
once and follow the job in a background thread; ``block=True`` drives the same object from
the calling thread. ``handle.status()`` has per rank ``"state"`` ("starting", "running",
"finished", "failed", "killed", "stopped", "terminated"), ``"step"``, ``"scalars"`` (from
``Accelerator.log``), ``"pid"`` and ``"last_event"``; listeners
(:meth:`LaunchHandle.add_listener`) get ``callback(rank, kind, data)`` for every event.
The kernel's stop (interrupt) button, pressed while no cell runs, stops the background runs
that show in a cell: between requests ipykernel ignores SIGINT through the handler it keeps
in ``kernel.saved_sigint_handler`` (ipykernel 6 and 7), which nbaccel takes while a run is
alive; while a cell runs, the button interrupts that cell, as always.

A :class:`RankStatus` (a launch's, or a warm pool's) keeps each rank's latest state, pid, step
and values for ``status()`` and ``pids``, hands each event to the listeners (the monitor, the
panel), and keeps logged values, bounded, for a listener added late
(``add_listener(replay=True)``).

Example:
    >>> board = RankStatus([0, 1], "starting")
    >>> board.publish(1, "log", {"step": 3, "values": {"loss": 0.5}})
    >>> board.snapshot()[1]["step"], board.snapshot()[1]["scalars"]
    (3, {'loss': 0.5})
    >>> from nbaccel import notebook_launcher  # doctest: +SKIP
    >>> handle = notebook_launcher(train, num_processes=2, block=False)  # doctest: +SKIP
    >>> handle.status()[0]["state"]  # doctest: +SKIP
    'running'
    >>> handle.result()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import Stopped
from .cell._cell_output import running_kernel
from .engine import _lifetimes
from .engine._tidy import clean, show_in_cell

Listener = Callable[[int, str, dict], Any]
#: Logged-value events a board keeps for listeners that come late.
REPLAY = 20_000


def _entry(state: str) -> dict[str, Any]:
    return {"state": state, "step": None, "scalars": {}, "pid": None, "last_event": None}


class RankStatus:
    """Thread-safe ``rank -> {state, step, scalars, pid, last_event}`` plus listeners;
    ``state`` until a rank's first ``state`` event; ``renamed``: states shown under another
    name (a pool's finished call is ``"idle"``)."""

    def __init__(
        self, ranks: Iterable[int], state: str, *, renamed: Mapping[str, str] | None = None
    ) -> None:
        self._lock = threading.Lock()
        self._initial = state
        self._renamed = dict(renamed or {})
        self._table: dict[int, dict[str, Any]] = {r: _entry(state) for r in ranks}
        self._listeners: list[Listener] = []
        # logged values, for a live view attached after the run started (its charts start
        # at the first step; issue 28); bounded: a long run replays its last REPLAY events
        self._replay: deque[tuple[int, str, dict]] = deque(maxlen=REPLAY)

    def record(self, rank: int, kind: str, data: dict) -> list[Listener]:
        """Apply one event; return the listeners to call with it (outside any lock)."""
        with self._lock:
            entry = self._table.setdefault(rank, _entry(self._initial))
            if kind == "state":
                state = data.get("state", entry["state"])
                if state == "running" and entry["state"] != "running":  # a new call or attempt
                    self._replay = deque((e for e in self._replay if e[0] != rank), REPLAY)
                entry["state"] = self._renamed.get(state, state)
                if data.get("pid"):
                    entry["pid"] = data["pid"]
            else:
                if kind in ("log", "system"):
                    self._replay.append((rank, kind, data))
                entry["last_event"] = kind
                if isinstance(step := data.get("step"), int) and not isinstance(step, bool):
                    entry["step"] = step
                if isinstance(values := data.get("values"), dict):
                    entry["scalars"].update(
                        {k: v for k, v in values.items() if isinstance(v, int | float)}
                    )
            return list(self._listeners)

    @staticmethod
    def notify(listeners: list[Listener], rank: int, kind: str, data: dict) -> None:
        """Call each listener; a broken live view must not stop training."""
        for callback in listeners:
            with contextlib.suppress(Exception):
                callback(rank, kind, data)

    def publish(self, rank: int, kind: str, data: dict) -> None:
        self.notify(self.record(rank, kind, data), rank, kind, data)

    def snapshot(self) -> dict[int, dict[str, Any]]:
        with self._lock:
            return copy.deepcopy(self._table)

    def pids(self) -> dict[int, int | None]:
        """Worker pids by rank (None before a worker has started)."""
        with self._lock:
            return {r: s["pid"] for r, s in self._table.items()}

    def keep_only(self, ranks: Iterable[int]) -> None:
        """Forget every rank not in ``ranks`` (a pool call on a subset of the workers)."""
        wanted = set(ranks)
        with self._lock:
            self._table = {r: s for r, s in self._table.items() if r in wanted}

    def add_listener(self, callback: Listener, *, replay: bool = False) -> Listener:
        """Call ``callback`` with every event from now on (``replay``: first with the logged
        values so far, on this thread; the caller keeps newer events waiting meanwhile)."""
        with self._lock:
            self._listeners.append(callback)
            past = list(self._replay) if replay else []
        for rank, kind, data in past:
            self.notify([callback], rank, kind, data)
        return callback

    def remove_listener(self, callback: Listener) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._listeners.remove(callback)


class Observed:
    """What a launch's handle and a pool show of their ranks (their ``_board``)."""

    _board: RankStatus

    def status(self) -> dict[int, dict[str, Any]]:
        """A snapshot of every rank's state, step, latest scalars and pid."""
        return self._board.snapshot()

    def add_listener(self, callback: Listener, *, replay: bool = False) -> Listener:
        """Call ``callback(rank, kind, data)`` for every event; returns ``callback``.
        ``replay=True``: first with the values logged so far in this call or attempt (the
        last 20,000 ``log``/``system`` events), so a live view opened late draws them all."""
        return self._board.add_listener(callback, replay=replay)

    def remove_listener(self, callback: Listener) -> None:
        """Undo :meth:`add_listener`."""
        self._board.remove_listener(callback)


_LIVE: weakref.WeakSet[LaunchHandle] = weakref.WeakSet()
_TERMINAL = ("finished", "failed", "killed", "stopped", "terminated")

#: runs the job to its end: gets the handle (its ``stop_requested``, its ``on_event``),
#: returns ``{rank: value}`` of the wanted ranks or raises
Runner = Callable[["LaunchHandle"], dict[int, Any]]


def _stop_live_handles() -> None:
    for handle in list(_LIVE):
        with contextlib.suppress(Exception):
            handle.stop(timeout=5)


def _stop_on_interrupt() -> int:
    """The kernel's stop button while no cell runs: stop every background run of this
    kernel that shows in a cell, and say so there; how many were stopped."""
    live = [h for h in list(_LIVE) if not h.done() and h.cell_output is not None]
    for handle in live:
        handle.stop_requested.set()  # the run's own thread ends it: nothing blocks here

    def say() -> None:  # not in the signal handler: the cell's output takes locks
        for handle in live:
            handle.cell_output.write(
                "stderr", f"nbaccel: the kernel's stop button stopped {handle.label}.\n"
            )
            handle.cell_output.flush()

    if live:
        threading.Thread(target=say, name="nbaccel-stopped", daemon=True).start()
    return len(live)


_sigint: dict[str, Any] = {"previous": None}  # the idle kernel's handler nbaccel replaced


def _arm() -> None:
    """Let the idle kernel's interrupt stop the background runs (0 stopped: the handler
    that was there gets it)."""
    kernel = running_kernel()
    if kernel is None or threading.current_thread() is not threading.main_thread():
        return
    # (an ipykernel without saved_sigint_handler does not swap handlers per request)
    if (handler := getattr(kernel, "saved_sigint_handler", _on_interrupt)) is not _on_interrupt:
        _sigint["previous"] = handler
        kernel.saved_sigint_handler = _on_interrupt  # in place once this request ends


def _on_interrupt(signum: int, frame: Any) -> None:
    if _stop_on_interrupt():
        return
    if callable(previous := _sigint["previous"]):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        raise KeyboardInterrupt


def running_from(cell: Any) -> LaunchHandle | None:
    """The background run started from the same notebook cell as ``cell`` (a
    ``CellOutput``) that is still going, if any."""
    key = getattr(cell, "key", "")
    live = [h for h in list(_LIVE) if h.cell_output is not None and not h.done()]
    return next((h for h in live if key and h.cell_output.key == key), None)


def already_running(handle: LaunchHandle, what: str, here: Any = None) -> str:
    """The refusal to start a second job beside ``handle``; ``what`` says whose it is.
    From a notebook cell (``here``), the running job's output moves to that cell."""
    cell = handle.cell_output
    moved = cell is not None and cell.move_to(here)
    return (
        f"{what}: {handle!r}. nbaccel does not start a second job beside it. Stop it first "
        "with handle.stop() (or the kernel's stop button while no cell runs), or wait for "
        "handle.result()." + (" Its output shows in this cell from now on." if moved else "")
    )


class LaunchHandle(Observed):
    """Control and observe a job: ``wait``, ``result``, ``stop``, ``done``, ``status``."""

    def __init__(self, ranks: list[int], runner: Runner, *, all_ranks: bool = False) -> None:
        self.ranks = list(ranks)
        self.attempt = 0
        self.stop_requested = threading.Event()
        self._runner, self._all_ranks = runner, all_ranks
        self._board = RankStatus(self.ranks, "starting")
        self._done = threading.Event()
        self._outcome: tuple[bool, Any] | None = None
        self._thread: threading.Thread | None = None
        #: In a notebook kernel, the launching cell (a ``CellOutput``): the run's output
        #: stays there whatever cell runs later, and a live monitor may take it over.
        self.cell_output: Any = None
        #: The workers' supervisor while the job runs (set by the runner): for :meth:`stacks`.
        self.supervisor: Any = None
        #: What runs, for messages and chart titles: "notebook_launcher(train)", "pool.call(f)".
        self.label = "the run"
        #: When the job was submitted (``time.time()``).
        self.started = time.time()
        self._asking = 0  # calls of result()/exception() waiting for the outcome now

    # ------------------------------------------------------------------ public API
    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run ended (or ``timeout`` seconds); True when it has ended."""
        return self._done.wait(timeout)

    def done(self) -> bool:
        """True once every worker has exited and the outcome is known."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value (a list of every rank's with ``return_all_ranks=True``);
        raises the run's failure, or ``TimeoutError`` still running after ``timeout`` s."""
        if (error := self.exception(timeout)) is not None:  # the user's error, not our frames
            raise clean(error)
        value = self._outcome[1]  # type: ignore[index]
        return [value[r] for r in self.ranks] if self._all_ranks else value[self.ranks[0]]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The failure of a finished run, or None when it succeeded."""
        self._asking += 1  # whoever waits here gets the failure: the cell need not show it
        try:
            if not self.wait(timeout):
                raise TimeoutError(
                    f"the run is still going after {timeout}s; wait longer or call .stop()."
                )
        finally:
            self._asking -= 1
        assert self._outcome is not None
        return None if self._outcome[0] else self._outcome[1]

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the job: a launch's workers are terminated, a pool's interrupted."""
        self.stop_requested.set()
        if threading.current_thread() is not self._thread:  # not from a listener callback
            self.wait(timeout)

    def stacks(self, ranks: list[int] | None = None) -> dict[int, str]:
        """Where each running rank is now: its main thread's Python stack, by rank (the
        monitor's "where are the ranks?" button; answered also while a rank waits in C++)."""
        wanted = list(self.ranks if ranks is None else ranks)
        supervisor = self.supervisor
        if supervisor is None or self.done():
            return {rank: "(not running)" for rank in wanted}
        return dict(supervisor.stacks(wanted))

    @property
    def pids(self) -> dict[int, int | None]:
        """Worker pids by rank (None before a worker has started)."""
        return self._board.pids()

    def __repr__(self) -> str:
        states = sorted({s["state"] for s in self.status().values()})
        since = time.strftime("%H:%M:%S", time.localtime(self.started))
        return (
            f"<LaunchHandle {self.label} ranks={self.ranks} state={'/'.join(states)} "
            f"started={since}>"
        )

    # ------------------------------------------------------------------ running
    def on_event(self, rank: int, kind: str, data: dict) -> None:
        """Where the supervisor's events for this job go."""
        self._board.publish(rank, kind, data)

    def _finish(self, ok: bool, value: Any) -> None:
        final = "stopped" if isinstance(value, Stopped) else "terminated"
        for rank, entry in self.status().items():
            if entry["state"] not in _TERMINAL:
                self.on_event(rank, "state", {"state": final})
        self._outcome = (ok, value)
        _LIVE.discard(self)
        shown = self._thread is threading.current_thread() and not self._asking
        if not ok and shown and not isinstance(value, (Stopped, KeyboardInterrupt)):
            # a failed background run is not silent: its error shows in its launching cell
            # (before done: whoever waits for it finds it there already)
            title = f"nbaccel: {self.label} (started in this cell) failed:"
            if self.cell_output is not None:
                show_in_cell(self.cell_output, value, title)
        self._done.set()

    def run(self) -> None:
        """Run the job here; the outcome is kept for :meth:`result` (a KeyboardInterrupt
        is also re-raised)."""
        try:
            values = self._runner(self)
        except BaseException as err:
            self._finish(False, err)
            if isinstance(err, KeyboardInterrupt):
                raise
            return
        self._finish(True, values)

    def run_in_background(self) -> None:
        _lifetimes.register("handle", _stop_live_handles)  # nothing outlives the kernel
        _LIVE.add(self)
        if self.cell_output is not None:  # the stop button, pressed while idle, stops it
            _arm()
        self._thread = threading.Thread(target=self._background, name="nbaccel-job", daemon=True)
        self._thread.start()

    def _background(self) -> None:
        with contextlib.suppress(BaseException):
            self.run()


__all__ = ["LaunchHandle", "Listener", "Observed", "RankStatus", "already_running", "running_from"]
