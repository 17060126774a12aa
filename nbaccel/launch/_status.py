"""Per-rank live status and event listeners, shared by a launch and a warm pool.

A :class:`RankStatus` keeps each rank's latest state, pid, step and values for ``status()``
and ``pids``, hands each event to the listeners (the monitor, the panel), and keeps logged
values, bounded, for a listener added late (``add_listener(replay=True)``).

Example:
    >>> board = RankStatus([0, 1], "starting")
    >>> board.publish(1, "log", {"step": 3, "values": {"loss": 0.5}})
    >>> board.snapshot()[1]["step"], board.snapshot()[1]["scalars"]
    (3, {'loss': 0.5})
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

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
                step = data.get("step")
                if isinstance(step, int) and not isinstance(step, bool):
                    entry["step"] = step
                values = data.get("values")
                if isinstance(values, dict):
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
        """:meth:`record`, then :meth:`notify`."""
        self.notify(self.record(rank, kind, data), rank, kind, data)

    def snapshot(self) -> dict[int, dict[str, Any]]:
        """A deep copy of the table."""
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


__all__ = ["Listener", "Observed", "RankStatus"]
