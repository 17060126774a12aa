"""A flag any rank can raise and every rank sees: ``set_trigger`` / ``check_trigger``.

Typical use: one rank detects a NaN loss or a stopping condition, and all ranks must
leave the loop at the same iteration (or the next collective hangs).

Example:
    >>> trigger = Trigger()
    >>> trigger.set()
    >>> trigger.check(), trigger.check()   # one process: no collective; check() resets it
    (True, False)
"""

from __future__ import annotations

import torch

from . import ops


class Trigger:
    """A local flag combined across ranks by :meth:`check` (a collective)."""

    def __init__(self) -> None:
        self._raised = False

    def set(self) -> None:
        """Raise the flag on this rank (no communication)."""
        self._raised = True

    def check(self) -> bool:
        """True on every rank if any rank raised the flag since the last check; resets it.

        Every rank must call it at the same point (it all-reduces one number).
        """
        raised = ops.reduce(torch.tensor([int(self._raised)]), "max").item() > 0
        if raised:
            self._raised = False
        return bool(raised)


__all__ = ["Trigger"]
