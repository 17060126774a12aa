"""The options of a launch that are not :class:`~nbaccel.config.LaunchConfig` settings.

A call of ``notebook_launcher``, ``start_workers`` or ``WorkerPool.call`` takes three kinds
of options, each defined once:

* **settings**: fields of :class:`~nbaccel.config.LaunchConfig` (``num_processes``,
  ``mixed_precision``, ``timeout``, ``hang_after`` ...). Their type, default, help and
  validation are the field's; as an argument ``None`` means "not given" (the environment,
  the config file or the field's default decides), and a value given always wins;
* :class:`StartOptions`: how one launch's processes meet and report (Accelerate's
  rendezvous arguments, the output prefix, ``config``, ``debug``): ``notebook_launcher``'s
  and ``start_workers``';
* :class:`CallOptions`: what one call returns and where its output goes (``block``,
  ``output``, ``return_all_ranks``): ``notebook_launcher``'s and ``pool.call``'s.

How the launch functions take them (parameters, ``**options`` typed for mypy, their
signature and docstring) is :mod:`nbaccel.config.keywords`.

Example:
    >>> StartOptions(use_port="29500").use_port
    29500
    >>> CallOptions(block=False).return_all_ranks
    False
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ..errors import ConfigError
from .choices import RDZV_BACKENDS, RdzvBackendType
from .fields import split_optional
from .launch_config import MAX_PORT, LaunchConfig

#: seconds a failed rank waits for ``nbaccel.debug()`` (``debug=True``), for launches and pools
DEBUG_TIMEOUT = 600.0


class Writable(Protocol):
    """A file-like ``output``: ``sys.stdout``, ``io.StringIO``, the panel's sink."""

    def write(self, text: str, /) -> Any: ...


#: where workers' lines go: a file-like object, or ``output(rank, stream, line)``
OutputTarget = Writable | Callable[[int, str, str], Any]


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, kw_only=True)
class StartOptions:
    """How one launch's processes meet and report. Validated on construction.

    Example:
        >>> StartOptions(rdzv_backend="etcd")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        nbaccel.errors.ConfigError: rdzv_backend='etcd' is unknown; use one of static, c10d.
    """

    use_port: int | str | None = field(
        default=None,
        metadata=_help(
            'rendezvous port (an int, or a string such as "29500"); None picks a free one '
            "for each launch. A busy port raises ValueError naming it. LaunchConfig.master_port."
        ),
    )
    rdzv_backend: RdzvBackendType = field(
        default="static",
        metadata=_help(
            '"static" (every node names its node_rank) or "c10d" (the identical cell on '
            "every machine: they meet at rdzv_endpoint, which numbers them)."
        ),
    )
    rdzv_endpoint: str = field(
        default="",
        metadata=_help(
            '"host:port": c10d\'s meeting point; with "static" it overrides master_addr/use_port.'
        ),
    )
    rdzv_conf: dict[str, Any] | None = field(
        default=None, metadata=_help("settings of the c10d rendezvous (e.g. join_timeout).")
    )
    rdzv_id: str = field(default="none", metadata=_help("the c10d rendezvous' run id."))
    monitor_interval: float = field(
        default=0.1, metadata=_help("seconds between checks of the workers.")
    )
    log_line_prefix_template: str | None = field(
        default=None,
        metadata=_help(
            "prefix of every forwarded output line when more than one process runs here (None: "
            '"[rank{rank}] "; "" disables). Fields: {rank}, {local_rank}, {node_rank}, '
            "{world_size} (or torchrun's ${rank})."
        ),
    )
    config: LaunchConfig | None = field(
        default=None,
        metadata=_help(
            "a complete LaunchConfig to use instead of the environment and config file "
            "(explicit arguments still override it)."
        ),
    )
    debug: bool = field(
        default=False,
        metadata=_help(
            "when a rank raises, keep it alive holding its traceback for nbaccel.debug() (pdb "
            "on the failing frame, from the next cell); the error is raised as usual. Also "
            "sets LaunchConfig.debug."
        ),
    )
    debug_timeout: float = field(
        default=DEBUG_TIMEOUT,
        metadata=_help("seconds a failed rank waits for nbaccel.debug() (with debug=True)."),
    )

    def __post_init__(self) -> None:
        check_types(self)
        port = self.use_port
        if isinstance(port, str):  # Accelerate's scripts pass it as a string
            if not port.strip().isdigit():
                raise TypeError(f"use_port={port!r} must be a port number, e.g. 29500.")
            object.__setattr__(self, "use_port", port := int(port))
        if port is not None and not 0 <= port <= MAX_PORT:  # 0: pick a free one, as None
            raise ConfigError(f"use_port={port} must be a TCP port, 1..{MAX_PORT} (None: free).")
        object.__setattr__(self, "use_port", port or None)
        _choice("rdzv_backend", self.rdzv_backend, RDZV_BACKENDS)
        _positive("monitor_interval", self.monitor_interval, "seconds between checks")
        _positive("debug_timeout", self.debug_timeout, "seconds a failed rank waits")

    @property
    def port(self) -> int | None:
        """``use_port`` as checked: an int, or None."""
        return self.use_port if isinstance(self.use_port, int) else None


