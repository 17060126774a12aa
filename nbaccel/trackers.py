"""Experiment trackers (``Accelerator(log_with=...)``), started on the main process only.

One small interface, :class:`GeneralTracker`, and a handful of real trackers:
TensorBoard (event files TensorBoard reads), JSONL and CSV (no extra dependency),
Weights & Biases and MLflow (when installed; imported lazily). A user-defined
subclass works anywhere a tracker name does.

Example:
    >>> from nbaccel.trackers import GeneralTracker, start_trackers
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
import time
import warnings
from collections.abc import Iterable, Mapping
from enum import Enum
from pathlib import Path
from typing import IO, Any, ClassVar

from .errors import ConfigError


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


class LoggerType(str, Enum):
    """Names of the built-in trackers (plain strings work too)."""

    ALL = "all"
    TENSORBOARD = "tensorboard"
    JSONL = "jsonl"
    CSV = "csv"
    WANDB = "wandb"
    MLFLOW = "mlflow"


def _scalar(value: Any) -> float | int | None:
    """``value`` as a Python number if it is one (0-d tensors and numpy scalars included)."""
    if isinstance(value, bool | int | float):
        return value
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        result = item()
        if isinstance(result, bool | int | float):
            return result
    return None


def _plain(value: Any) -> Any:
    """A JSON-friendly version of ``value`` (numbers unwrapped, unknown objects as str)."""
    number = _scalar(value)
    if number is not None:
        return number
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str):
        return value
    return str(value)


def _warn_skipped(tracker: str, key: str, value: Any) -> None:
    warnings.warn(
        f"{tracker} tracker skipped {key!r}: a {type(value).__name__} is not a number, "
        "string or dict of numbers.",
        stacklevel=3,
    )


class TensorBoardTracker(GeneralTracker):
    """Writes TensorBoard event files under ``logging_dir/run_name``.

    Numbers (0-d tensors too) become scalars, strings become text, dicts of numbers
    become ``add_scalars`` groups. Each ``log`` flushes, so TensorBoard can follow
    a running job.

    Args:
        run_name: the project name given to ``init_trackers``.
        logging_dir: root directory of the event files.
        **kwargs: forwarded to ``torch.utils.tensorboard.SummaryWriter``.
    """

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch raises this when the tensorboard package is missing
            raise ConfigError(
                "log_with='tensorboard' needs the tensorboard package: pip install tensorboard"
            ) from err
        self.run_name = run_name
        self.logging_dir = Path(logging_dir) / run_name
        self.writer = SummaryWriter(str(self.logging_dir), **kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        hparams = {}
        for key, value in values.items():
            number = _scalar(value)
            hparams[str(key)] = number if number is not None else str(value)
        self.writer.add_hparams(hparams, metric_dict={})
        self.writer.flush()

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            number = _scalar(value)
            if number is not None:
                self.writer.add_scalar(key, number, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, Mapping):
                group = {str(k): _scalar(v) for k, v in value.items()}
                self.writer.add_scalars(
                    key, {k: v for k, v in group.items() if v is not None}, global_step=step
                )
            else:
                _warn_skipped(self.name, key, value)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class _FileTracker(GeneralTracker):
    """Shared part of the dependency-free trackers: one directory, ``config.json``, one file."""

    requires_logging_directory = True
    filename: ClassVar[str] = ""

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str]) -> None:
        self.run_name = run_name
        self.logging_dir = Path(logging_dir) / run_name
        self.logging_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.logging_dir / self.filename
        self._file: IO[str] = open(self.path, "a", encoding="utf-8", newline="")  # noqa: SIM115

    @property
    def tracker(self) -> Any:
        return self._file

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        config = self.logging_dir / "config.json"
        config.write_text(json.dumps(_plain(values), indent=2, sort_keys=True), encoding="utf-8")

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
        record = {"step": step, "time": time.time(), **_plain(values)}
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

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str]) -> None:
        super().__init__(run_name, logging_dir)
        self._writer = csv.writer(self._file)
        if self._file.tell() == 0:
            self._writer.writerow(["step", "time", "key", "value"])

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        now = time.time()
        for key, value in _flatten(values).items():
            self._writer.writerow(["" if step is None else step, now, key, value])
        self._file.flush()


def _flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}/"))
        else:
            flat[name] = _plain(value)
    return flat


class WandBTracker(GeneralTracker):
    """Weights & Biases (``pip install wandb``); pass ``init_kwargs={"wandb": {"mode": "offline"}}``
    to log without an account.

    Args:
        run_name: used as the wandb ``project``.
        logging_dir: if given, wandb's ``dir`` (created if missing).
        **kwargs: forwarded to ``wandb.init``.
    """

    name = "wandb"

    def __init__(
        self, run_name: str, logging_dir: str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> None:
        import wandb

        if logging_dir is not None and "dir" not in kwargs:
            Path(logging_dir).mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(logging_dir)
        self.run = wandb.init(project=run_name, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.run.config.update(_plain(values), allow_val_change=True)

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(dict(values), step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class MLflowTracker(GeneralTracker):
    """MLflow (``pip install mlflow`` or ``mlflow-skinny``).

    Without ``MLFLOW_TRACKING_URI`` and with a logging directory, runs are stored in
    ``logging_dir/mlflow.db`` (SQLite; needs SQLAlchemy) or else the file store
    ``logging_dir/mlruns``; with neither, MLflow's own default applies.

    Args:
        run_name: the MLflow experiment name.
        logging_dir: where the local file store goes.
        **kwargs: forwarded to ``mlflow.start_run`` (``run_name``, ``tags``, ``nested``...).
    """

    name = "mlflow"
    _max_params_per_batch = 100  # MLflow rejects larger log_params batches
    _max_param_length = 500  # and longer parameter values on older servers

    def __init__(
        self, run_name: str, logging_dir: str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> None:
        import mlflow

        self._mlflow = mlflow
        if logging_dir is not None and not os.environ.get("MLFLOW_TRACKING_URI"):
            root = Path(logging_dir).resolve()
            root.mkdir(parents=True, exist_ok=True)
            # MLflow >= 3 prefers a SQLite store (needs SQLAlchemy, absent from mlflow-skinny)
            if importlib.util.find_spec("sqlalchemy") is not None:
                mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
            else:
                mlflow.set_tracking_uri((root / "mlruns").as_uri())
        mlflow.set_experiment(run_name)
        self.run = mlflow.start_run(**kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        params = {k: str(v)[: self._max_param_length] for k, v in _flatten(values).items()}
        items = list(params.items())
        for start in range(0, len(items), self._max_params_per_batch):
            self._mlflow.log_params(dict(items[start : start + self._max_params_per_batch]))

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        metrics = {}
        for key, value in _flatten(values).items():
            if isinstance(value, bool | int | float):
                metrics[key] = float(value)
            else:
                _warn_skipped(self.name, key, value)
        self._mlflow.log_metrics(metrics, step=step, **kwargs)

    def finish(self) -> None:
        self._mlflow.end_run()


# name -> (class, module whose presence makes it "installed"; None = always available)
_BUILTIN: dict[str, tuple[type[GeneralTracker], str | None]] = {
    "tensorboard": (TensorBoardTracker, "tensorboard"),
    "jsonl": (JSONLTracker, None),
    "csv": (CSVTracker, None),
    "wandb": (WandBTracker, "wandb"),
    "mlflow": (MLflowTracker, "mlflow"),
}


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
            cls = _BUILTIN[item][0] if isinstance(item, str) else item
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
