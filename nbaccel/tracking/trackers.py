"""Experiment trackers (``Accelerator(log_with=...)``), started on the main process only.

One small interface, :class:`GeneralTracker`, and a handful of real trackers:
TensorBoard (event files TensorBoard reads), JSONL and CSV (no extra dependency),
Weights & Biases and MLflow (when installed; imported lazily). A user-defined
subclass works anywhere a tracker name does.

Example:
    >>> from nbaccel.tracking.trackers import GeneralTracker, start_trackers
    >>> class PrintTracker(GeneralTracker):
    ...     name = "print"
    ...     def log(self, values, step=None, **kwargs):
    ...         print(step, values)
    >>> [tracker] = start_trackers([PrintTracker()], "demo", None)
    >>> tracker.log({"loss": 0.5}, step=1)
    1 {'loss': 0.5}
"""

from __future__ import annotations

import csv
import importlib.util
import inspect
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping
from enum import Enum
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar

from ..errors import ConfigError
from .base import GeneralTracker, flatten, plain

if TYPE_CHECKING:  # resolved lazily by __getattr__ below
    from .backends import MLflowTracker, TensorBoardTracker, WandBTracker


class LoggerType(str, Enum):
    """Names of the built-in trackers (plain strings work too)."""

    ALL = "all"
    TENSORBOARD = "tensorboard"
    JSONL = "jsonl"
    CSV = "csv"
    WANDB = "wandb"
    MLFLOW = "mlflow"


class _FileTracker(GeneralTracker):
    """Shared part of the dependency-free trackers: one directory, ``config.json``, one file.

    Each run writes a fresh metrics file, so a notebook run twice (or "Restart & Run
    All") never mixes two runs in one file: an earlier run's file is kept, renamed to
    ``metrics.1.jsonl``, ``metrics.2.jsonl``, ... (oldest first), together with its
    ``config.json``. Pass ``resume=True`` (``init_kwargs={"jsonl": {"resume": True}}``)
    to append to the existing file instead, e.g. when resuming from a checkpoint.
    """

    requires_logging_directory = True
    filename: ClassVar[str] = ""

    def __init__(
        self, run_name: str, logging_dir: str | os.PathLike[str], *, resume: bool = False
    ) -> None:
        if not isinstance(resume, bool):
            raise ConfigError(
                f"resume={resume!r} must be True (append to the last run's {self.filename}) "
                "or False (start a new file, keeping the old one under a numbered name)."
            )
        self.run_name = run_name
        self.logging_dir = Path(logging_dir) / run_name
        self.logging_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.logging_dir / self.filename
        #: where the previous run's metrics went (None: there was none, or ``resume``)
        self.previous_run: Path | None = None
        if not resume and self.path.is_file() and self.path.stat().st_size > 0:
            self.previous_run = self._keep_previous_run()
        self._file: IO[str] = open(self.path, "a", encoding="utf-8", newline="")  # noqa: SIM115

    def _keep_previous_run(self) -> Path:
        stem, suffix = self.path.stem, self.path.suffix
        number = 1
        while (self.logging_dir / f"{stem}.{number}{suffix}").exists():
            number += 1
        kept = self.logging_dir / f"{stem}.{number}{suffix}"
        os.rename(self.path, kept)
        config = self.logging_dir / "config.json"
        if config.is_file():
            os.rename(config, self.logging_dir / f"config.{number}.json")
        return kept

    @property
    def tracker(self) -> Any:
        return self._file

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        config = self.logging_dir / "config.json"
        config.write_text(json.dumps(plain(values), indent=2, sort_keys=True), encoding="utf-8")

    def finish(self) -> None:
        self._file.close()


class JSONLTracker(_FileTracker):
    """Appends one JSON object per ``log`` call to ``logging_dir/run_name/metrics.jsonl``.

    Each line is ``{"step": ..., "time": ..., **values}``; read it back with
    ``[json.loads(line) for line in open(path)]`` or ``pandas.read_json(path, lines=True)``.
    """

    name = "jsonl"
    filename = "metrics.jsonl"

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        record = {"step": step, "time": time.time(), **plain(values)}
        # NaN/inf are not JSON; store them as null rather than writing an unreadable line
        for key, value in record.items():
            if isinstance(value, float) and not math.isfinite(value):
                record[key] = None
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()


class CSVTracker(_FileTracker):
    """Appends rows ``step,time,key,value`` to ``logging_dir/run_name/metrics.csv``.

    The long format keeps the columns fixed however many metrics appear later;
    ``pandas.read_csv(path).pivot_table(index="step", columns="key", values="value")``
    gives the wide table. Nested dicts are flattened as ``outer/inner``.
    """

    name = "csv"
    filename = "metrics.csv"

    def __init__(
        self, run_name: str, logging_dir: str | os.PathLike[str], *, resume: bool = False
    ) -> None:
        super().__init__(run_name, logging_dir, resume=resume)
        self._writer = csv.writer(self._file)
        if self._file.tell() == 0:
            self._writer.writerow(["step", "time", "key", "value"])

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        now = time.time()
        for key, value in flatten(values).items():
            self._writer.writerow(["" if step is None else step, now, key, value])
        self._file.flush()


# name -> (class name, module whose presence makes it "installed"; None = always available)
_BUILTIN: dict[str, tuple[str, str | None]] = {
    "tensorboard": ("TensorBoardTracker", "tensorboard"),
    "jsonl": ("JSONLTracker", None),
    "csv": ("CSVTracker", None),
    "wandb": ("WandBTracker", "wandb"),
    "mlflow": ("MLflowTracker", "mlflow"),
}
_BACKENDS = ("MLflowTracker", "TensorBoardTracker", "WandBTracker")


