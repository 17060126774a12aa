"""What every tracker shares: the :class:`GeneralTracker` interface and value helpers.

The built-in trackers (:mod:`~nbaccel.tracking.trackers`) and the ones backed by
third-party packages (:mod:`~nbaccel.tracking.backends`) both build on this module.

Example:
    >>> flatten({"loss": 0.5, "lr": {"head": 1e-3}})
    {'loss': 0.5, 'lr/head': 0.001}
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def on_main_process(function: F) -> F:
    """Decorator for tracker methods: run only on rank 0 when ``self.main_process_only``.

    Example:
        >>> class Quiet(GeneralTracker):
        ...     name = "quiet"
        ...     @on_main_process
        ...     def log(self, values, step=None, **kwargs):
        ...         return "logged"
        >>> Quiet().log({})  # one process: rank 0
        'logged'
    """

    @functools.wraps(function)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        from .progress import _rank  # the one rank lookup of tracking (state or env)

        if getattr(self, "main_process_only", True) and _rank() != 0:
            return None
        return function(self, *args, **kwargs)

    return run  # type: ignore[return-value]


class GeneralTracker:
    """Base class of every tracker; subclass it for your own.

    A subclass sets ``name`` and overrides ``log``; the other methods have useful
    defaults. Trackers are created by :func:`start_trackers` on the main process only.

    Attributes:
        name: the name used in ``log_with`` and ``get_tracker(name)``.
        requires_logging_directory: if True, construction needs a ``logging_dir``
            (``Accelerator(project_dir=...)``) and the class is built as
            ``cls(project_name, logging_dir, **init_kwargs)``.
        main_process_only: kept for API parity; nbaccel starts trackers on rank 0 only.

    Example:
        >>> class Collect(GeneralTracker):
        ...     name = "collect"
        ...     def __init__(self):
        ...         self.rows = []
        ...     def log(self, values, step=None, **kwargs):
        ...         self.rows.append((step, dict(values)))
        >>> t = Collect()
        >>> t.log({"acc": 1.0}, step=3)
        >>> t.rows
        [(3, {'acc': 1.0})]
    """

    name: ClassVar[str] = ""
    requires_logging_directory: ClassVar[bool] = False
    main_process_only: ClassVar[bool] = True

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters (called once, by ``init_trackers(config=...)``)."""

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` (name -> number, string or dict of numbers) at ``step``."""
        raise NotImplementedError(f"{type(self).__name__} must implement log(values, step)")

    def finish(self) -> None:
        """Flush and close (called by ``end_training()``)."""

    @property
    def tracker(self) -> Any:
        """The underlying object (a ``SummaryWriter``, a wandb run, ...); ``self`` by default."""
        return self


def scalar(value: Any) -> float | int | None:
    """``value`` as a Python number if it is one (0-d tensors and numpy scalars included)."""
    if isinstance(value, bool | int | float):
        return value
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        result = item()
        if isinstance(result, bool | int | float):
            return result
    return None


def plain(value: Any) -> Any:
    """A JSON-friendly version of ``value`` (numbers unwrapped, unknown objects as str)."""
    number = scalar(value)
    if number is not None:
        return number
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if value is None or isinstance(value, str):
        return value
    return str(value)


def warn_skipped(tracker: str, key: str, value: Any) -> None:
    warnings.warn(
        f"{tracker} tracker skipped {key!r}: a {type(value).__name__} is not a number, "
        "string or dict of numbers.",
        stacklevel=3,
    )


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}/"))
        else:
            flat[name] = plain(value)
    return flat


__all__ = ["GeneralTracker", "flatten", "on_main_process", "plain", "scalar", "warn_skipped"]
