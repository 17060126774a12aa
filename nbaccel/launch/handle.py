"""``LaunchHandle``: a running (or finished) multi-process launch.

``notebook_launcher(..., block=False)`` returns one at once; the workers are
supervised by a background thread and the kernel stays responsive. With
``block=True`` the same object is driven from the calling thread.

Status model (``handle.status()``): one dict per global rank of this node with
``"state"`` ("starting", "running", "finished", "failed", "killed", "stopped",
"terminated"), ``"step"`` (the last ``step=`` a worker published), ``"scalars"``
(latest values of ``publish(..., values={...})``, e.g. from ``Accelerator.log``),
``"pid"`` and ``"last_event"``. Listeners added with :meth:`LaunchHandle.add_listener`
are called as ``callback(rank, kind, data)`` on the supervising thread for every
worker event and every state change (``kind == "state"``).

Example:
    >>> from nbaccel import notebook_launcher  # doctest: +SKIP
    >>> handle = notebook_launcher(train, num_processes=2, block=False)  # doctest: +SKIP
    >>> handle.status()[0]["state"]  # doctest: +SKIP
    'running'
    >>> handle.result()  # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import weakref
from typing import Any

from ._attempt import start_attempt
from ._cell_output import CellOutput
from ._live_stacks import live_stacks
from ._preflight import LaunchPlan
from ._status import Listener, RankStatus
from ._supervise import Stopped, Supervisor

_LIVE: weakref.WeakSet[LaunchHandle] = weakref.WeakSet()
_TERMINAL = ("finished", "failed", "killed", "stopped", "terminated")
_atexit_registered = False


def _stop_live_handles() -> None:
    for handle in list(_LIVE):
        with contextlib.suppress(Exception):
            handle.stop(timeout=5)


class LaunchHandle:
    """Control and observe a launch: ``wait``, ``result``, ``stop``, ``done``, ``status``."""

    def __init__(self, plan: LaunchPlan) -> None:
        self._plan = plan
        nproc = plan.num_processes or 1
        self.ranks: list[int] = [plan.global_rank(i) for i in range(nproc)]
        self._want = set(self.ranks) if plan.return_all_ranks else {self.ranks[0]}
        self._board = RankStatus(self.ranks, "starting")
        self._done = threading.Event()
        self._stopping = threading.Event()
        self._outcome: tuple[bool, Any] | None = None
        self._supervisor: Supervisor | None = None
        self._thread: threading.Thread | None = None
        self.attempt = 0
        #: In a notebook kernel, the launching cell: the run's output stays there (and a
        #: live monitor may take it over), whatever cell runs later.
        self.cell_output = CellOutput.here() if plan.output is None else None
        if self.cell_output is not None:
            self._streams: tuple[Any, Any] = self.cell_output.streams()
        elif plan.output is None:
            self._streams = (sys.stdout, sys.stderr)
        elif callable(plan.output):
            self._streams = (None, None)
        else:
            self._streams = (plan.output, plan.output)

    # ------------------------------------------------------------------ public API
    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run ended (or ``timeout`` seconds); True when it has ended."""
        return self._done.wait(timeout)

    def done(self) -> bool:
        """True once every worker has exited and the outcome is known."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value (a list of every rank's with ``return_all_ranks=True``).

        Raises the workers' failure (see ``notebook_launcher``) if the run failed, or
        ``TimeoutError`` if it is still running after ``timeout`` seconds.
        """
        if not self.wait(timeout):
            raise TimeoutError(
                f"the run is still going after {timeout}s; wait longer or call .stop()."
            )
        assert self._outcome is not None
        ok, value = self._outcome
        if not ok:
            raise value
        if self._plan.return_all_ranks:
            return [value[r] for r in self.ranks]
        return value[self.ranks[0]]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The failure of a finished run, or None when it succeeded."""
        if not self.wait(timeout):
            raise TimeoutError(f"the run is still going after {timeout}s.")
        assert self._outcome is not None
        return None if self._outcome[0] else self._outcome[1]

    def stop(self, timeout: float | None = 10.0) -> None:
        """Terminate every worker (SIGTERM, then SIGKILL) and wait until they are gone."""
        self._stopping.set()
        supervisor = self._supervisor
        if supervisor is not None:
            supervisor.stop_requested.set()
        if threading.current_thread() is not self._thread:  # not from a listener callback
            self.wait(timeout)

    def status(self) -> dict[int, dict[str, Any]]:
        """A snapshot of every rank's state, step and latest scalars."""
        return self._board.snapshot()

    def add_listener(self, callback: Listener, *, replay: bool = False) -> Listener:
        """Call ``callback(rank, kind, data)`` for every event; returns ``callback``.

        ``replay=True`` first calls it with the run's logged values so far (the last
        20,000 ``log``/``system`` events), so a live view opened late draws them all.
        """
        return self._board.add_listener(callback, replay=replay)

    def remove_listener(self, callback: Listener) -> None:
        """Undo :meth:`add_listener`."""
        self._board.remove_listener(callback)

    def stacks(self, ranks: list[int] | None = None, timeout: float = 2.0) -> dict[int, str]:
        """Where each running rank is now: its Python stack (all threads), by rank.

        For a live view during a background run (the monitor's "where?" button); a
        finished rank shows ``"(not running)"``.
        """
        return live_stacks(self._supervisor, ranks, timeout)

    @property
    def pids(self) -> dict[int, int | None]:
        """Worker pids by rank (None before a worker has started)."""
        return self._board.pids()

    def __repr__(self) -> str:
        states = sorted({s["state"] for s in self.status().values()})
        return f"<LaunchHandle ranks={self.ranks} state={'/'.join(states)}>"

    # ------------------------------------------------------------------ events
    def _on_event(self, rank: int, kind: str, data: dict) -> None:
        self._board.publish(rank, kind, data)

    # ------------------------------------------------------------------ running
    def _start_attempt(self) -> None:
        self._supervisor = start_attempt(
            self._plan, self.ranks, self._want, self._streams, self._on_event, self.attempt
        )
        if self._stopping.is_set():
            self._supervisor.stop_requested.set()

    def _finish(self, ok: bool, value: Any) -> None:
        final = "stopped" if isinstance(value, Stopped) else "terminated"
        for rank, entry in self.status().items():
            if entry["state"] not in _TERMINAL:
                self._on_event(rank, "state", {"state": final})
        self._outcome = (ok, value)
        _LIVE.discard(self)
        self._done.set()

    def _run(self) -> None:
        """Supervise attempts until success, failure or stop. Re-raises KeyboardInterrupt."""
        try:
            while True:
                assert self._supervisor is not None
                try:
                    values = self._supervisor.run()
                except Stopped as err:
                    self._finish(False, err)
                    return
                except Exception as err:
                    if self.attempt >= self._plan.config.max_restarts or self._stopping.is_set():
                        self._finish(False, err)
                        return
                    self.attempt += 1
                    self._announce_restart(err)
                    self._start_attempt()
                    continue
                self._finish(True, values)
                return
        except BaseException as err:
            self.abort()
            if not self._done.is_set():
                self._finish(False, err)
            if isinstance(err, KeyboardInterrupt) or not self._plan.block:
                raise

    def abort(self) -> None:
        """Kill and reap the current workers right now (used when starting is interrupted)."""
        supervisor = self._supervisor
        if supervisor is not None:
            supervisor.terminate()
            supervisor.close()

    def _announce_restart(self, err: BaseException) -> None:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        text = (
            f"nbaccel: workers failed ({first}); restarting, attempt {self.attempt} of "
            f"{self._plan.config.max_restarts}\n"
        )
        stream = self._streams[1]
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.write(text)

    def _run_in_background(self) -> None:
        global _atexit_registered
        if not _atexit_registered:  # workers must not outlive the kernel (macOS has no PDEATHSIG)
            atexit.register(_stop_live_handles)
            _atexit_registered = True
        _LIVE.add(self)
        self._thread = threading.Thread(
            target=self._background, name="nbaccel-supervisor", daemon=True
        )
        self._thread.start()

    def _background(self) -> None:
        with contextlib.suppress(BaseException):
            self._run()


__all__ = ["LaunchHandle"]
