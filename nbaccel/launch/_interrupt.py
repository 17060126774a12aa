"""The kernel's stop (interrupt) button, pressed while no cell runs, stops background runs.

While a cell runs, the button interrupts that cell, as always. Between requests ipykernel
ignores SIGINT; while a background run of this kernel is alive, nbaccel takes that
idle-time handler (``kernel.saved_sigint_handler``, ipykernel 6 and 7), and the button then
stops the background runs, saying so in their cells.

Example:
    >>> arm(lambda: 0)  # outside a kernel: nothing to do
    False
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

_state: dict[str, Any] = {"stop": None, "previous": None}


def arm(stop_all: Callable[[], int]) -> bool:
    """Let the idle kernel's interrupt call ``stop_all()`` (returns how many runs it
    stopped; 0 hands the interrupt to the handler that was there). True when armed."""
    from ._cell_output import _kernel

    kernel = _kernel()
    if kernel is None or threading.current_thread() is not threading.main_thread():
        return False
    if not hasattr(kernel, "saved_sigint_handler"):
        return False  # not an ipykernel that swaps handlers per request
    _state["stop"] = stop_all
    if kernel.saved_sigint_handler is not _on_interrupt:
        _state["previous"] = kernel.saved_sigint_handler
        kernel.saved_sigint_handler = _on_interrupt  # in place once this request ends
    return True


def _on_interrupt(signum: int, frame: Any) -> None:
    stop_all = _state["stop"]
    if stop_all is not None and stop_all():
        return
    previous = _state["previous"]
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        raise KeyboardInterrupt


__all__ = ["arm"]