def __getattr__(name: str) -> Any:
    # the trackers built on third-party packages live in a module of their own
    if name in _BACKENDS:
        return getattr(importlib.import_module(".backends", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _builtin_class(name: str) -> type[GeneralTracker]:
    cls: type[GeneralTracker] = getattr(sys.modules[__name__], _BUILTIN[name][0])
    return cls


def available_trackers() -> list[str]:
    """Names of the built-in trackers whose dependencies are installed (``log_with="all"``).

    Example:
        >>> {"jsonl", "csv"} <= set(available_trackers())
        True
    """
    return [
        name
        for name, (_, module) in _BUILTIN.items()
        if module is None or importlib.util.find_spec(module) is not None
    ]


def _resolve(log_with: Any) -> list[str | GeneralTracker | type[GeneralTracker]]:
    """Normalise ``log_with`` to a list of tracker names, instances and classes."""
    if log_with is None:
        return []
    items: Iterable[Any] = (
        [log_with] if isinstance(log_with, str | GeneralTracker | type) else log_with
    )
    resolved: list[str | GeneralTracker | type[GeneralTracker]] = []
    for item in items:
        if isinstance(item, GeneralTracker) or (
            isinstance(item, type) and issubclass(item, GeneralTracker)
        ):
            resolved.append(item)
        elif isinstance(item, str):
            name = (item.value if isinstance(item, Enum) else item).strip().lower()
            if name == "all":
                resolved.extend(available_trackers())
            elif name in _BUILTIN:
                resolved.append(name)
            else:
                raise ConfigError(
                    f"log_with={item!r} is not a known tracker; use one of "
                    f"{', '.join(['all', *_BUILTIN])}, or pass a GeneralTracker subclass instance."
                )
        else:
            raise ConfigError(
                f"log_with got {item!r} ({type(item).__name__}); pass a tracker name, a list of "
                "names, 'all', or GeneralTracker instances."
            )
    return resolved


def start_trackers(
    log_with: Any,
    project_name: str,
    logging_dir: str | os.PathLike[str] | None,
    config: Mapping[str, Any] | None = None,
    init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[GeneralTracker]:
    """Create the trackers named by ``log_with`` and store ``config`` in each.

    Call this on the main process only (``Accelerator.init_trackers`` does).

    Args:
        log_with: a name (``"tensorboard"``, ``"jsonl"``, ``"csv"``, ``"wandb"``,
            ``"mlflow"``, ``"all"``), a ``GeneralTracker`` instance or class, or a list of those.
            A class is built like the built-ins: ``cls(project_name, logging_dir, **kw)`` if it
            ``requires_logging_directory``, else ``cls(project_name, **kw)``.
        project_name: the run/project name (a sub-directory of ``logging_dir`` for file trackers).
        logging_dir: root directory for trackers that write files.
        config: hyperparameters passed to every tracker's ``store_init_configuration``.
        init_kwargs: per-tracker constructor keywords, e.g. ``{"wandb": {"mode": "offline"}}``.

    Returns:
        The started trackers, in ``log_with`` order, duplicates removed by name.

    Raises:
        ConfigError: unknown tracker name, or a tracker needs ``logging_dir`` and none is set.

    Example:
        >>> import tempfile
        >>> [t] = start_trackers("jsonl", "run", tempfile.mkdtemp())
        >>> t.log({"loss": 1.0}, step=0); t.finish()
    """
    init_kwargs = dict(init_kwargs or {})
    started: list[GeneralTracker] = []
    seen: set[str] = set()
    for item in _resolve(log_with):
        if isinstance(item, GeneralTracker):
            tracker = item
        else:
            cls = _builtin_class(item) if isinstance(item, str) else item
            if cls.name in seen:
                continue
            kwargs = dict(init_kwargs.get(cls.name, {}))
            if cls.requires_logging_directory:
                if logging_dir is None:
                    raise ConfigError(
                        f"the {cls.name!r} tracker writes files and needs a logging directory: "
                        "pass Accelerator(project_dir='runs/my_run') or "
                        "project_config=ProjectConfiguration(logging_dir=...)."
                    )
                tracker = cls(project_name, logging_dir, **kwargs)  # type: ignore[call-arg]
            else:
                # optional directory (wandb's dir, mlflow's file store) when the class takes one
                if logging_dir is not None and "logging_dir" in inspect.signature(cls).parameters:
                    kwargs.setdefault("logging_dir", logging_dir)
                tracker = cls(project_name, **kwargs)  # type: ignore[call-arg]
        if not isinstance(tracker.name, str) or not tracker.name:
            raise ConfigError(
                f"{type(tracker).__name__} has no name: set a class attribute name = '...'."
            )
        if tracker.name in seen:
            continue
        seen.add(tracker.name)
        if config is not None:
            tracker.store_init_configuration(config)
        started.append(tracker)
    return started


def find_tracker(trackers: Iterable[GeneralTracker], name: str, unwrap: bool = False) -> Any:
    """The started tracker called ``name`` (its underlying object if ``unwrap``).

    Raises:
        ConfigError: no tracker of that name was started.
    """
    trackers = list(trackers)
    for tracker in trackers:
        if tracker.name == name:
            return tracker.tracker if unwrap else tracker
    names = ", ".join(t.name for t in trackers) or "none"
    raise ConfigError(
        f"no tracker named {name!r} was started (started: {names}); "
        "pass it in Accelerator(log_with=...) and call init_trackers() first."
    )


__all__ = [
    "CSVTracker",
    "GeneralTracker",
    "JSONLTracker",
    "LoggerType",
    "MLflowTracker",
    "TensorBoardTracker",
    "WandBTracker",
    "available_trackers",
    "find_tracker",
    "start_trackers",
]
