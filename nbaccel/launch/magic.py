"""``%%distributed``: run a notebook cell on every rank of the current warm pool.

Load it with ``%load_ext nbaccel``. The cell runs in each worker's namespace
(shared with ``pool.push``/``pool.pull``; names persist between cells), its output
is streamed into the cell with rank prefixes, an exception is raised with its rank
and remote traceback, and the value of a final expression on the first rank is
shown as the cell's result. Names the cell uses that the kernel defines (functions,
classes, constants of ordinary cells) are copied to the workers as ``pool.run`` copies
a function's globals; a name that cannot be copied is an error naming it, and a name
the workers set themselves (in an earlier cell, or with ``push``) is theirs. A cell
run on some ranks (``--ranks 0``) that enters a collective needing the others ends
with an error naming the collective (the pool restarts), not a deadlock. A name ``accelerator`` is ready to use: the first cell
that mentions it creates ``Accelerator()`` on the workers (let that cell run on
every rank: it forms the process group).

Options: ``--ranks 0`` or ``--ranks 0,1`` (a subset of ranks); ``--pool NAME`` (a
pool held in the notebook variable ``NAME`` instead of the last one started).

Example::

    %load_ext nbaccel
    pool = nbaccel.start_workers(num_processes=2)

    %%distributed
    import torch
    t = torch.ones(2) * (accelerator.process_index + 1)
    print(t.sum())
"""

from __future__ import annotations

import argparse
import shlex
import symtable
from collections.abc import Mapping
from typing import Any, NoReturn

from ..errors import LaunchError
from .debugger import debug
from .pool import WorkerPool, current_pool

USAGE = "%%distributed [--ranks 0,1] [--pool NAME]"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # a UsageError in the cell, not an exit
        raise ValueError(f"{message}; usage: {USAGE}")


def rank_numbers(text: str) -> list[int]:
    """``0`` or ``0,1``: what ``--ranks`` takes (argparse names this function when not)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(text)
    return [int(p) for p in parts]


_PARSER = _Parser(prog="%%distributed", add_help=False, allow_abbrev=False)
_PARSER.add_argument("--ranks", "-r", nargs="+", type=rank_numbers, default=[])
_PARSER.add_argument("--pool")


def _parse(line: str) -> tuple[list[int] | None, str | None]:
    try:
        words = shlex.split(line)
    except ValueError as err:
        raise ValueError(f"cannot parse {line!r} ({err}); usage: {USAGE}") from None
    options = _PARSER.parse_args(words)
    ranks = [rank for group in options.ranks for rank in group]
    return ranks or None, options.pool


def distributed(line: str, cell: str, user_ns: dict[str, Any] | None = None) -> Any:
    """Body of the ``%%distributed`` cell magic (testable without IPython).

    Returns the first rank's value of the cell's last expression (``None`` if none).

    Raises:
        RuntimeError: no pool is running (or ``--pool`` names no pool).
        ValueError: bad options.
        WorkerError: the cell raised on a rank.
    """
    ranks, name = _parse(line)
    if name is not None:
        if not isinstance(pool := (user_ns or {}).get(name), WorkerPool):
            raise RuntimeError(
                f"--pool {name}: there is no WorkerPool named {name!r} in the notebook; "
                "create it with pool = nbaccel.start_workers(num_processes=...)."
            )
    elif (pool := current_pool()) is None:
        raise RuntimeError(
            "%%distributed needs a running pool of workers and none is open: run "
            "`import nbaccel; pool = nbaccel.start_workers(num_processes=2)` in a cell "
            "first (or restart it if it was closed)."
        )
    return pool.exec_cell(cell, ranks, names=kernel_names(cell, user_ns or {}))


# IPython's own names in a kernel's namespace: never the cell's business on the workers
_KERNEL_ONLY = {"In", "Out", "get_ipython", "exit", "quit", "open"}


def kernel_names(source: str, namespace: Mapping[str, Any]) -> dict[str, Any]:
    """The kernel's values of the global names ``source`` reads.

    Example:
        >>> kernel_names("y = f(x) + len(z)", {"f": abs, "x": -2, "unused": 1})
        {'f': <built-in function abs>, 'x': -2}
    """
    try:
        table = symtable.symtable(source, "<distributed cell>", "exec")
    except SyntaxError:
        return {}  # exec_cell reports it
    used: set[str] = set()
    tables = [table]
    while tables:
        scope = tables.pop()
        top = scope.get_type() == "module"
        for symbol in scope.get_symbols():
            if symbol.is_referenced() and (top or symbol.is_global()):
                used.add(symbol.get_name())
        tables += scope.get_children()
    names = {}
    for name in sorted(used):
        if name in namespace and name not in _KERNEL_ONLY and not name.startswith("_"):
            names[name] = namespace[name]
    return names


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%%distributed`` and ``%nbaccel_debug [rank]`` (pdb on a failed rank;
    called by ``%load_ext nbaccel``)."""
    from IPython.core.error import UsageError

    from ..platform import cudatrace
    from .start._local import take_fork_server

    cudatrace.install()  # a CUDA initialisation in a later cell is named if a fork is refused
    take_fork_server()  # the notebook's first cell: workers fork later even after CUDA

    def magic(line: str, cell: str) -> Any:
        try:
            return distributed(line, cell, ipython.user_ns)
        except (RuntimeError, ValueError) as err:
            if type(err) in (RuntimeError, ValueError):  # misuse, not a worker's error
                raise UsageError(str(err)) from None
            raise

    def debug_magic(line: str) -> None:
        """``%nbaccel_debug [rank]``: pdb on a failed rank (see ``nbaccel.debug``)."""
        words = line.split()
        try:
            if len(words) > 1 or (words and not words[0].isdigit()):
                raise ValueError(
                    f"usage: %nbaccel_debug [rank], e.g. %nbaccel_debug 1 (got {line!r})"
                )
            debug(int(words[0]) if words else None)
        except (LaunchError, ValueError) as err:  # why no session: a message, no traceback
            raise UsageError(str(err)) from None

    magic.__doc__ = __doc__
    ipython.register_magic_function(magic, "cell", "distributed")
    ipython.register_magic_function(debug_magic, "line", "nbaccel_debug")


__all__ = ["distributed", "load_ipython_extension"]
