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

from .base import GeneralTracker

__all__ = ["GeneralTracker"]
