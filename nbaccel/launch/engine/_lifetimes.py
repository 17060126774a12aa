"""The one owner of the worker lifetimes a kernel holds: one exit hook ends them all.

Background runs, warm pools and ranks kept for ``nbaccel.debug()`` each register how to end
every live one of their kind; the one ``atexit`` hook ends them in :data:`ORDER` (runs hold
pools' workers, so they stop first), whatever order they started in.

Example:
    >>> register("pool", lambda: None)
    >>> "pool" in ORDER
    True
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Callable

#: The order in which the kinds are ended at exit (kinds not listed go last).
ORDER = ("handle", "pool", "kept")
_enders: dict[str, Callable[[], None]] = {}
_lock = threading.Lock()


def register(kind: str, end_all: Callable[[], None]) -> None:
    """At the kernel's exit, call ``end_all`` (it ends every live one of ``kind``); once
    per kind, however often it is registered."""
    with _lock:
        if not _enders:
            atexit.register(_at_exit)
        _enders.setdefault(kind, end_all)


def _at_exit() -> None:
    kinds = [k for k in ORDER if k in _enders] + [k for k in _enders if k not in ORDER]
    for kind in kinds:
        with contextlib.suppress(Exception):  # one failure must not spare the others
            _enders[kind]()


__all__ = ["ORDER", "register"]
