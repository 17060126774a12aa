"""The one launch configuration: choices, validation, precedence and YAML storage.

Every choice (precision modes, start methods, compute devices) is defined here
once; the launcher, the CLI and the widget panel derive their options from these
tuples and from the :class:`LaunchConfig` fields so they can never drift apart.

Where a setting comes from (highest wins), see :func:`resolve_launch_config`:

1. explicit arguments (``notebook_launcher(num_processes=...)``, CLI flags, the panel);
2. ``NBACCEL_*`` environment variables (``NBACCEL_MIXED_PRECISION``, ``NBACCEL_USE_CPU``, ...);
3. the YAML config file (``$NBACCEL_CONFIG_FILE``, else ``$XDG_CACHE_HOME/nbaccel/
   default_config.yaml``, else ``~/.cache/nbaccel/default_config.yaml``);
4. the defaults of :class:`LaunchConfig` (``num_processes=None``: one per detected device).

Example:
    >>> from nbaccel.config import LaunchConfig
    >>> cfg = LaunchConfig(num_processes=2, mixed_precision="bf16")
    >>> cfg.mixed_precision
    'bf16'
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args

from .config_file import (
    CONFIG_VERSION,
    default_config_path,
    load_config,
    save_config,
    values_from_file,
    write_basic_config,
)
from .errors import ConfigError

PrecisionType = Literal["no", "fp16", "bf16", "fp8"]
StartMethodType = Literal["auto", "fork", "spawn"]
ComputeDeviceType = Literal["auto", "cpu", "gpu", "tpu"]

PRECISIONS: tuple[str, ...] = get_args(PrecisionType)
START_METHODS: tuple[str, ...] = get_args(StartMethodType)
COMPUTE_DEVICES: tuple[str, ...] = get_args(ComputeDeviceType)


def normalize_precision(value: object, *, argument: str = "mixed_precision") -> str:
    """Return the canonical precision name, or raise a ``ConfigError`` naming ``argument``.

    ``None`` and ``"fp32"`` mean ``"no"``; matching is case-insensitive.

    Example:
        >>> normalize_precision("BF16")
        'bf16'
    """
    if value is None:
        return "no"
    if not isinstance(value, str):
        raise ConfigError(
            f"{argument}={value!r} is not a string; use one of {', '.join(PRECISIONS)}."
        )
    lowered = value.strip().lower()
    if lowered in ("fp32", "no", "none", ""):
        return "no"
    if lowered not in PRECISIONS:
        raise ConfigError(f"{argument}={value!r} is unknown; use one of {', '.join(PRECISIONS)}.")
    return lowered


#: smallest valid value of each int field (the widget's lower bounds come from here too)
INT_MINIMUMS: dict[str, int] = {
    "num_processes": 1,
    "gradient_accumulation_steps": 1,
    "num_nodes": 1,
    "node_rank": 0,
    "master_port": 1,
    "max_restarts": 0,
}
MAX_PORT = 65535


def _check_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True as a process count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}.")
    if value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}.")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is unknown; use one of {', '.join(choices)}.")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How to launch a training function. Validated on construction.

    Args:
        compute_device: "auto" (GPUs, else TPU, else CPU), "cpu", "gpu" or "tpu".
        num_processes: processes per node; ``None`` means one per visible device.
        mixed_precision: "no", "fp16", "bf16" or "fp8".
        gradient_accumulation_steps: micro-steps per optimizer update (>= 1).
        num_nodes: machines taking part (>= 1).
        node_rank: this machine's index, ``0 <= node_rank < num_nodes``.
        master_addr: address of node 0's rendezvous.
        master_port: rendezvous port; ``None`` picks a free one (single node only).
        start_method: "auto" (fork when safe, else spawn), "fork" or "spawn".
        gpu_ids: GPUs to use, e.g. ``"0,1"`` or ``"all"``; ``None`` means all.
        max_restarts: how often a failed worker group is restarted (>= 0).
        timeout: seconds a collective may block before the run is declared hung.
        debug: record CUDA-initialisation stacks and worker stacks on hangs.

    Example:
        >>> LaunchConfig(num_nodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500)
        ... # doctest: +ELLIPSIS
        LaunchConfig(...)
    """

    compute_device: ComputeDeviceType = "auto"
    num_processes: int | None = None
    mixed_precision: PrecisionType = "no"
    gradient_accumulation_steps: int = 1
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    start_method: StartMethodType = "auto"
    gpu_ids: str | None = None
    max_restarts: int = 0
    timeout: float | None = None
    debug: bool = False

    def __post_init__(self) -> None:
        _check_choice("compute_device", self.compute_device, COMPUTE_DEVICES)
        if self.num_processes is not None:
            _check_int("num_processes", self.num_processes, INT_MINIMUMS["num_processes"])
        # Normalise aliases ("fp32", None, "BF16") in place; frozen needs object.__setattr__.
        object.__setattr__(self, "mixed_precision", normalize_precision(self.mixed_precision))
        _check_int(
            "gradient_accumulation_steps",
            self.gradient_accumulation_steps,
            INT_MINIMUMS["gradient_accumulation_steps"],
        )
        _check_int("num_nodes", self.num_nodes, INT_MINIMUMS["num_nodes"])
        _check_int("node_rank", self.node_rank, INT_MINIMUMS["node_rank"])
        if self.node_rank >= self.num_nodes:
            raise ConfigError(
                f"node_rank={self.node_rank} must be < num_nodes={self.num_nodes}; "
                "number machines 0..num_nodes-1 and give each its own node_rank."
            )
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ConfigError(f"master_addr={self.master_addr!r} must be a host name or IP.")
        if self.master_port is not None:
            _check_int("master_port", self.master_port, INT_MINIMUMS["master_port"])
            if self.master_port > MAX_PORT:
                raise ConfigError(f"master_port={self.master_port} must be <= {MAX_PORT}.")
        if self.num_nodes > 1 and self.master_port is None:
            raise ConfigError(
                "master_port=None with num_nodes > 1: every node must agree on one port; "
                "pass the same master_port (use_port) on each machine, e.g. 29500."
            )
        _check_choice("start_method", self.start_method, START_METHODS)
        if self.gpu_ids is not None and not isinstance(self.gpu_ids, str):
            raise ConfigError(f"gpu_ids={self.gpu_ids!r} must be a string such as '0,1' or 'all'.")
        _check_int("max_restarts", self.max_restarts, INT_MINIMUMS["max_restarts"])
        if self.timeout is not None and (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, int | float)
            or self.timeout <= 0
        ):
            raise ConfigError(f"timeout={self.timeout!r} must be a number of seconds > 0.")
        if not isinstance(self.debug, bool):
            raise ConfigError(f"debug={self.debug!r} must be True or False.")

    def replace(self, **changes: object) -> LaunchConfig:
        """Return a copy with ``changes`` applied (and validated).

        Example:
            >>> LaunchConfig().replace(num_processes=4).num_processes
            4
        """
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise ConfigError(
                f"unknown LaunchConfig field(s) {unknown}; valid fields: {sorted(fields)}."
            )
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- field types
def field_names() -> tuple[str, ...]:
    """The :class:`LaunchConfig` field names, in declaration order (CLI/widget derive from it)."""
    return tuple(f.name for f in dataclasses.fields(LaunchConfig))


