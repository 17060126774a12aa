"""Command-line options derived from :class:`nbaccel.config.LaunchConfig`.

Each field becomes ``--<field>`` with its type, its choices (from the ``Literal``
annotation) and its help text (from the field's metadata); a bool field gets
``--<field>``/``--no-<field>``; the peer's historical
names (``--num_machines``, ``--main_process_ip``, ...) are accepted as aliases
via :data:`nbaccel.config.file.RENAMED_KEYS`. Nothing is listed twice.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..config import LaunchConfig, field_help, field_kind, field_names
from ..config.file import RENAMED_KEYS


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
        if kind is bool:  # --x / --no-x: a field that defaults to on can be turned off
            group.add_argument(
                *flags,
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{text} (default: {'on' if field.default else 'off'})",
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


__all__ = ["add_config_arguments", "overrides_from_args"]
