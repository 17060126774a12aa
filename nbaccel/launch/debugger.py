"""``nbaccel.debug()`` and ``%nbaccel_debug``: pdb on a failed rank, from a notebook cell.

A worker whose job raised keeps the traceback (a pool's until its next call; with
``notebook_launcher(..., debug=True)`` for ``debug_timeout`` seconds). ``debug()`` prints
where the other ranks were, then opens pdb's post-mortem *in that worker*: each prompt is
read with the kernel's ``input()`` (as IPython's ``%debug``: every front end, no extension)
and sent over the channel; pdb's output comes back into the cell. ``q``, ``c`` or an empty
line end the session and release the worker.

Example:
    >>> pool.run(train)  # doctest: +SKIP
    ValueError: rank 1: shapes do not match
    >>> import nbaccel
    >>> nbaccel.debug()  # doctest: +SKIP
    (Pdb) p batch.shape
    torch.Size([8, 3])
    (Pdb) q
"""

from __future__ import annotations

import builtins
import contextlib
import itertools
import signal
from collections.abc import Sequence

from ..errors import LaunchError
from .channel._messages import Debug, PdbLine, PdbOutput
from .debug import _kept
from .engine._supervisor import Hook, JobFailed, Supervisor
from .engine._tidy import clean, trim_stack

_sessions = itertools.count(1)
WAIT_STEP = 0.05  # seconds per look at the worker while waiting for pdb's answer


def debug(rank: int | None = None, *, commands: Sequence[str] | None = None) -> None:
    """Open a pdb post-mortem session on a failed rank of the last failed job.

    Args:
        rank: the global rank to debug; ``None``: the first real failure's.
        commands: pdb commands to run one after the other instead of asking (for a
            notebook run without a person at it); the session ends after the last one.

    Raises:
        LaunchError: no session is possible; the message says why (nothing failed yet, the
            rank was killed by a signal or exited, its worker is gone, the pool ran
            another call since, the launch ran without ``debug=True``, the front end
            cannot ask for input).
        KeyboardInterrupt: interrupted at the prompt (the worker is released first).

    Example:
        >>> nbaccel.debug(1)  # doctest: +SKIP
        >>> nbaccel.debug(commands=["p x", "up", "where", "q"])  # doctest: +SKIP
    """
    try:
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise TypeError(f"rank={rank!r} must be a rank number (an int) or None.")
        if commands is not None and (
            isinstance(commands, str) or not all(isinstance(c, str) for c in commands)
        ):
            raise TypeError(f"commands={commands!r} must be a list of pdb commands (strs).")
        if (job := _kept.last()) is None:
            raise LaunchError(
                "nothing to debug: no job has failed on workers in this kernel. When a pool call "
                "or a notebook_launcher(..., debug=True) run fails, nbaccel.debug() opens pdb on "
                "the failed rank."
            )
        target = job.first if rank is None else rank
        if (why := job.unavailable(target)) is not None:
            raise LaunchError(why)
        if not job.lock.acquire(blocking=False):
            raise LaunchError(f"a debugging session on {job.named(target)} is already open.")
        try:
            group = job.group
            why = job.unavailable(target)  # the kept workers may have left meanwhile
            if why is not None or group is None:
                raise LaunchError(why or f"{job.named(target)}: its worker is gone.")
            print(_header(job, target, group), end="", flush=True)
            try:
                _session(group, target, None if commands is None else list(commands))
            finally:
                _kept.release(job, target)  # a rank kept only for debugging goes now
        finally:
            job.lock.release()
    except (LaunchError, TypeError, KeyboardInterrupt) as err:  # why: a message, not our frames
        raise clean(err) from None


def _header(job: _kept.FailedJob, rank: int, group: Supervisor) -> str:
    failure = job.failures.get(rank)
    proc = group.procs[rank]
    what = failure.summary() if failure is not None else proc.named
    where = "" if proc.node else f" (pid {proc.pid})"  # on a cluster: named with its node
    lines = [f"nbaccel: post-mortem of {what}{where}"]
    others = {r: text for r, text in sorted(job.others.items()) if r != rank}
    if rank != job.first and job.first in job.failures:
        others[job.first] = f"failed first ({job.failures[job.first].summary()})"
    if others:
        lines.append(f"The other ranks when {job.named(job.first)} failed:")
        for other, text in others.items():
            if "\n" in text or text.startswith("  File"):  # a stack: from the user's frames
                lines += [f"--- {job.named(other)}: ---", trim_stack(text)]
            else:
                lines.append(f"--- {job.named(other)}: {text}")
    lines.append("q (or c) ends the session and releases the worker.")
    return "\n".join(lines) + "\n"


