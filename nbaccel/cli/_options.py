"""Command-line options derived from :class:`nbaccel.config.LaunchConfig`.

Each field becomes ``--<field>`` with its type, its choices (from the ``Literal``
annotation) and its help text (from the class docstring); the peer's historical
names (``--num_machines``, ``--main_process_ip``, ...) are accepted as aliases
via :data:`nbaccel.config_file.RENAMED_KEYS`. Nothing is listed twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from typing import Any, Literal, get_args

from ..config import LaunchConfig, _split_optional, field_names
from ..config_file import RENAMED_KEYS


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


def add_config_arguments(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """Add ``--<field>`` for every LaunchConfig field (default ``None`` = "not given")."""
    aliases: dict[str, list[str]] = {}
    for old, new in RENAMED_KEYS.items():
        aliases.setdefault(new, []).append(old)
    helps = field_help()
    group = parser.add_argument_group(
        "launch settings (override NBACCEL_* variables and the config file)"
    )
    for field in dataclasses.fields(LaunchConfig):
        if field.name in skip:
            continue
        flags = [f"--{field.name}"] + [f"--{a}" for a in aliases.get(field.name, [])]
        kind, choices = field_kind(field.name)
        text = helps.get(field.name, "")
        if kind is bool:
            group.add_argument(
                *flags, dest=field.name, action="store_true", default=None, help=text
            )
            continue
        metavar = None if choices else field.name.upper()
        group.add_argument(
            *flags,
            dest=field.name,
            type=kind,
            choices=choices,
            default=None,
            metavar=metavar,
            help=text,
        )
    group.add_argument(
        "--cpu",
        action="store_const",
        const="cpu",
        dest="compute_device",
        help="shorthand for --compute_device cpu",
    )


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The LaunchConfig fields given on the command line (others are ``None``)."""
    return {name: getattr(args, name, None) for name in field_names()}


__all__ = ["add_config_arguments", "field_help", "field_kind", "overrides_from_args"]
