"""A worker's failure in the kernel: the one exception raised, and how it reads in the notebook.

Each failure is *real* (the user's exception, a death by signal, an unexpected exit) or
*secondary* (a healthy rank noticing a vanished peer); the first real one is raised, as an
instance of a dynamic subclass of both the remote type and
:class:`~nbaccel.errors.WorkerError` (``except ValueError`` works, ``err.rank`` is there).
A fatal error's stack is cut to the user's frames.

The remote traceback (the user's frames) is in the re-created error's message; the kernel's
own frames, and an earlier failure a pool handled ("During handling of the above
exception"), are noise. :func:`clean` strips an error's own traceback and context (the
entry points hide their frames with IPython's ``__tracebackhide__``); :func:`add_hint`
notes how to get pdb on the failing frame; :func:`show_in_cell` puts a background run's
failure into its launching cell as an ordinary ``error`` output.

Example:
    >>> info = {"type_module": "builtins", "type_qualname": "ValueError",
    ...         "message": "bad", "traceback": "Traceback ...", "time": 0.0}
    >>> err = remote_exception(Failure(rank=1, pid=42, time=0.0, kind="exception", info=info))
    >>> isinstance(err, ValueError), err.rank
    (True, 1)
    >>> err = clean(ValueError("boom"))
    >>> err.__traceback__ is None and err.__suppress_context__
    True
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
import signal
import sys
import traceback
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, cast

from ...errors import WorkerError, WorkerTimeoutError, named_rank
from ...platform.environment import package_dir
from ..channel._wire import loads

_SECONDARY_TYPES = {"DistBackendError", "DistNetworkError", "DistStoreError", "DistError"}
# Generic types torch/gloo use for "a peer went away"; a user's ValueError("timeout") stays real.
_PEER_LOST_TYPES = {
    "RuntimeError",
    "ConnectionError",
    "ConnectionResetError",
    "ConnectionAbortedError",
    "BrokenPipeError",
    "TimeoutError",
}
_SECONDARY_TEXT = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|timed out|timeout"
    r"|nccl communicator was aborted|socket timeout|connection refused|recvbytes|sendbytes"
    r"|peer .* (?:closed|disconnected)|process group .* (?:aborted|destroyed)",
    re.IGNORECASE,
)


@dataclass
class Failure:
    """One worker's failure as seen by the kernel.

    ``kind`` is "exception" (``info`` holds the remote type, message, traceback),
    "signal" (``code`` is the signal number) or "exit" (``code`` is the exit code).
    """

    rank: int
    pid: int | None
    time: float
    kind: str
    info: dict[str, Any] = field(default_factory=dict)
    code: int = 0
    stack: str = ""
    node: str | None = None  # where the worker ran, when another machine (a cluster's node)

    @property
    def secondary(self) -> bool:
        """True for a healthy rank reacting to a peer's failure (not the cause)."""
        if self.kind == "signal":
            # NCCL's watchdog aborts a rank whose collective timed out: SIGABRT while the
            # Python stack (faulthandler's dump) is inside torch.distributed.
            return self.code == signal.SIGABRT and "distributed" in self.stack
        if self.kind != "exception":
            return False
        name = self.info.get("type_qualname", "").split(".")[-1]
        if name in _SECONDARY_TYPES:
            return True
        return name in _PEER_LOST_TYPES and bool(
            _SECONDARY_TEXT.search(self.info.get("message", ""))
        )

    def summary(self) -> str:
        """One line, e.g. ``"rank 0: DistBackendError: Connection closed by peer"`` (on a
        cluster ``"rank 0 (pid 42 on node 10.0.0.2 (1a2b3c4d)): ..."``)."""
        who = named_rank(self.rank, self.pid, self.node)
        if self.kind == "signal":
            return f"{who}: killed by {signal_name(self.code)}"
        if self.kind == "exit":
            return f"{who}: exited with code {self.code}"
        first = (self.info.get("message") or "").strip().splitlines()[:1]
        return f"{who}: {self.info.get('type_qualname')}: {first[0] if first else ''}"


def signal_name(number: int) -> str:
    """``9`` -> ``"SIGKILL (9)"``."""
    try:
        return f"{signal.Signals(number).name} ({number})"
    except ValueError:
        return f"signal {number}"


def pick_failure(failures: list[Failure]) -> Failure:
    """The first real failure by time, else the first secondary one."""
    real = [f for f in failures if not f.secondary]
    return min(real or failures, key=lambda f: (f.time, f.rank))


def _locate(module: str, qualname: str) -> type | None:
    """The exception class, if its module is (or its package already was) imported here."""
    mod = sys.modules.get(module)
    if mod is None and module.split(".")[0] in sys.modules:
        try:
            mod = importlib.import_module(module)
        except Exception:
            return None
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, BaseException) else None


def _reduce(self: WorkerError) -> tuple[Any, ...]:
    args = (self.rank, self.pid, self.exc_type, self.message, self.remote_traceback, self.node)
    return (WorkerError, args)


