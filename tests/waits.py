"""The suite's one hang guard: a test waits for an event, never for a speed.

A test waits for what it is about (a process gone, a line printed, a flag set); the bound
is a hang guard that only a real hang reaches, whatever the machine's speed or load (issue
49: fixed bounds of 5-60 s failed under the slow-machine rehearsal). No third-party
imports: every venv of the suite (the torch matrix, the hosted-notebook stacks) imports it.

Example:
    >>> from waits import HANG_GUARD_S
    >>> HANG_GUARD_S >= 600
    True
"""

from __future__ import annotations

#: The one hang guard of the suite's waits, in seconds.
HANG_GUARD_S = 600.0
