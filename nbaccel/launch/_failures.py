"""Turn what went wrong in the workers into one exception in the kernel.

Each failure is *real* (the user's exception, a death by signal, an unexpected exit) or
*secondary* (a healthy rank noticing a vanished peer); the first real one is raised, as an
instance of a dynamic subclass of both the remote type and
:class:`~nbaccel.errors.WorkerError` (``except ValueError`` works, ``err.rank`` is there).
A fatal error's stack is cut to the user's frames.

Example:
    >>> info = {"type_module": "builtins", "type_qualname": "ValueError",
    ...         "message": "bad", "traceback": "Traceback ...", "time": 0.0}
    >>> err = remote_exception(Failure(rank=1, pid=42, time=0.0, kind="exception", info=info))
    >>> isinstance(err, ValueError), err.rank
    (True, 1)
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from ..errors import RanksMissingError, WorkerError
from ._wire import loads

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
        """One line, e.g. ``"rank 0: DistBackendError: Connection closed by peer"``."""
        if self.kind == "signal":
            return f"rank {self.rank}: killed by {signal_name(self.code)}"
        if self.kind == "exit":
            return f"rank {self.rank}: exited with code {self.code}"
        first = (self.info.get("message") or "").strip().splitlines()[:1]
        return f"rank {self.rank}: {self.info.get('type_qualname')}: {first[0] if first else ''}"


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
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return obj
    return None


_DYNAMIC: dict[type, type[WorkerError]] = {}


def _reduce(self: WorkerError) -> tuple[Any, ...]:
    args = (self.rank, self.pid, self.exc_type, self.message, self.remote_traceback)
    return (WorkerError, args)


def _combined(original: type) -> type[WorkerError] | None:
    """A subclass of ``original`` and WorkerError (cached), or None if Python refuses."""
    if original in _DYNAMIC:
        return _DYNAMIC[original]
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
    _DYNAMIC[original] = combined
    return cast("type[WorkerError]", combined)


def remote_exception(failure: Failure) -> WorkerError:
    """The exception to raise in the kernel for ``failure`` (with the worker's exit code)."""
    err = _remote_exception(failure)
    if failure.kind == "signal":
        err.exit_code = 128 + failure.code  # as a shell reports it
    else:
        err.exit_code = failure.code if failure.kind == "exit" else failure.info.get("exit_code", 1)
    return err


def _remote_exception(failure: Failure) -> WorkerError:
    if failure.kind == "signal":
        name = signal_name(failure.code)
        hint = " (SIGKILL is often the out-of-memory killer)" if failure.code == 9 else ""
        message = f"the worker was killed by signal {name}{hint}"
        return WorkerError(failure.rank, failure.pid, name.split()[0], message, failure.stack)
    if failure.kind == "exit":
        message = f"the worker exited with code {failure.code} before the function returned"
        return WorkerError(failure.rank, failure.pid, "ExitCode", message, failure.stack)
    info = failure.info
    qualname = info.get("type_qualname", "Exception")
    args = (failure.rank, failure.pid, qualname, info.get("message", ""), info.get("traceback", ""))
    original = _locate(info.get("type_module", ""), qualname)
    cls = _combined(original) if original is not None else None
    if cls is None:
        return WorkerError(*args)
    try:  # not the original __init__: it may need other args (OSError's __new__ is its own)
        err: WorkerError = cls.__new__(cls)
    except Exception:
        return WorkerError(*args)
    WorkerError.__init__(err, *args)
    _copy_attributes(err, info)
    return err


def _copy_attributes(err: BaseException, info: dict[str, Any]) -> None:
    """Carry the remote exception's own attributes (e.g. ``err.code``) over, if any."""
    for name, data in (info.get("attributes") or {}).items():
        if not hasattr(WorkerError, name) and name not in ("rank", "pid", "exc_type", "message"):
            with contextlib.suppress(Exception):
                setattr(err, name, loads(*data))


def trim_stack(text: str) -> str:
    """The last fatal-error dump in ``text`` (a worker's stderr), without nbaccel's frames
    below the user's function or, after a fork, the kernel's frames the child inherited."""
    start = text.rfind("Fatal Python error")
    if start < 0:
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


def name_missing(
    error: RanksMissingError,
    rank: int,
    done: dict[int, int | None],
    live: list[int],
    probe: Callable[[list[int]], dict[int, dict[str, Any]]],
) -> None:
    """Name the ranks that did not come to the collective ``rank`` failed in, and note what
    each does (its stack, or that it finished or is gone). ``done``: the collective counts
    of the ranks that answered the job; ``live``: the others, asked with ``probe``. A
    barrier's error names them already; for gather, reduce, broadcast... they are the ranks
    that had issued fewer collectives than ``rank``: they never called it."""
    answers = probe(live) if live else {}
    if not error.missing:
        counts = done | {r: a.get("collectives") for r, a in answers.items()}
        if (mine := counts.get(rank)) is not None:
            error.missing = sorted(r for r, n in counts.items() if n is not None and n < mine)
    if error.missing:
        lines = [
            f"Rank(s) {error.missing} did not come. What the rank(s) that did not come are doing:"
        ]
        for r in error.missing:
            state = "finished the job" if r in done else "no longer running"
            where = f"\n{answers[r]['stack'].rstrip()}" if r in answers else f" {state}"
            lines.append(f"--- rank {r}:{where}")
        add_note(error, "\n".join(lines))


__all__ = [
    "Failure",
    "add_note",
    "name_missing",
    "pick_failure",
    "remote_exception",
    "signal_name",
    "trim_stack",
]