@dataclass(frozen=True, kw_only=True)
class CallOptions:
    """What one call returns and where its output goes. Validated on construction."""

    return_all_ranks: bool = field(
        default=False,
        metadata=_help("return [rank0_value, rank1_value, ...] (this node's ranks)."),
    )
    block: bool = field(
        default=True,
        metadata=_help("False returns a LaunchHandle at once while the workers run."),
    )
    output: OutputTarget | None = field(
        default=None,
        metadata=_help(
            "where worker output goes: None (the launching cell's stdout/stderr), a file-like "
            "object, or a callable output(rank, stream, line)."
        ),
    )

    def __post_init__(self) -> None:
        check_types(self)


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is unknown; use one of {', '.join(choices)}.")


def _positive(name: str, value: float, what: str) -> None:
    if not value > 0:
        raise ConfigError(f"{name}={value!r} must be seconds > 0 ({what}).")


# ------------------------------------------------------------------ argument types
def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any or hint is object:
        return True
    if origin in (typing.Union, type(int | str)):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if origin is Literal:  # the choice itself is checked where its message names the choices
        return isinstance(value, str)
    if hint is None or hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is Writable:
        return hasattr(value, "write")
    if origin is not None and origin.__module__ == "collections.abc":  # Callable
        return callable(value)
    return isinstance(value, origin or hint)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    if hint is Writable:
        return "a file-like object"
    if origin is not None and origin.__module__ == "collections.abc":
        return "a callable"
    named = {bool: "True or False", int: "an int", float: "a number", str: "a str"}
    return named.get(hint) or f"a {getattr(origin or hint, '__name__', hint)}"


def check_argument(name: str, value: Any, hint: Any) -> None:
    """``TypeError`` naming the argument when ``value`` is not of the annotated type.

    Example:
        >>> check_argument("num_processes", 1.5, int | None)
        Traceback (most recent call last):
        ...
        TypeError: num_processes=1.5 must be an int (or None).
    """
    if _matches(value, hint):
        return
    inner, optional = split_optional(hint)
    union = typing.get_origin(inner) in (typing.Union, type(int | str))
    kinds = [k for k in (typing.get_args(inner) if union else (inner,)) if k is not type(None)]
    words = " or ".join(dict.fromkeys(map(_describe, kinds)))
    raise TypeError(f"{name}={value!r} must be {words}" + (" (or None)." if optional else "."))


@functools.cache
def _types(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # evaluated once per class (its string annotations)


def check_types(options: Any) -> None:
    """Check every field of a :class:`StartOptions` / :class:`CallOptions` against its type."""
    for name, hint in _types(options.__class__).items():
        check_argument(name, getattr(options, name), hint)


def check_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings given as arguments (``None``: not given), type-checked as their
    :class:`LaunchConfig` field; values are validated by ``LaunchConfig`` itself."""
    hints = _types(LaunchConfig)
    for name, value in settings.items():
        check_argument(name, value, hints[name] | None)
    return {k: v for k, v in settings.items() if v is not None}


#: the defaults, the one place the launch functions' signatures read them from
START = StartOptions()
CALL = CallOptions()


__all__ = [
    "CALL",
    "DEBUG_TIMEOUT",
    "START",
    "CallOptions",
    "OutputTarget",
    "StartOptions",
    "Writable",
    "check_argument",
    "check_settings",
]
