"""Facts about :class:`~nbaccel.config.launch_config.LaunchConfig` fields: names, help,
types, and the parsing of one value (from YAML, a keyword or environment text).

The CLI flags, the questionnaire and the widget panel derive from these.

Example:
    >>> field_kind("strategy")[1][:2]
    ('ddp', 'fsdp')
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import typing
from typing import Any, Literal, Union, get_args

from ..errors import ConfigError
from .choices import normalize_precision
from .launch_config import LaunchConfig


def field_names() -> tuple[str, ...]:
    """The :class:`LaunchConfig` field names, in declaration order (CLI/widget derive from it)."""
    return tuple(f.name for f in dataclasses.fields(LaunchConfig))


def field_help() -> dict[str, str]:
    """``{field: one-line description}`` from each field's ``metadata["help"]``.

    Example:
        >>> field_help()["num_nodes"]
        'machines taking part (>= 1).'
    """
    return {
        f.name: str(f.metadata.get("help", "")).replace("``", "")
        for f in dataclasses.fields(LaunchConfig)
    }


def field_kind(name: str) -> tuple[Any, tuple[str, ...] | None]:
    """``(python type, choices or None)`` of a LaunchConfig field."""
    hint, _ = split_optional(_field_types()[name])
    if typing.get_origin(hint) is Literal:
        return str, tuple(get_args(hint))
    return hint, None


def field_optional(name: str) -> bool:
    """Whether a LaunchConfig field may be ``None`` (e.g. ``timeout``, ``gpu_ids``)."""
    return split_optional(_field_types()[name])[1]


@functools.cache
def _field_types() -> dict[str, Any]:
    # evaluated once: the string annotations cost ~0.5 ms per call, and every launch (and
    # every Accelerator in a worker) coerces a few values
    return typing.get_type_hints(LaunchConfig)


def split_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else hint), len(args) < len(get_args(hint))
    return hint, False


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def coerce(name: str, value: Any, source: str, *, from_text: bool = False) -> Any:
    """Check (and for environment text, parse) one field value; errors name key and source."""
    hint, optional = split_optional(_field_types()[name])
    # "none" is a real choice of some fields (deepspeed_offload_*_device), not a null there
    choice_none = typing.get_origin(hint) is Literal and "none" in get_args(hint)
    null_text = from_text and value.strip().lower() in ("null",) + (
        () if choice_none else ("none",)
    )
    if value is None or null_text:
        if optional:
            return None
        raise ConfigError(f"{name} in {source} must not be empty/null.")
    if typing.get_origin(hint) is Literal:
        choices = get_args(hint)
        if name == "mixed_precision" and (value is False or isinstance(value, str)):
            # YAML 1.1 reads a bare `no` as False; that is what the user meant by "no".
            with contextlib.suppress(ConfigError):
                return normalize_precision("no" if value is False else value)
        elif isinstance(value, str) and value.strip().lower() in (c.lower() for c in choices):
            # the canonical spelling ("SHARDED_STATE_DICT" is upper case, the rest lower)
            return next(c for c in choices if c.lower() == value.strip().lower())
        raise ConfigError(
            f"{name}={value!r} in {source} is unknown; use one of {', '.join(choices)}."
        )
    if from_text:
        text = value.strip()
        try:
            if hint is bool:
                if text.lower() not in TRUE_WORDS + FALSE_WORDS:
                    raise ValueError(text)
                return text.lower() in TRUE_WORDS
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


__all__ = [
    "FALSE_WORDS",
    "TRUE_WORDS",
    "coerce",
    "field_help",
    "field_kind",
    "field_names",
    "field_optional",
    "split_optional",
]
