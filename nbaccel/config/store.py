"""The launch configuration as a YAML file: load, save, and a first file for this machine.

The file format and atomic writing are :mod:`nbaccel.config.file`; this module turns
its values into a validated :class:`~nbaccel.config.LaunchConfig` and back.

Example:
    >>> from nbaccel.config import LaunchConfig
    >>> path = save_config(LaunchConfig(num_processes=2), "/tmp/nbaccel_doc.yaml")
    >>> load_config(path).num_processes
    2
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..platform.hardware import detect_hardware
from ..platform.hosts import NotebookHost
from .choices import normalize_precision
from .fields import coerce, field_names
from .file import default_config_path, read_config_values, write_config_values
from .launch_config import LaunchConfig


def values_from_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``path`` into ``{field: checked value}`` (types checked, ranges not yet)."""
    raw = read_config_values(path, field_names())
    return {k: coerce(k, v, f"config file {path}") for k, v in raw.items()}


def load_config(path: str | os.PathLike[str] | None = None) -> LaunchConfig:
    """Load and validate a YAML config file (default: :func:`default_config_path`).

    Keys missing from the file take the defaults; old key names are migrated.

    Raises:
        ConfigError: missing or non-YAML file, unknown key, wrong type, invalid value;
            the message names the key and the file.

    Example:
        >>> from nbaccel.config import LaunchConfig, load_config, save_config
        >>> path = save_config(LaunchConfig(num_processes=2), "/tmp/nbaccel_doc.yaml")
        >>> load_config(path).num_processes
        2
    """
    path = default_config_path() if path is None else Path(path)
    values = values_from_file(path)
    try:
        return LaunchConfig(**values)
    except ConfigError as err:
        raise ConfigError(f"{err} (in config file {path})") from None


def save_config(cfg: LaunchConfig, path: str | os.PathLike[str] | None = None) -> Path:
    """Atomically write ``cfg`` as YAML (default: :func:`default_config_path`); return the path.

    Example:
        >>> from nbaccel.config import LaunchConfig, save_config
        >>> save_config(LaunchConfig(mixed_precision="bf16"), "/tmp/nbaccel_doc2.yaml")
        PosixPath('/tmp/nbaccel_doc2.yaml')
    """
    if not isinstance(cfg, LaunchConfig):
        raise TypeError(f"save_config expects a LaunchConfig, got {type(cfg).__name__}.")
    return write_config_values(dataclasses.asdict(cfg), path or default_config_path())


def write_basic_config(
    mixed_precision: str = "no", save_location: str | os.PathLike[str] | None = None
) -> Path | None:
    """Write a config for the detected hardware; never initialises CUDA.

    GPUs -> one process per GPU; TPU -> one per chip; CPU only -> one process.
    Returns the path written, or ``None`` (leaving the file alone) when a config
    already exists there.

    Example:
        >>> write_basic_config(mixed_precision="bf16")  # doctest: +SKIP
        PosixPath('/root/.cache/nbaccel/default_config.yaml')
    """
    path = Path(save_location).expanduser() if save_location else default_config_path()
    if path.exists():
        return None
    precision = normalize_precision(mixed_precision)
    hw = detect_hardware()
    cfg = LaunchConfig(
        compute_device=hw.kind,  # type: ignore[arg-type]
        num_processes=hw.device_count if hw.kind != "cpu" else 1,
        mixed_precision=precision,  # type: ignore[arg-type]
    )
    return save_config(cfg, path)


def with_host_defaults(cfg: LaunchConfig, host: NotebookHost, device_kind: str) -> LaunchConfig:
    """``cfg`` with the notebook host's suggestions where ``cfg`` still has the defaults.

    Only ``num_processes`` and ``mixed_precision`` ("auto" already finds the device),
    and only when the detected devices (``device_kind``: "gpu", "tpu", "cpu") are the
    host's and ``cfg`` targets them: TPU markers without torch_xla suggest nothing.
    A value the user chose (file, environment, argument) is never replaced.

    Example:
        >>> from nbaccel.platform.hosts import detect_host
        >>> kaggle = detect_host({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, ["Tesla T4"] * 2)
        >>> cfg = with_host_defaults(LaunchConfig(), kaggle, "gpu")
        >>> cfg.num_processes, cfg.mixed_precision
        (2, 'fp16')
    """
    if device_kind != host.accelerator or cfg.compute_device not in ("auto", device_kind):
        return cfg
    base = LaunchConfig()
    changes = {
        name: value
        for name, value in host.defaults().items()
        if name in ("num_processes", "mixed_precision")
        and getattr(cfg, name) == getattr(base, name)
    }
    return cfg.replace(**changes) if changes else cfg


__all__ = [
    "load_config",
    "save_config",
    "values_from_file",
    "with_host_defaults",
    "write_basic_config",
]