def field_help() -> dict[str, str]:
    """``{field: one-line description}`` parsed from the ``Args:`` section of LaunchConfig."""
    doc = LaunchConfig.__doc__ or ""
    section = doc.split("Args:", 1)[-1].split("Example:", 1)[0]
    out: dict[str, str] = {}
    current = None
    for line in section.splitlines():
        match = re.match(r"\s{8}(\w+): (.*)", line)
        if match and match.group(1) in field_names():
            current = match.group(1)
            out[current] = match.group(2).strip().replace("``", "")
        elif current and line.strip():
            out[current] += " " + line.strip().replace("``", "")
    return out


def field_kind(name: str) -> tuple[Any, tuple[str, ...] | None]:
    """``(python type, choices or None)`` of a LaunchConfig field."""
    hint, _ = _split_optional(typing.get_type_hints(LaunchConfig)[name])
    if typing.get_origin(hint) is Literal:
        return str, tuple(get_args(hint))
    return hint, None


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(LaunchConfig)


def _split_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else hint), len(args) < len(get_args(hint))
    return hint, False


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _coerce(name: str, value: Any, source: str, *, from_text: bool = False) -> Any:
    """Check (and for environment text, parse) one field value; errors name key and source."""
    hint, optional = _split_optional(_field_types()[name])
    if value is None or (from_text and value.strip().lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{name} in {source} must not be empty/null.")
    if typing.get_origin(hint) is Literal:
        choices = get_args(hint)
        if name == "mixed_precision" and (value is False or isinstance(value, str)):
            # YAML 1.1 reads a bare `no` as False; that is what the user meant by "no".
            with contextlib.suppress(ConfigError):
                return normalize_precision("no" if value is False else value)
        elif isinstance(value, str) and value.strip().lower() in choices:
            return value.strip().lower()
        raise ConfigError(
            f"{name}={value!r} in {source} is unknown; use one of {', '.join(choices)}."
        )
    if from_text:
        text = value.strip()
        try:
            if hint is bool:
                if text.lower() not in _TRUE + _FALSE:
                    raise ValueError(text)
                return text.lower() in _TRUE
            if hint is int:
                return int(text)
            if hint is float:
                return float(text)
        except ValueError:
            raise ConfigError(
                f"{name}={value!r} in {source} is not a valid {hint.__name__}."
            ) from None
        return text
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str) or (name == "gpu_ids" and isinstance(value, int)),
    }.get(hint, True)
    if not ok:
        kind = getattr(hint, "__name__", str(hint)) + (" or null" if optional else "")
        raise ConfigError(
            f"{name}={value!r} in {source} has the wrong type "
            f"({type(value).__name__}); expected {kind}."
        )
    return str(value) if hint is str else value


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
            out[name] = (_coerce(name, raw, f"environment variable {var}", from_text=True), var)
    use_cpu = environ.get("NBACCEL_USE_CPU", "").strip().lower()
    if use_cpu in _TRUE:
        if out.get("compute_device", ("cpu",))[0] != "cpu":
            raise ConfigError(
                "NBACCEL_USE_CPU=1 contradicts NBACCEL_COMPUTE_DEVICE="
                f"{out['compute_device'][0]!r}; unset one of them."
            )
        out["compute_device"] = ("cpu", "NBACCEL_USE_CPU")
    elif use_cpu not in (*_FALSE, ""):
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


__all__ = [
    "COMPUTE_DEVICES",
    "CONFIG_VERSION",
    "ENV_VARS",
    "INT_MINIMUMS",
    "MAX_PORT",
    "PRECISIONS",
    "START_METHODS",
    "ComputeDeviceType",
    "LaunchConfig",
    "PrecisionType",
    "StartMethodType",
    "default_config_path",
    "field_help",
    "field_kind",
    "field_names",
    "load_config",
    "normalize_precision",
    "resolve_launch_config",
    "save_config",
    "write_basic_config",
]
