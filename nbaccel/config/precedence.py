"""Where a launch setting comes from, highest first.

1. explicit arguments (``notebook_launcher(num_processes=...)``, CLI flags, the panel);
2. ``NBACCEL_*`` environment variables (``NBACCEL_MIXED_PRECISION``, ``NBACCEL_USE_CPU``, ...);
3. the YAML config file (``$NBACCEL_CONFIG_FILE``, else ``$XDG_CACHE_HOME/nbaccel/
   default_config.yaml``, else ``~/.cache/nbaccel/default_config.yaml``);
4. the defaults of :class:`~nbaccel.config.LaunchConfig`.

A process started by nbaccel's launcher does not read them: the launcher resolves the
configuration once, in the kernel (or in ``nbaccel launch``), and each worker receives
that :class:`~nbaccel.config.LaunchConfig` object, typed, and installs it
(:func:`install_launch_config`). :func:`launch_config` is what the runtime asks: the
installed object, else the sources above (under torchrun, in a script, in the kernel).

Example:
    >>> cfg = resolve_launch_config({"num_processes": 2}, environ={}, config_file=False)
    >>> cfg.num_processes
    2
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError
from .fields import FALSE_WORDS, TRUE_WORDS, coerce, field_names
from .file import default_config_path
from .launch_config import LaunchConfig
from .store import values_from_file


# ------------------------------------------------------------------ environment variables
def _env_var(name: str) -> str:
    return "NBACCEL_DEBUG_MODE" if name == "debug" else f"NBACCEL_{name.upper()}"


#: environment variable -> LaunchConfig field (derived from the fields), plus NBACCEL_USE_CPU.
ENV_VARS: dict[str, str] = {_env_var(f.name): f.name for f in dataclasses.fields(LaunchConfig)}


def _from_environment(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    for var, name in ENV_VARS.items():
        raw = environ.get(var)
        if raw is not None and raw.strip() != "":
            out[name] = (coerce(name, raw, f"environment variable {var}", from_text=True), var)
    use_cpu = environ.get("NBACCEL_USE_CPU", "").strip().lower()
    if use_cpu in TRUE_WORDS:
        if out.get("compute_device", ("cpu",))[0] != "cpu":
            raise ConfigError(
                "NBACCEL_USE_CPU=1 contradicts NBACCEL_COMPUTE_DEVICE="
                f"{out['compute_device'][0]!r}; unset one of them."
            )
        out["compute_device"] = ("cpu", "NBACCEL_USE_CPU")
    elif use_cpu not in (*FALSE_WORDS, ""):
        raise ConfigError(f"NBACCEL_USE_CPU={use_cpu!r} must be 1 or 0.")
    return out


# ----------------------------------------------------------------------- precedence
def _annotate(err: ConfigError, sources: Mapping[str, str]) -> ConfigError:
    named = [n for n in re.findall(r"\b([a-z_]+)=", str(err)) if n in sources]
    where = "; ".join(f"{n} came from {sources[n]}" for n in dict.fromkeys(named))
    return ConfigError(f"{err} ({where})") if where else err


def resolve_launch_config(
    overrides: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | Literal[False] | None = None,
) -> LaunchConfig:
    """Merge every source of settings into one validated :class:`LaunchConfig`.

    Precedence (highest first): ``overrides`` (explicit arguments; keys whose value is
    ``None`` are ignored) > ``NBACCEL_*`` environment variables > the YAML config file
    > the :class:`LaunchConfig` defaults.

    Args:
        overrides: ``{field: value}`` from explicit arguments.
        environ: environment to read (default ``os.environ``).
        config_file: a YAML path (must exist), ``None`` for the default path (used
            only if it exists), or ``False`` to ignore config files.

    Raises:
        ConfigError: unknown override key, bad environment value, bad file, or an
            invalid combination; the message says where the offending value came from.

    Example:
        >>> env = {"NBACCEL_MIXED_PRECISION": "bf16", "NBACCEL_NUM_PROCESSES": "4"}
        >>> cfg = resolve_launch_config({"num_processes": 2}, environ=env, config_file=False)
        >>> (cfg.num_processes, cfg.mixed_precision)
        (2, 'bf16')
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if config_file is not False:
        path = default_config_path(env) if config_file is None else Path(config_file)
        if config_file is not None or path.exists():
            for key, value in values_from_file(path).items():
                values[key], sources[key] = value, f"config file {path}"
    for key, (value, var) in _from_environment(env).items():
        values[key], sources[key] = value, f"environment variable {var}"
    names = field_names()
    for key, value in (overrides or {}).items():
        if key not in names:
            raise ConfigError(
                f"unknown launch setting {key!r}; valid settings: {', '.join(names)}."
            )
        if value is not None:
            values[key], sources[key] = value, "the arguments"
    try:
        return LaunchConfig(**values)
    except ConfigError as err:
        raise _annotate(err, sources) from None


_installed: list[LaunchConfig] = []  # at most one: this process's launch configuration


def install_launch_config(cfg: LaunchConfig | None) -> None:
    """Make ``cfg`` this process's configuration (a launched worker; None: uninstall).

    Example:
        >>> install_launch_config(LaunchConfig(mixed_precision="bf16"))
        >>> launch_config().mixed_precision
        'bf16'
        >>> install_launch_config(None)
    """
    _installed[:] = [] if cfg is None else [cfg]


def installed_launch_config() -> LaunchConfig | None:
    """The configuration a launcher installed in this process, or None."""
    return _installed[0] if _installed else None


def launch_config(overrides: Mapping[str, Any] | None = None) -> LaunchConfig:
    """This process's launch configuration, with ``overrides`` (non-None values) applied.

    The one the launcher installed (its environment and config file were read once, where
    the launch started); else :func:`resolve_launch_config` (environment and file, read now).
    """
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if _installed:
        return _installed[0].replace(**given) if given else _installed[0]
    return resolve_launch_config(given)


__all__ = [
    "ENV_VARS",
    "install_launch_config",
    "installed_launch_config",
    "launch_config",
    "resolve_launch_config",
]
