"""Telling the outside world what training does: trackers, progress bars, events.

* :mod:`~nbaccel.tracking.base` -- :class:`GeneralTracker`, the interface of every tracker;
* :mod:`~nbaccel.tracking.trackers` -- JSONL, CSV and the registry behind ``log_with``;
* :mod:`~nbaccel.tracking.backends` -- TensorBoard, Weights & Biases, MLflow (lazy imports);
* :mod:`~nbaccel.tracking.progress` -- ``nbaccel.tqdm``, drawn by the main process;
* :mod:`~nbaccel.tracking.events` -- ``publish``: a no-op unless a launcher installed a sink.

Example:
    >>> from nbaccel.tracking import GeneralTracker
    >>> GeneralTracker.name
    ''
"""

import importlib
from typing import Any

from .base import GeneralTracker, on_main_process

# the peer's ``accelerate.tracking`` names, loaded on first use (backends import lazily)
_LAZY = {
    "LoggerType": "trackers",
    "JSONLTracker": "trackers",
    "CSVTracker": "trackers",
    "TensorBoardTracker": "backends",
    "WandBTracker": "backends",
    "MLflowTracker": "backends",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GeneralTracker", "on_main_process", *_LAZY]
