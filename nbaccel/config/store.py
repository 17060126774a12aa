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
from .choices import normalize_precision
from .file import default_config_path, read_config_values, write_config_values
from .launch_config import LaunchConfig, coerce, field_names


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


__all__ = ["load_config", "save_config", "values_from_file", "write_basic_config"]
