"""The kernel's side of a group of started worker processes: read them, end them.

However a worker was started (``start/``: fork, spawn, the fork server, a cluster's node),
the kernel holds two pipes for its stdout/stderr and one channel to it; the start backend
hands them over as a :class:`WorkerProcess` through this module's public names:
:func:`keep_kernel_ends` (every process forked from the kernel closes those ends at once,
so a worker's channel ends exactly when the supervisor's process is gone; :func:`close_ends`
closes them), :func:`send_setups` (a worker that did not fork gets its spec as its first
message) and :func:`end_started` (what a failed start leaves is killed and closed). What
workers reported importing themselves is remembered here (:func:`worker_imports`) for the
start backends that pre-import before forking. One ``selectors`` loop over every worker's
pipes and channel: lines go to the :class:`~..cell._output.LineForwarder` (a tail of stderr
is kept for a fatal error's stack), messages to the supervisor. Ending: ask to leave,
SIGTERM, SIGKILL, reap, close.

Example:
    >>> WorkerProcess.KILL_WAIT, Group.DRAIN
    (5.0, 0.5)
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...errors import named_rank
from ...platform import environment
from ..cell._output import LineForwarder
from ..channel._messages import Exit, Setup
from ..channel._wire import Channel

_KERNEL_ENDS: set[int] = set()  # the kernel's ends of every live worker's pipes and channel
_hook_installed = False
_learned: set[str] = set()  # what workers imported themselves


def remember_worker_imports(modules: list[str]) -> None:
    """A worker reported importing ``modules`` itself (the supervisor hears it)."""
    _learned.update(modules)


def worker_imports() -> frozenset[str]:
    """What workers reported importing themselves: a backend that forks pre-imports the
    ones it knows to be safe, so the next workers inherit them (learned, not predicted)."""
    return frozenset(_learned)


def close_kernel_ends_in_children() -> None:
    """From now on, every process forked from the kernel closes the kernel's ends at once
    (installed once; a fork server must not keep them open either)."""
    global _hook_installed
    if not _hook_installed:
        os.register_at_fork(after_in_child=lambda: close_ends(_KERNEL_ENDS))
        _hook_installed = True


def keep_kernel_ends(*ends: int | Channel) -> None:
    """``ends`` (pipe fds, channels) are the kernel's ends of a worker's streams: no forked
    process keeps them open (:func:`close_kernel_ends_in_children`), and :func:`close_ends`
    closes them."""
    close_kernel_ends_in_children()
    _KERNEL_ENDS.update(end.fileno() if isinstance(end, Channel) else end for end in ends)


class Started(Protocol):
    """A process handle a start backend kept (``subprocess.Popen``, a fork server's worker):
    the engine polls and waits on it instead of ``waitpid`` (the process is not its child)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


@dataclass
class WorkerProcess:
    """Kernel-side view of one worker: pid, output pipes, channel, exit status."""

    rank: int
    pid: int
    fds: dict[str, int]  # read ends: "stdout", "stderr"
    channel: Channel | None = None
    popen: Started | None = None  # None: a child of the kernel, reaped with waitpid
    returncode: int | None = None
    exit_time: float | None = None
    killed_by_us: bool = False
    node: str | None = None  # on another machine (a cluster's): "node <address> (<node id>)"
    # poll() may run in the kernel's thread and in a background reaper at once: one waitpid
    # at a time, so the exit status is read once and a reused pid is never waited for
    _reap_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    #: seconds to wait for a worker to vanish after SIGKILL before a thread takes over
    KILL_WAIT = 5.0

    @property
    def named(self) -> str:
        """How messages name it: ``rank 1``, on a cluster ``rank 1 (pid 42 on node ...)``."""
        return named_rank(self.rank, self.pid, self.node)

    def poll(self) -> int | None:
        """Reap without blocking; negative return codes are signals (as in subprocess)."""
        if self.returncode is not None:
            return self.returncode
        with self._reap_lock:
            if self.returncode is not None:
                return self.returncode
            if self.popen is not None:
                code = self.popen.poll()
            else:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # someone else reaped it (SIGCHLD=SIG_IGN, os.wait())
                    pid, status = self.pid, 255 << 8
                code = None if pid == 0 else os.waitstatus_to_exitcode(status)
            if code is not None:
                self.returncode, self.exit_time = code, time.time()
        return code

    def alive(self) -> bool:
        """Running, with its main thread: exiting, a process whose main thread has ended is
        a zombie in ``/proc`` that ``waitpid`` cannot reap until its other threads end."""
        if self.poll() is not None:
            return False
        import psutil

        try:
            return bool(psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return False

    def wait(self, timeout: float) -> int | None:
        """Poll until exited or ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.returncode

    def reap(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for the exit; if it has not come, a daemon thread
        waits for it, so the kernel never keeps a zombie of a worker it let go."""
        if (code := self.wait(timeout)) is None:
            threading.Thread(
                target=self._reap_when_exited, name=f"nbaccel-reap-{self.pid}", daemon=True
            ).start()
        return code

    def kill(self, timeout: float | None = None) -> int | None:
        """SIGKILL, then :meth:`reap` (``timeout`` defaults to :attr:`KILL_WAIT`)."""
        self.send_signal(signal.SIGKILL)
        return self.reap(self.KILL_WAIT if timeout is None else timeout)

    def _reap_when_exited(self) -> None:
        # A SIGKILLed process can take long to vanish (uninterruptible I/O, an overloaded
        # machine); it still exits, and then it must be reaped by us, its parent.
        if self.popen is not None:
            with contextlib.suppress(Exception):
                self.popen.wait()
        elif hasattr(os, "waitid"):
            # WNOWAIT: block until the exit without reaping, then reap under the lock
            with contextlib.suppress(ChildProcessError, InterruptedError):
                os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        while self.poll() is None:  # no waitid (macOS), or interrupted
            time.sleep(0.1)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, sig)

    def descendants(self) -> list[Any]:
        """psutil processes started by this worker (DataLoader workers, subprocesses)."""
        try:
            import psutil

            return psutil.Process(self.pid).children(recursive=True)
        except Exception:
            return []

    def cpu_seconds(self) -> float | None:
        """CPU time used so far by this worker and its live children (None: unknown)."""
        try:
            import psutil

            procs = [psutil.Process(self.pid), *self.descendants()]
            return sum(sum(p.cpu_times()[:2]) for p in procs)
        except Exception:
            return None

    def close(self) -> None:
        """Close the kernel's ends of this worker's pipes and channel (idempotent)."""
        close_ends([*self.fds.values(), self.channel])
        self.fds, self.channel = {}, None


def close_ends(ends: Iterable[Any]) -> None:
    """Close the kernel's ends: pipe fds, and channels (a socket closes its own fd)."""
    for end in list(ends):
        if isinstance(end, Channel):
            _KERNEL_ENDS.discard(end.fileno())
            end.close()
        elif end in _KERNEL_ENDS:
            _KERNEL_ENDS.discard(end)
            with contextlib.suppress(OSError):
                os.close(end)


def send_setups(procs: Sequence[WorkerProcess], specs: Sequence[Any]) -> None:
    """Each started worker that did not fork gets its spec as its first message, with the
    kernel's ``sys.path`` and the notebook's cell sources (for its tracebacks). A worker
    that died at start-up is left for its exit status to report."""
    sources = environment.notebook_cell_sources()  # IPython 7's cells (Colab) and 8's
    for spec, proc in zip(specs, procs, strict=True):
        with contextlib.suppress(OSError):
            proc.channel.send(Setup(spec, list(sys.path), sources))  # type: ignore[union-attr]


def end_started(procs: Iterable[WorkerProcess]) -> None:
    """A start failed (or was interrupted) half-way: every worker it started is killed,
    reaped and its ends closed, so no unsupervised worker remains."""
    for proc in procs:
        proc.kill()
        proc.close()


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


__all__ = [
    "Group",
    "Started",
    "WorkerProcess",
    "close_ends",
    "close_kernel_ends_in_children",
    "end_started",
    "keep_kernel_ends",
    "remember_worker_imports",
    "send_setups",
    "worker_imports",
]
