"""Experiment trackers as ``Accelerator`` methods (:mod:`nbaccel.tracking.trackers`).

A mixin: the class provides ``log_with``, ``logging_dir``, ``gradient_state`` (the step)
and the ``trackers`` list. Trackers run on the main process only; ``log`` also feeds the
launcher's live view on every rank.

Example:
    >>> from nbaccel import Accelerator
    >>> accelerator = Accelerator(cpu=True)
    >>> accelerator.init_trackers("demo")  # no log_with: nothing starts
    >>> accelerator.get_tracker("jsonl") is None
    True
"""

from __future__ import annotations

from typing import Any

from ...checkpoint.store import is_url
from ...errors import ConfigError
from ...tracking import events
from ._process_api import ProcessAPI


def _refuse_store_logging_dir(log_with: Any, logging_dir: Any) -> None:
    """Trackers write local files: an object-store ``logging_dir`` (the default when
    ``project_dir`` is a URL) would become a local folder named ``s3:``; refuse it."""
    from ...tracking.base import GeneralTracker

    items = log_with if isinstance(log_with, list | tuple) else [log_with]
    built_here = [i for i in items if not isinstance(i, GeneralTracker)]
    if built_here and isinstance(logging_dir, str) and is_url(logging_dir):
        raise ConfigError(
            f"logging_dir={logging_dir!r} is an object-store URL (it defaults to project_dir), "
            "but trackers write local files. Pass a local one: ProjectConfiguration("
            "project_dir=..., logging_dir='runs/logs'); checkpoints still go to the store."
        )


class TrackingAPI(ProcessAPI):
    """init_trackers, log, get_tracker, end_training."""

    log_with: Any
    trackers: list[Any]
    logging_dir: Any
    gradient_state: Any  # its ``updates`` are the Accelerator's ``step``

    def init_trackers(
        self, project_name: str, config: dict[str, Any] | None = None, init_kwargs: Any = None
    ) -> None:
        """Start the ``log_with`` trackers on the main process and store ``config``."""
        from ...tracking import trackers

        if self.log_with is not None:
            _refuse_store_logging_dir(self.log_with, self.logging_dir)
        if self.is_main_process and self.log_with is not None:
            self.trackers = trackers.start_trackers(
                self.log_with, project_name, self.logging_dir, config, init_kwargs or {}
            )

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: Any = None) -> None:
        """Log ``values`` to every tracker (main process) and to the launcher's live view."""
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))
        events.publish(
            "log", step=self.gradient_state.updates if step is None else step, values=dict(values)
        )

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name`` (its raw object if ``unwrap``); ``None`` off-main."""
        from ...tracking import trackers

        if not self.is_main_process:
            return None
        return trackers.find_tracker(self.trackers, name, unwrap=unwrap)

    def end_training(self) -> None:
        """Finish every tracker (flush files, close runs)."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []


__all__ = ["TrackingAPI"]
