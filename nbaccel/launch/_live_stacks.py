"""Where is each rank now? Ask running workers for their Python stacks, during a run.

The hang report already does this (``SIGUSR1`` -> faulthandler writes every thread's
stack to the worker's stack pipe, see :mod:`nbaccel.launch._bootstrap`), but from the
supervising thread, which is the only one reading the pipes. Asked from another thread
(a live monitor's button in a kernel that is free during a background run), this
module only sends the signal and waits for the supervising thread to collect the dump
into the supervisor's per-rank buffer; it never reads a pipe itself.

Example:
    >>> live_stacks(None, [0])
    {0: '(not running)'}
"""

from __future__ import annotations

import time
from typing import Any

from ._bootstrap import STACK_SIGNAL
from ._pool_call import trim_pool_stack
from ._supervise import _trim_stack


def _supervisor_of(driver: Any) -> tuple[Any, Any]:
    """The supervisor that owns the pipes, and how to trim its dumps."""
    engine = getattr(driver, "engine", None)  # a pool call: the pool's supervisor
    if engine is not None:
        workers = getattr(engine, "workers", None)
        return getattr(workers, "supervisor", None), trim_pool_stack
    return driver, _trim_stack


def live_stacks(driver: Any, ranks: list[int] | None, timeout: float = 2.0) -> dict[int, str]:
    """``rank -> stack text`` of the running workers among ``ranks`` (None: all).

    Args:
        driver: the handle's supervisor (a launch's ``Supervisor`` or a pool call's driver).
        ranks: which ranks to ask.
        timeout: seconds to wait for the dumps.
    """
    supervisor, trim = _supervisor_of(driver)
    procs = list(getattr(supervisor, "procs", []) or [])
    wanted = [p.rank for p in procs] if ranks is None else list(ranks)
    out = {rank: "(not running)" for rank in wanted}
    buffers = getattr(supervisor, "_stacks", None)
    if STACK_SIGNAL is None:
        return {rank: "(stacks need SIGUSR1, which this platform lacks)" for rank in wanted}
    live = [p for p in procs if p.rank in wanted and p.returncode is None]
    if buffers is None or not live:
        return out
    start = {p.rank: len(buffers[p.rank]) for p in live}
    for proc in live:
        proc.send_signal(STACK_SIGNAL)
    deadline, last, stable_since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:  # the supervising thread appends the dumps
        time.sleep(0.05)
        size = sum(len(buffers[p.rank]) for p in live)
        if size != last:
            last, stable_since = size, time.monotonic()
        elif time.monotonic() - stable_since >= 0.1 and all(
            len(buffers[p.rank]) > start[p.rank] for p in live
        ):
            break
    for proc in live:
        text = bytes(buffers[proc.rank][start[proc.rank] :]).decode(errors="replace")
        out[proc.rank] = trim(text) if text.strip() else "(no stack received)"
    return out


__all__ = ["live_stacks"]
