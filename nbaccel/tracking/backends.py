"""Trackers backed by third-party packages: TensorBoard, Weights & Biases, MLflow.

Each package is imported when its tracker is created, never at import time. The
public names are re-exported by :mod:`nbaccel.tracking.trackers`.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from .base import GeneralTracker, flatten, plain, scalar, warn_skipped


class TensorBoardTracker(GeneralTracker):
    """Writes TensorBoard event files under ``logging_dir/run_name``.

    Numbers (0-d tensors too) become scalars, strings become text, dicts of numbers
    become ``add_scalars`` groups. The ``init_trackers`` config goes to ``add_hparams`` and,
    as with Accelerate, to ``logging_dir/run_name/<time>/hparams.yml``. Each ``log`` flushes, so TensorBoard can follow
    a running job.

    A second run with the same name (a notebook run again) writes to
    ``logging_dir/run_name-2`` (then ``-3``, ...) instead of adding its points to the
    first run's curves; TensorBoard shows them as separate runs. ``resume=True``
    continues in the latest of those directories.

    Args:
        run_name: the project name given to ``init_trackers``.
        logging_dir: root directory of the event files.
        resume: write into the latest existing run directory instead of a new one.
        **kwargs: forwarded to ``torch.utils.tensorboard.SummaryWriter``.
    """

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(
        self,
        run_name: str,
        logging_dir: str | os.PathLike[str],
        *,
        resume: bool = False,
        **kwargs: Any,
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch raises this when the tensorboard package is missing
            raise ConfigError(
                "log_with='tensorboard' needs the tensorboard package: pip install tensorboard"
            ) from err
        self.run_name = run_name
        self.logging_dir = _run_directory(Path(logging_dir), run_name, resume)
        self.writer = SummaryWriter(str(self.logging_dir), **kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        hparams = {}
        for key, value in values.items():
            number = scalar(value)
            hparams[str(key)] = number if number is not None else str(value)
        self.writer.add_hparams(hparams, metric_dict={})
        self.writer.flush()
        # and, as Accelerate's tracker does, <logging_dir>/<run>/<time>/hparams.yml
        folder = self.logging_dir / str(time.time())
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "hparams.yml", "w") as stream:
            yaml.safe_dump(_yaml_plain(dict(values)), stream)

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            number = scalar(value)
            if number is not None:
                self.writer.add_scalar(key, number, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, Mapping):
                group = {str(k): scalar(v) for k, v in value.items()}
                self.writer.add_scalars(
                    key, {k: v for k, v in group.items() if v is not None}, global_step=step
                )
            else:
                warn_skipped(self.name, key, value)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


def _yaml_plain(value: Any) -> Any:
    """``value`` with what YAML cannot represent safely written as its ``str``."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _yaml_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_yaml_plain(v) for v in value]
    number = scalar(value)  # 0-d tensors, numpy scalars
    return number if number is not None else str(value)


def _has_events(folder: Path) -> bool:
    return folder.is_dir() and any(folder.rglob("events.out.tfevents.*"))


def _run_directory(root: Path, run_name: str, resume: bool) -> Path:
    """``root/run_name`` if unused, else the first unused ``root/run_name-N`` (N >= 2)."""
    candidates = [root / run_name]
    while _has_events(candidates[-1]):
        candidates.append(root / f"{run_name}-{len(candidates) + 1}")
    if resume and len(candidates) > 1:
        return candidates[-2]  # the latest run that has events
    return candidates[-1]


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
        self.run.config.update(plain(values), allow_val_change=True)

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
        params = {k: str(v)[: self._max_param_length] for k, v in flatten(values).items()}
        items = list(params.items())
        for start in range(0, len(items), self._max_params_per_batch):
            self._mlflow.log_params(dict(items[start : start + self._max_params_per_batch]))

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        metrics = {}
        for key, value in flatten(values).items():
            if isinstance(value, bool | int | float):
                metrics[key] = float(value)
            else:
                warn_skipped(self.name, key, value)
        self._mlflow.log_metrics(metrics, step=step, **kwargs)

    def finish(self) -> None:
        self._mlflow.end_run()


__all__ = ["MLflowTracker", "TensorBoardTracker", "WandBTracker"]
