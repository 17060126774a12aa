"""Worker side of post-mortem debugging: keep a failed job's traceback, serve pdb on it.

A failed job's exception (its frames and their locals) is kept until the next job or the
worker leaves. ``Debug(sid)`` opens :class:`pdb.Pdb`'s post-mortem on it in the main thread,
its streams (and ``sys.stdin``/``stdout``/``stderr``) wired to the channel: pdb's output
goes as ``PdbOutput(sid, "ask", text, prompt)`` when it waits for a line, the kernel answers
``PdbLine(sid, line)`` ("": end of input); on return the rest goes as ``PdbOutput(sid,
"end", text)``, with nothing kept ``PdbOutput(sid, "none", why)``. A failed one-shot worker
of ``debug=True`` waits (:func:`linger`) up to ``debug_timeout`` seconds for one session.

Example:
    >>> keep(ValueError("x"), skip=())
    >>> kept() is not None
    True
    >>> forget(); kept() is None
    True
"""

from __future__ import annotations

import contextlib
import gc
import io
import pdb
import queue
import signal
import sys
import time
from typing import Any

from ..channel._messages import Debug, Exit, PdbLine, PdbOutput

_kept: list[BaseException] = []  # the last failed job's exception (at most one)


def keep(exc: BaseException, *, skip: tuple[str, ...]) -> None:
    """Keep ``exc`` with its traceback starting at the user's code (frames of ``skip``,
    the worker's machinery, cut off, so that ``up`` stops at the user's outermost frame)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in skip:
        tb = tb.tb_next
    with contextlib.suppress(Exception):
        exc.__traceback__ = tb
    _kept[:] = [exc]


def forget() -> None:
    """A new job starts: the previous failure's frames may go, and with them the tensors
    their locals held (a traceback is full of reference cycles: collect them now, before
    the new job allocates, or the failed call's GPU memory is still taken; issue 32)."""
    if _kept:
        _kept.clear()
        gc.collect()


def kept() -> BaseException | None:
    return _kept[0] if _kept else None


class _Out(io.StringIO):
    """pdb's stdout: text collected until pdb asks for a line (or the session ends), sent
    with the prompt: one message per command."""

    def take(self) -> str:
        text = self.getvalue()
        self.seek(0)
        self.truncate()
        return text


class _In:
    """pdb's stdin: each line comes from the kernel, asked for with what pdb wrote."""

    def __init__(self, sid: int, channel: Any, inbox: queue.Queue[Any], out: _Out) -> None:
        self.sid, self.channel, self.inbox, self.out = sid, channel, inbox, out
        self.later: list[Any] = []  # messages for the worker's loop, not for pdb
        self.ended = False

    def readline(self, size: int = -1) -> str:
        if self.ended:
            return ""
        text, _, prompt = self.out.take().rpartition("\n")
        self.channel.send(PdbOutput(self.sid, "ask", text + "\n" if text else "", prompt))
        while True:
            message = self.inbox.get()
            if isinstance(message, PdbLine):
                if message.sid == self.sid:  # a typed line ends in "\n" ("" is the end)
                    self.ended = not message.line
                    return message.line
                continue  # a line for an earlier session
            # "exit", a job, another session: the kernel has moved on. End this session;
            # the worker's loop acts on the message next.
            self.later.append(message)
            self.ended = True
            return ""

    def isatty(self) -> bool:
        return False


def session(sid: int, channel: Any, inbox: queue.Queue[Any]) -> None:
    """One pdb post-mortem session on the kept failure, driven over ``channel``."""
    if (exc := kept()) is None:
        channel.send(PdbOutput(sid, "none", "this worker holds no failed job's traceback"))
        return
    out = _Out()
    stdin = _In(sid, channel, inbox, out)
    # the standard library's class: a worker forked from ipykernel inherits ``pdb.Pdb``
    # replaced by IPython's (other prompt, colours); a spawned one has the stdlib's
    stdlib = next(c for c in pdb.Pdb.__mro__ if c.__module__ == "pdb" and c.__name__ == "Pdb")
    debugger = stdlib(stdin=stdin, stdout=out, nosigint=True, readrc=False)
    debugger.use_rawinput = False
    streams = (sys.stdin, sys.stdout, sys.stderr)
    sys.stdin, sys.stdout, sys.stderr = stdin, out, out
    # The kernel's interrupt stops a long evaluation: pdb reports the KeyboardInterrupt and
    # prompts again (the worker loop's own handler ignores SIGINT between jobs).
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        debugger.reset()
        # from 3.13 it takes the exception (chained ones can be walked with ``exceptions``)
        debugger.interaction(None, exc if sys.version_info >= (3, 13) else exc.__traceback__)
    except BaseException as err:  # never lose the worker over the debugger
        out.write(f"*** the debugger ended: {type(err).__name__}: {err}\n")
    finally:
        signal.signal(signal.SIGINT, handler)
        sys.stdin, sys.stdout, sys.stderr = streams
        with contextlib.suppress(Exception):
            sys.settrace(None)
    channel.send(PdbOutput(sid, "end", out.take()))
    for message in stdin.later:  # e.g. "exit": the worker's loop acts on it next
        inbox.put(message)


def linger(channel: Any, inbox: queue.Queue[Any], seconds: float) -> None:
    """A failed one-shot worker: wait up to ``seconds`` for a debugger, serve its
    session, and return (the worker then leaves). ``exit`` returns at once."""
    deadline = time.monotonic() + seconds
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            message = inbox.get(timeout=remaining)
        except queue.Empty:
            return
        if isinstance(message, Debug):
            session(message.sid, channel, inbox)
        if isinstance(message, (Debug, Exit)):
            return


__all__ = ["forget", "keep", "kept", "linger", "session"]