@functools.cache  # one class per remote type
def _combined(original: type) -> type[WorkerError] | None:
    """A subclass of ``original`` and WorkerError, or None if Python refuses."""
    if issubclass(original, (WorkerError, SystemExit, GeneratorExit)):
        return None  # SystemExit in a cell would look like a request to quit the kernel
    try:
        combined = type(
            original.__name__,
            (original, WorkerError),
            {
                "__module__": original.__module__,
                "__qualname__": original.__qualname__,
                "__str__": BaseException.__str__,
                "__reduce__": _reduce,
                "__doc__": f"{original.__qualname__} raised in a worker (also a WorkerError).",
            },
        )
    except TypeError:  # instance lay-out conflicts, final classes
        return None
    return cast("type[WorkerError]", combined)


def remote_exception(failure: Failure) -> WorkerError:
    """The exception to raise in the kernel for ``failure`` (with the worker's exit code)."""
    rank, pid, info = failure.rank, failure.pid, failure.info
    if failure.kind == "signal":
        name = signal_name(failure.code)
        hint = " (SIGKILL is often the out-of-memory killer)" if failure.code == 9 else ""
        message = f"the worker was killed by signal {name}{hint}"
        err = WorkerError(rank, pid, name.split()[0], message, failure.stack, failure.node)
        err.exit_code = 128 + failure.code  # as a shell reports it
        return err
    if failure.kind == "exit":
        message = f"the worker exited with code {failure.code} before the function returned"
        err = WorkerError(rank, pid, "ExitCode", message, failure.stack, failure.node)
        err.exit_code = failure.code
        return err
    qualname = info.get("type_qualname", "Exception")
    args = (rank, pid, qualname, info.get("message", ""), info.get("traceback", ""), failure.node)
    original = _locate(info.get("type_module", ""), qualname)
    cls = _combined(original) if original is not None else None
    try:  # not the original __init__: it may need other args (OSError's __new__ is its own)
        err = WorkerError(*args) if cls is None else cls.__new__(cls)
    except Exception:
        err = WorkerError(*args)
    if type(err) is not WorkerError:
        WorkerError.__init__(err, *args)
        own = ("rank", "pid", "exc_type", "message", "node")  # WorkerError's, set just now
        for name, data in (info.get("attributes") or {}).items():  # the remote one's (err.code)
            if not hasattr(WorkerError, name) and name not in own:
                with contextlib.suppress(Exception):
                    setattr(err, name, loads(*data))
    err.exit_code = info.get("exit_code", 1)
    return err


def fatal_stack(text: str) -> str:
    """The last fatal-error dump in ``text`` (a worker's stderr), without nbaccel's frames
    below the user's function or, after a fork, the kernel's frames the child inherited."""
    if (start := text.rfind("Fatal Python error")) < 0:
        return ""
    out, skipping = [], False
    for line in text[start:].splitlines():
        if not line.startswith("  "):  # "Thread 0x... (most recent call first):" or blank
            skipping = False
        elif os.path.join(f"{os.sep}nbaccel", "launch", "") in line:
            skipping = True
        if not skipping:
            out.append(line)
    return "\n".join(out)


def add_note(err: BaseException, note: str) -> None:
    """``err.add_note`` on Python >= 3.11; appended to ``args`` on 3.10."""
    if hasattr(err, "add_note"):
        err.add_note(note)
    elif err.args and isinstance(err.args[0], str):
        err.args = (f"{err.args[0]}\n{note}", *err.args[1:])


_FRAME = re.compile(r'^  File "([^"]+)", line \d+')
#: The note added by :func:`add_hint` starts with this (and is added once).
HINT_START = "nbaccel: for pdb on the failing frame"


_PACKAGE = package_dir()  # frames under it are nbaccel's, hidden from the cell


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
    who = named_rank(rank, getattr(err, "pid", None), getattr(err, "node", None))
    if kept:
        where = "until the pool's next call" if pool else f"while rank {rank} waits for it"
        text = f"{HINT_START} of {who}: run nbaccel.debug() in the next cell ({where})."
    else:
        text = (
            f"{HINT_START} of {who}: launch again with notebook_launcher(..., "
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
        ...     f'  File "{_PACKAGE}/runtime/collectives/ops.py", line 9, in barrier\n    dist.barrier()\n'
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
    from ...platform.environment import cpu_count
    from ...platform.hardware import cuda_device_count

    device = getattr(config, "compute_device", "auto")
    on_cpu = device == "cpu" or (device == "auto" and cuda_device_count() == 0)
    if on_cpu and (advice := oversubscribed(processes, cpu_count())) is not None:
        warnings.warn(f"nbaccel: {advice}", RuntimeWarning, stacklevel=stacklevel + 1)


def show_in_cell(cell: Any, err: BaseException, title: str) -> None:
    """Show a background run's failure in its launching cell (``cell``: a ``CellOutput``)
    as an ``error`` output headed by ``title``, formatted as IPython formats it; never raises."""
    with contextlib.suppress(Exception):
        shown, lines = clean(err), list[str]()
        with contextlib.suppress(Exception):
            lines = _render(shown)
        lines = lines or _with_notes(traceback.format_exception(type(shown), shown, None), shown)
        content: dict[str, Any] = {"ename": type(shown).__name__, "evalue": str(shown)}
        content["traceback"] = [title, *lines]
        cell.flush()  # after the run's last lines
        cell.send("error", content)


__all__ = [
    "HINT_START",
    "Failure",
    "add_hint",
    "add_note",
    "clean",
    "fatal_stack",
    "oversubscribed",
    "pick_failure",
    "remote_exception",
    "show_in_cell",
    "signal_name",
    "trim_stack",
    "warn_oversubscribed",
]
