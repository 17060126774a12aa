"""The kernel's ends of one group of worker processes: read them, end them.

One ``selectors`` loop over every worker's pipes and channel: lines go to the
:class:`~._output.LineForwarder` (a tail of stderr is kept for a fatal error's stack),
messages to the supervisor. Ending: ask to leave, SIGTERM, SIGKILL, reap, close.

Example:
    >>> Group.DRAIN
    0.5
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

from ._messages import Exit
from ._output import LineForwarder
from ._process import WorkerProcess


class Group:
    """Started workers, by rank, and the kernel's ends of their pipes and channels."""

    DRAIN = 0.5  # seconds to wait for output after the last worker exited
    TAIL = 1 << 16  # bytes of each rank's stderr kept for a fatal error's stack

    def __init__(
        self,
        procs: list[WorkerProcess],
        forwarder: LineForwarder,
        on_message: Callable[[WorkerProcess, object], None],
        on_event: Callable[[int, str, dict], None],
    ) -> None:
        self.procs = {p.rank: p for p in procs}
        self.forwarder, self.on_message, self.on_event = forwarder, on_message, on_event
        self.owner = os.getpid()
        self._tails = {rank: bytearray() for rank in self.procs}
        self._selector = selectors.DefaultSelector()
        self._open: set[int] = set()
        for proc in procs:
            assert proc.channel is not None
            for name, fd in [*proc.fds.items(), ("channel", proc.channel.fileno())]:
                self._selector.register(fd, selectors.EVENT_READ, (proc, name))
                self._open.add(fd)

    def pump(self, wait: float) -> None:
        """Read whatever arrives within ``wait`` seconds and act on it."""
        if not self._open:
            time.sleep(min(wait, 0.001))  # every end is closed: the workers are exiting
            return
        for key, _ in self._selector.select(wait):
            proc, name = key.data
            if name == "channel":
                assert proc.channel is not None
                if (messages := proc.channel.receive()) is None:
                    self._close(key.fd, proc, name)
                for message in messages or ():
                    self.on_message(proc, message)
                continue
            try:
                data = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self._close(key.fd, proc, name)
                continue
            self.forwarder.feed(proc.rank, name, data)
            if name == "stderr":
                tail = self._tails[proc.rank]
                tail += data
                del tail[: -self.TAIL]

    def _close(self, fd: int, proc: WorkerProcess, name: str) -> None:
        if fd in self._open:
            self._open.discard(fd)
            self._selector.unregister(fd)
            if name != "channel":
                self.forwarder.close(proc.rank, name)

    def tail(self, rank: int) -> str:
        """The end of ``rank``'s stderr (a fatal error's stack is there)."""
        return self._tails[rank].decode(errors="replace")

    def poll(self) -> None:
        """Reap the exited workers; a death by signal is an event ("killed")."""
        for proc in self.procs.values():
            if proc.returncode is None:
                code = proc.poll()
                if code is not None and code < 0:
                    self.on_event(proc.rank, "state", {"state": "killed", "code": code})

    def exited(self, proc: WorkerProcess) -> bool:
        """Exited, and its channel read to the end (or it exited long enough ago)."""
        if proc.returncode is None or proc.exit_time is None:
            return False
        fd = proc.channel.fileno() if proc.channel is not None else -1
        return fd not in self._open or time.time() - proc.exit_time > 0.3

    def drain(self) -> None:
        """Forward the output already written (it precedes the job's answers), whole."""
        for _ in range(1000):
            if not self._open or not self._selector.select(0):
                break
            self.pump(0)
        for rank in self.procs:
            for stream in ("stdout", "stderr"):
                self.forwarder.close(rank, stream)

    def shutdown(self, timeout: float, spare: Iterable[int] = ()) -> None:
        """Ask every worker to leave (the exit barrier, the group torn down), then end it.
        ``spare``: ranks left running (and the group open) for whoever holds them."""
        if os.getpid() != self.owner:
            return
        spare = set(spare)
        leaving = [p for p in self.procs.values() if p.rank not in spare]
        children = [d for p in leaving for d in p.descendants()]
        try:
            with contextlib.suppress(OSError, AttributeError):
                for proc in leaving:
                    proc.channel.send(Exit())  # type: ignore[union-attr]
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(p.poll() is None for p in leaving):
                self.pump(0.05)
        finally:  # also when interrupted while waiting: nothing may stay behind
            self.terminate(spare, children)
            if not spare:
                self.close()

    def terminate(self, spare: Iterable[int] = (), children: Iterable[Any] = ()) -> None:
        """SIGTERM every live worker but ``spare`` (it ends its own children), SIGKILL
        after 1 s; reap; then SIGKILL what is left of their (and ``children``'s) processes."""
        if os.getpid() != self.owner:
            return
        alive = [p for p in self.procs.values() if p.poll() is None and p.rank not in spare]
        descendants = [*children, *(d for p in alive for d in p.descendants())]
        for proc in alive:
            proc.killed_by_us = True
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 1.0
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            self.pump(0.02)
        for proc in alive:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in alive:
            proc.reap(proc.KILL_WAIT)
        for child in descendants:
            with contextlib.suppress(Exception):
                child.kill()

    def close(self) -> None:
        """Drain what is left of the output briefly, then close every end (idempotent)."""
        if self._selector.get_map() is None:
            return
        deadline = time.time() + self.DRAIN
        while self._open and time.time() < deadline:
            self.pump(0.05)
        for key in list(self._selector.get_map().values()):
            proc, name = key.data
            self._close(key.fd, proc, name)
        for proc in self.procs.values():
            proc.close()
        self._selector.close()


__all__ = ["Group"]
