"""Waiting for an event in a test, never for a speed.

A test waits for what it is about (a process gone, a line printed, a flag set); the bound
is a hang guard that only a real hang reaches, whatever the machine's speed or load (issue
49: fixed bounds of 5-60 s failed under the slow-machine rehearsal). No third-party
imports: every venv of the suite (the torch matrix, the hosted-notebook stacks) imports it.

Example:
    >>> from waits import wait_until
    >>> wait_until(lambda: True, "nothing")
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: The one hang guard of the suite's waits, in seconds.
HANG_GUARD_S = 600.0


def wait_until(predicate: Callable[[], object], what: str, *, every: float = 0.02) -> None:
    """Poll ``predicate`` until it is true; fail naming ``what`` if the hang guard passes."""
    guard = time.monotonic() + HANG_GUARD_S
    while not predicate():
        if time.monotonic() >= guard:
            raise AssertionError(f"{what}: not within the {HANG_GUARD_S:.0f} s hang guard")
        time.sleep(every)
