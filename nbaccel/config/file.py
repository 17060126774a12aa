"""YAML storage of the launch configuration: where it lives, reading, atomic writing.

:mod:`nbaccel.config.store` turns these values into a ``LaunchConfig``;
:mod:`nbaccel.config` re-exports the public functions.

File format (``config_version`` first, then one key per ``LaunchConfig`` field)::

    config_version: 1
    compute_device: gpu
    num_processes: 8
    mixed_precision: bf16
    ...

An Accelerate config file (``accelerate config``'s YAML or JSON) is recognised and
translated (:mod:`nbaccel.config.accelerate_file`). Older files still load: keys renamed
since are mapped by :data:`RENAMED_KEYS`, missing keys fall back to the defaults, and a
file without ``config_version`` is treated as version 0.

Example:
    >>> from nbaccel.config.file import default_config_path
    >>> default_config_path({"NBACCEL_CONFIG_FILE": "/tmp/x.yaml"}).name
    'x.yaml'
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from .accelerate_file import accelerate_values, is_accelerate_config

CONFIG_VERSION = 1

# Old key -> current key. Version 0 files (and hand-written files in the naming of the
# best-known peer) used these names; they load as if written with the new ones.
RENAMED_KEYS: dict[str, str] = {
    "num_machines": "num_nodes",
    "machine_rank": "node_rank",
    "main_process_ip": "master_addr",
    "main_process_port": "master_port",
    "debug_mode": "debug",
}


def default_config_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where the default config lives.

    ``$NBACCEL_CONFIG_FILE`` if set, else ``$XDG_CACHE_HOME/nbaccel/default_config.yaml``,
    else ``~/.cache/nbaccel/default_config.yaml``.

    Example:
        >>> str(default_config_path({"XDG_CACHE_HOME": "/c"}))
        '/c/nbaccel/default_config.yaml'
    """
    env = os.environ if environ is None else environ
    explicit = env.get("NBACCEL_CONFIG_FILE")
    if explicit:
        return Path(explicit).expanduser()
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "nbaccel" / "default_config.yaml"


def _migrate(data: dict[str, Any], path: Path) -> dict[str, Any]:
    version = data.pop("config_version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ConfigError(f"config_version={version!r} in {path} must be an int >= 0.")
    out: dict[str, Any] = {}
    for key, value in data.items():
        new = RENAMED_KEYS.get(key, key)
        if new in data and new != key:
            raise ConfigError(
                f"{path} sets both {key!r} (old name) and {new!r}; keep only {new!r}."
            )
        out[new] = value
    # The peer's `use_cpu: true` becomes the explicit compute device.
    use_cpu = out.pop("use_cpu", None)
    if use_cpu is True and "compute_device" not in out:
        out["compute_device"] = "cpu"
    out["__version__"] = version
    return out


def _parse(path: Path) -> Any:
    """The parsed content of ``path`` (JSON by its suffix, as `accelerate config` may write,
    else YAML); None for an empty file. Raises ConfigError naming the file and the fix."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path} does not exist; create one with `nbaccel config`."
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from None
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text) if text.strip() else None
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"config file {path} is not valid JSON (line {err.lineno}): {err.msg}; fix it."
            ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(
            f"config file {path} is not valid YAML{line}: {getattr(err, 'problem', err)}; "
            "fix it or rewrite it with `nbaccel config --default`."
        ) from None


def read_config_values(path: str | os.PathLike[str], valid_keys: Iterable[str]) -> dict[str, Any]:
    """Read ``path`` into a ``{field: raw value}`` dict, migrating old key names.

    An Accelerate config file (YAML or JSON) is translated key by key.

    Raises:
        ConfigError: the file is unreadable, not YAML, not a mapping, or has unknown keys
            (the message names the key, the file and the valid keys).
    """
    path = Path(path)
    data = _parse(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a YAML mapping of key: value, "
            f"not a {type(data).__name__}."
        )
    if is_accelerate_config(data):
        return accelerate_values({str(k): v for k, v in data.items()}, path)
    values = _migrate({str(k): v for k, v in data.items()}, path)
    version = values.pop("__version__")
    valid = sorted(valid_keys)
    unknown = sorted(set(values) - set(valid))
    if unknown:
        newer = (
            f" (it was written by a newer nbaccel: config_version {version} > {CONFIG_VERSION})"
            if version > CONFIG_VERSION
            else ""
        )
        raise ConfigError(
            f"unknown key {unknown[0]!r} in config file {path}{newer}; "
            f"valid keys: {', '.join(['config_version', *valid])}."
        )
    return values


def is_accelerate_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds Accelerate's config file (False if missing or unreadable).

    Example:
        >>> is_accelerate_file("/nonexistent.yaml")
        False
    """
    try:
        data = _parse(Path(path))
    except ConfigError:
        return False
    return isinstance(data, dict) and is_accelerate_config(data)


def write_config_values(values: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Atomically write ``values`` (plus ``config_version``) as YAML to ``path``.

    Writes a temporary file in the same directory, fsyncs it, then renames it over
    ``path``, so a reader never sees a half-written file.
    """
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(
        {"config_version": CONFIG_VERSION, **values}, sort_keys=False, default_flow_style=False
    )
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


__all__ = [
    "CONFIG_VERSION",
    "RENAMED_KEYS",
    "default_config_path",
    "is_accelerate_file",
    "read_config_values",
    "write_config_values",
]
