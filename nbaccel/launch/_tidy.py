"""How a failed run reads in the notebook: the user's error first, nbaccel's frames hidden.

The remote traceback (the user's frames) is in the re-created error's message; the kernel's
own frames, and an earlier failure a pool handled ("During handling of the above
exception"), are noise. :func:`clean` strips an error's own traceback and context (the
entry points hide their frames with IPython's ``__tracebackhide__``); :func:`add_hint`
notes how to get pdb on the failing frame; :func:`show_in_cell` puts a background run's
failure into its launching cell as an ordinary ``error`` output.

Example:
    >>> err = clean(ValueError("boom"))
    >>> err.__traceback__ is None and err.__suppress_context__
    True
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import traceback
import types
import warnings
from typing import Any

from ..errors import WorkerError, WorkerTimeoutError
from ._failures import add_note

_FRAME = re.compile(r'^  File "([^"]+)", line \d+')
#: The note added by :func:`add_hint` starts with this (and is added once).
HINT_START = "nbaccel: for pdb on the failing frame"


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean(err: BaseException) -> BaseException:
    """``err`` to raise in the kernel: no chained earlier failure, and IPython shows it
    without nbaccel's frames, through the exception's own ``_render_traceback_`` (as
    ipyparallel's remote errors; ``__tracebackhide__`` still shows the raising frame)."""
    err.__traceback__ = None
    err.__suppress_context__ = True
    err.__cause__ = None
    with contextlib.suppress(AttributeError, TypeError):  # a type without a __dict__
        err._render_traceback_ = functools.partial(_render, err)  # type: ignore[attr-defined]
    return err


def _render(err: BaseException) -> list[str]:
    """IPython's traceback of ``err`` with nbaccel's own frames left out."""
    from IPython import get_ipython

    kept: list[types.TracebackType] = []
    tb = err.__traceback__
    while tb is not None:
        if not _internal(tb.tb_frame.f_code.co_filename, torch=False):
            kept.append(tb)
        tb = tb.tb_next
    rebuilt: types.TracebackType | None = None
    for entry in reversed(kept):
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    shell = get_ipython()
    return _with_notes(shell.InteractiveTB.structured_traceback(type(err), err, rebuilt), err)


def _with_notes(lines: list[str], err: BaseException) -> list[str]:
    """``lines`` and ``err``'s notes (``add_note``), which IPython 7 does not show."""
    shown = "\n".join(lines)
    missing = [str(note) for note in getattr(err, "__notes__", ()) if str(note) not in shown]
    return [*lines, *missing]


def _debuggable(err: BaseException) -> bool:
    """A rank raised an exception (not a hang, a signal or an exit): pdb can open on it."""
    if not isinstance(err, WorkerError) or isinstance(err, WorkerTimeoutError):
        return False
    kind = err.exc_type
    return not (kind in ("SystemExit", "ExitCode", "Timeout") or kind.startswith("SIG"))


def add_hint(err: BaseException, *, kept: bool, pool: bool = False) -> None:
    """Note how to debug ``err`` (once): ``kept`` says a failed rank waits for a session.

    Example:
        >>> err = WorkerError(1, 42, "ValueError", "bad")
        >>> add_hint(err, kept=False)
        >>> "debug=True" in getattr(err, "__notes__", [""])[0]
        True
    """
    if not _debuggable(err) or any(
        str(note).startswith(HINT_START) for note in getattr(err, "__notes__", ())
    ):
        return
    rank = getattr(err, "rank", 0)
    if kept:
        where = "until the pool's next call" if pool else f"while rank {rank} waits for it"
        text = f"{HINT_START} of rank {rank}: run nbaccel.debug() in the next cell ({where})."
    else:
        text = (
            f"{HINT_START} of rank {rank}: launch again with notebook_launcher(..., "
            "debug=True), then run nbaccel.debug() in the next cell."
        )
    add_note(err, text)


def _internal(path: str, *, torch: bool = True) -> bool:
    """nbaccel's own modules, and torch's (what a user's call went through to wait)."""
    path = os.path.abspath(path)
    return path.startswith(_PACKAGE + os.sep) or (torch and f"{os.sep}torch{os.sep}" in path)


def trim_stack(stack: str) -> str:
    r"""A rank's Python stack (``traceback.format_stack`` text) without nbaccel's and
    torch's frames below the user's: where the user's code was, and what it waits in.

    Example:
        >>> text = (
        ...     '  File "/home/me/train.py", line 3, in train\n    barrier()\n'
        ...     f'  File "{_PACKAGE}/runtime/ops.py", line 9, in barrier\n    dist.barrier()\n'
        ...     "  (waiting in torch.distributed.barrier)"
        ... )
        >>> print(trim_stack(text))
          File "/home/me/train.py", line 3, in train
            barrier()
          (waiting in torch.distributed.barrier)
    """
    out: list[str] = []
    dropped = kept = 0
    skipping = False
    for line in stack.splitlines():
        if (match := _FRAME.match(line)) is not None:
            skipping = _internal(match.group(1))
            dropped += skipping
            kept += not skipping
        elif not line.startswith("    "):  # a note such as "(waiting in ...)": kept
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out) if kept and dropped else stack


def oversubscribed(processes: int, cores: int) -> str | None:
    """The advice for more CPU processes than cores (the panel's and the launcher's), or None.

    Example:
        >>> oversubscribed(4, 2)
        '4 processes on 2 CPU core(s) here: they share cores and train slower than 2 would.'
    """
    if processes <= cores:
        return None
    return (
        f"{processes} processes on {cores} CPU core(s) here: they share cores and train "
        f"slower than {cores} would."
    )


def warn_oversubscribed(config: Any, processes: int, *, stacklevel: int) -> None:
    """Warn (``RuntimeWarning``) when ``processes`` CPU workers are more than the cores."""
    from ..platform.environment import cpu_count
    from ..platform.hardware import cuda_device_count

    device = getattr(config, "compute_device", "auto")
    if device == "cpu" or (device == "auto" and cuda_device_count() == 0):
        advice = oversubscribed(processes, cpu_count())
        if advice is not None:
            warnings.warn(f"nbaccel: {advice}", RuntimeWarning, stacklevel=stacklevel + 1)


def show_in_cell(cell: Any, err: BaseException, title: str) -> None:
    """Show a background run's failure in its launching cell (``cell``: a ``CellOutput``)
    as an ``error`` output headed by ``title``, formatted as IPython formats it; never raises."""
    with contextlib.suppress(Exception):
        shown, lines = clean(err), list[str]()
        with contextlib.suppress(Exception):
            from IPython import get_ipython

            lines = get_ipython().InteractiveTB.structured_traceback(type(shown), shown, None)
        lines = list(lines) or traceback.format_exception(type(shown), shown, None)
        content: dict[str, Any] = {"ename": type(shown).__name__, "evalue": str(shown)}
        content["traceback"] = [title, *_with_notes(lines, shown)]
        cell.flush()  # after the run's last lines
        cell.send("error", content)


__all__ = [
    "HINT_START",
    "add_hint",
    "clean",
    "oversubscribed",
    "show_in_cell",
    "trim_stack",
    "warn_oversubscribed",
]
