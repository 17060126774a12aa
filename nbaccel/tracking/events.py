"""The events channel: how code inside a training function tells the kernel what it does.

:func:`publish` is what the runtime calls (``Accelerator.log``, progress bars); it is
a no-op until a launcher installs a sink in the worker with :func:`install_sink`.
This keeps the runtime free of any launcher import: the launcher points down at
this module, never the other way round.

Example:
    >>> publish("log", step=3, values={"loss": 0.5})  # no sink installed: nothing happens
    >>> seen = []
    >>> install_sink(lambda kind, data: seen.append((kind, data)))
    >>> publish("progress", step=10, total=100)
    >>> seen
    [('progress', {'step': 10, 'total': 100})]
    >>> install_sink(None)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

#: Receives ``(kind, data)``; installed by the launcher in each worker.
Sink = Callable[[str, dict[str, Any]], None]

_sink: Sink | None = None


def install_sink(sink: Sink | None) -> None:
    """Route published events to ``sink`` (``None`` turns publishing off again)."""
    global _sink
    _sink = sink


def _plain(value: Any) -> Any:
    """0-d tensors and numpy scalars -> Python numbers, so events stay small and picklable."""
    item = getattr(value, "item", None)
    if item is not None and getattr(value, "numel", lambda: getattr(value, "size", 2))() == 1:
        try:
            return item()
        except Exception:
            return value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def publish(kind: str, **data: Any) -> None:
    """Send an event (``kind`` plus keyword data) to the launching kernel.

    Conventions used by ``LaunchHandle.status()``: a ``step`` keyword sets the
    rank's current step; a ``values`` dict (as from ``Accelerator.log``) updates
    its latest scalars. Never raises; a no-op outside a launched worker.

    Example:
        >>> publish("progress", step=10, total=100)
    """
    sink = _sink
    if sink is None:
        return
    try:
        sink(kind, _plain(data))
    except Exception:  # unpicklable data: keep the event, drop the payload
        with contextlib.suppress(Exception):
            sink(kind, {"unpicklable": True})


__all__ = ["Sink", "install_sink", "publish"]