class _Inbox(Hook):
    """A session's hook on the supervisor: the pdb messages of ``rank``'s session ``sid``."""

    def __init__(self, rank: int, sid: int) -> None:
        self.rank, self.sid, self.messages = rank, sid, list[PdbOutput]()

    def message(self, sup: Supervisor, rank: int, message: object) -> None:
        if isinstance(message, PdbOutput) and (rank, message.sid) == (self.rank, self.sid):
            self.messages.append(message)


def _session(group: Supervisor, rank: int, script: list[str] | None) -> None:
    """Drive one pdb session on ``rank``'s worker until pdb returns."""
    sid, who = next(_sessions), group.procs[rank].named
    inbox = _Inbox(rank, sid)  # in place of an earlier session's
    group.hooks[:] = [h for h in group.hooks if not isinstance(h, _Inbox)] + [inbox]
    try:
        group.send([rank], Debug(sid))
    except JobFailed as failed:
        raise LaunchError(f"{who}: its worker is gone ({failed.error})") from None
    problem: BaseException | None = None
    while True:
        message = _next(group, inbox)
        if message.kind == "none":
            raise LaunchError(f"no post-mortem session on {who}: {message.text}.")
        print(message.text, end="", flush=True)
        if message.kind == "end":
            break
        line = ""
        if problem is None:
            try:
                line = _ask(message.prompt, script)
            except (KeyboardInterrupt, NotImplementedError) as err:
                problem = err  # release the worker first, then say so
        with contextlib.suppress(OSError, AttributeError):  # it may have left after "end"
            group.procs[rank].channel.send(PdbLine(sid, line))  # type: ignore[union-attr]
    if isinstance(problem, NotImplementedError):
        raise LaunchError(
            "this front end cannot answer input requests, so no pdb prompt can be shown "
            "(the worker was released); run nbaccel.debug() in a notebook or console, or "
            "pass the pdb commands: nbaccel.debug(commands=['p x', 'where', 'q'])."
        )
    if problem is not None:  # the interrupt button at the prompt: said plainly
        raise KeyboardInterrupt(
            f"the debugging session on {who} was interrupted; the worker was released"
        ) from None


def _ask(prompt: str, script: list[str] | None) -> str:
    """The next line for pdb ("" ends the session): from ``script``, or typed."""
    if script is not None:
        line = script.pop(0) if script else ""
        print(f"{prompt}{line}\n" if line else "", end="", flush=True)
        return f"{line}\n" if line else ""
    try:
        return builtins.input(prompt) + "\n"  # the kernel's input(): an input request
    except EOFError:
        return ""


def _next(group: Supervisor, inbox: _Inbox) -> PdbOutput:
    """The worker's next pdb message of session ``sid``; LaunchError if it dies. The
    interrupt button interrupts what pdb evaluates in the worker (it prompts again); a
    second press while the worker does not answer ends the session."""
    proc, interrupted = group.procs[inbox.rank], False
    while True:
        try:
            while not inbox.messages:
                if proc.poll() is not None:
                    group.drain()
                    raise LaunchError(
                        f"{proc.named}: its worker exited (code {proc.returncode}) during the "
                        "debugging session; nothing more to debug there."
                    )
                group.pump(WAIT_STEP)
            return inbox.messages.pop(0)
        except KeyboardInterrupt:
            if interrupted:
                with contextlib.suppress(OSError, AttributeError):
                    proc.channel.send(PdbLine(inbox.sid, ""))  # type: ignore[union-attr]
                raise
            interrupted = True
            proc.send_signal(signal.SIGINT)
            print(f"(interrupting {proc.named}; press again to leave the session)", flush=True)


__all__ = ["debug"]
