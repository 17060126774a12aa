"""How the launch functions take their options: typed ``**options``, one signature, one help.

``notebook_launcher`` names Accelerate's parameters in Accelerate's order (they may be
passed positionally) and takes nbaccel's own as ``**options: Unpack[LaunchKeywords]``;
``start_workers`` takes ``**options: Unpack[PoolKeywords]`` (PEP 692: mypy and IDEs check
each keyword's name and type). The TypedDicts below say only which options a function
takes and their types, as mypy needs them written; each option's default, help and
validation are its definition's: a :class:`~nbaccel.config.LaunchConfig` field (a
*setting*, ``None``: not given) or a field of
:class:`~nbaccel.config.options.StartOptions` / :class:`~nbaccel.config.options.CallOptions`.
:func:`documented` gives each function the signature ``help()`` and ``inspect`` show (every
option with its default) and the "Args" of its docstring; :func:`split` sorts the
arguments of a call into settings, start and call options. tests/config/test_options.py
fails when a TypedDict and the definitions disagree.

Example:
    >>> named = {"num_processes": 2, "use_port": "29500"}
    >>> settings, start, call = split(named, {"block": False}, LaunchKeywords, "a launch")
    >>> settings, start.use_port, call.block
    ({'num_processes': 2}, 29500, False)
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypedDict, TypeVar

from .choices import OnHangType, PrecisionType, RdzvBackendType, StartMethodType
from .fields import field_help, field_names
from .launch_config import LaunchConfig
from .options import CALL, START, CallOptions, OutputTarget, StartOptions


class EngineKeywords(TypedDict, total=False):
    """Keywords of every start of workers (``notebook_launcher``, ``start_workers``)."""

    start_method: StartMethodType | None
    cluster: str | None
    cpus_per_rank: int | None
    timeout: float | None
    config: LaunchConfig | None
    hang_after: float | None
    on_hang: OnHangType | None
    debug_collectives: bool | None
    debug: bool


class LaunchKeywords(EngineKeywords, total=False):
    """``notebook_launcher``'s keyword-only options (Accelerate's are its parameters)."""

    replace_timeout: float | None
    return_all_ranks: bool
    block: bool
    output: OutputTarget | None
    debug_timeout: float


class AccelerateKeywords(TypedDict, total=False):
    """Accelerate's parameters of ``notebook_launcher`` that a pool takes too (by name)."""

    mixed_precision: PrecisionType | None
    use_port: int | str | None
    master_addr: str | None
    node_rank: int | None
    num_nodes: int | None
    rdzv_backend: RdzvBackendType
    rdzv_endpoint: str
    rdzv_conf: dict[str, Any] | None
    rdzv_id: str
    monitor_interval: float
    log_line_prefix_template: str | None


class PoolKeywords(AccelerateKeywords, EngineKeywords, total=False):
    """``start_workers``' options: ``notebook_launcher``'s, less one call's (``pool.call``
    takes ``return_all_ranks``, ``block`` and ``output``), ``max_restarts`` (a pool replaces
    workers that cannot go on) and ``debug_timeout`` (a failed rank waits for the next call)."""


_START = {f.name for f in dataclasses.fields(StartOptions)}
_CALL = {f.name for f in dataclasses.fields(CallOptions)}


def default(name: str) -> Any:
    """An option's default as a parameter: its StartOptions/CallOptions default, else None
    (a setting not given)."""
    if name in _START:
        return getattr(START, name)
    return getattr(CALL, name) if name in _CALL else None


def split(
    named: Mapping[str, Any], options: Mapping[str, Any], keywords: type, caller: str
) -> tuple[dict[str, Any], StartOptions, CallOptions]:
    """Sort a call's arguments (``named`` parameters, ``**options`` typed by ``keywords``)
    into settings (LaunchConfig fields), :class:`StartOptions` and :class:`CallOptions`,
    both validated here. An option ``caller`` does not take is a ``TypeError`` naming it."""
    allowed = keywords.__annotations__
    for name in options:
        if name not in allowed:
            where = ": it is an option of each pool.call()" if name in _CALL else ""
            raise TypeError(f"{caller} takes no {name}{where}; it takes {', '.join(allowed)}.")
    arguments = {**named, **options}
    start = StartOptions(**{k: v for k, v in arguments.items() if k in _START})
    call = CallOptions(**{k: v for k, v in arguments.items() if k in _CALL})
    settings = {k: v for k, v in arguments.items() if k not in _START and k not in _CALL}
    return settings, start, call


# ------------------------------------------------------------------ help() and inspect
def option_help() -> dict[str, str]:
    """``{option: help}`` for every option: LaunchConfig fields, then StartOptions' and
    CallOptions' (``debug`` is StartOptions': it also keeps a failed rank)."""
    out = field_help()
    for cls in (StartOptions, CallOptions):
        out.update({f.name: str(f.metadata["help"]) for f in dataclasses.fields(cls)})
    return out


def _shown_default(name: str) -> Any:
    """The default ``help()`` names: a setting's is its LaunchConfig field's."""
    if name in _START or name in _CALL or name not in field_names():
        return default(name)
    return next(f.default for f in dataclasses.fields(LaunchConfig) if f.name == name)


def options_doc(names: Iterable[str], *, indent: str = "") -> str:
    """The "Args" lines of ``names``, each with its help text and default.

    Example:
        >>> print(options_doc(["block"]))
        block: False returns a LaunchHandle at once while the workers run. (default: True)
    """
    known = option_help()
    return "\n".join(
        textwrap.fill(
            f"{name}: {known[name]} (default: {_shown_default(name)!r})",
            92,
            initial_indent=indent,
            subsequent_indent=indent + "    ",
        )
        for name in names
    )


F = TypeVar("F", bound=Callable[..., Any])


def documented(keywords: type | None = None) -> Callable[[F], F]:
    """Decorate a launch function: ``**options`` (typed by the TypedDict ``keywords``)
    shown as keyword-only parameters with their defaults, and ``{options}`` in the
    docstring replaced by the help of each option, in the signature's order."""

    def decorate(function: F) -> F:
        signature = inspect.signature(function)
        params = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        for name, hint in (keywords.__annotations__ if keywords else {}).items():
            params.append(
                inspect.Parameter(
                    name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=default(name),
                    annotation=getattr(hint, "__forward_arg__", hint),
                )
            )
        function.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        known = option_help()
        names = [p.name for p in params if p.name in known]
        doc = function.__doc__ or ""
        line = next(line for line in doc.splitlines() if line.strip() == "{options}")
        indent = line[: len(line) - len(line.lstrip())]
        function.__doc__ = doc.replace(line, options_doc(names, indent=indent))
        return function

    return decorate


__all__ = [
    "AccelerateKeywords",
    "EngineKeywords",
    "LaunchKeywords",
    "PoolKeywords",
    "default",
    "documented",
    "option_help",
    "options_doc",
    "split",
]
