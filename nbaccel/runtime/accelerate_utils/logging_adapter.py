"""``get_logger``: a logger whose records are emitted by the main process only.

Ported scripts write ``logger = get_logger(__name__)`` and
``logger.info("...", main_process_only=False)``; every logging method takes
``main_process_only`` (default True) and ``in_order`` (every process logs, one rank after
the other). Nothing is configured: handlers and levels stay the application's.

Example:
    >>> logger = get_logger("demo", log_level="INFO")
    >>> logger.info("hello from the main process")  # one process: it is the main one
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from ..collectives import ops


class MultiProcessAdapter(logging.LoggerAdapter):
    """A ``LoggerAdapter`` that logs on the main process only unless told otherwise."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        if in_order:
            for rank in range(ops.world_size()):
                if rank == ops.process_index():
                    msg_, kwargs_ = self.process(msg, kwargs)
                    self.logger.log(level, msg_, *args, **kwargs_)
                ops.barrier("logging with in_order=True")
            return
        if not main_process_only or ops.process_index() == 0:
            msg_, kwargs_ = self.process(msg, kwargs)
            self.logger.log(level, msg_, *args, **kwargs_)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        return msg, kwargs

    def warning_once(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        """``warning``, once per distinct message (and arguments) in this process."""
        key = (str(msg), args, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key in self._warned:
            return
        self._warned.add(key)
        self.warning(msg, *args, **kwargs)

    @property
    def _warned(self) -> set[Any]:
        seen: set[Any] | None = self.__dict__.get("_seen")
        if seen is None:
            seen = self.__dict__["_seen"] = set()
        return seen


def get_logger(name: str, log_level: str | int | None = None) -> MultiProcessAdapter:
    """The logger ``name`` wrapped so that it logs on the main process only by default.

    Args:
        name: the logger's name (usually ``__name__``).
        log_level: level to set on the logger (e.g. ``"INFO"``); None leaves it.
    """
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper() if isinstance(log_level, str) else log_level)
    return MultiProcessAdapter(logger, {})


__all__ = ["MultiProcessAdapter", "get_logger"]
