"""The ``nbaccel`` command (also ``python -m nbaccel``): one module per subcommand.

Example:
    >>> from nbaccel.cli import main
    >>> main(["env"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

EPILOG = """\
examples:
  nbaccel config --default                       # write a config for this machine
  nbaccel test                                   # check that distributed training works
  nbaccel launch --num_processes 2 train.py      # run a script on 2 processes
  nbaccel env                                    # versions and devices for a bug report

Run `nbaccel <command> --help` for the options of each command.
"""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with the ``config``, ``launch``, ``test`` and ``env`` subcommands."""
    from .._version import __version__
    from . import config, env, launch, test

    parser = argparse.ArgumentParser(
        prog="nbaccel",
        description="Run PyTorch training on every device, from a notebook or a terminal.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"nbaccel {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (config, launch, test, env):  # each module: one subcommand, named after it
        command = subparsers.add_parser(
            module.__name__.rpartition(".")[2],
            help=module.HELP,
            description=module.DESCRIPTION.replace("``", ""),
            epilog=module.EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(func=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``nbaccel`` command with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args))


__all__ = ["build_parser", "main"]
