"""The fork server: workers forked from a copy of the kernel taken while CUDA was untouched.

Once a notebook has touched CUDA (``torch.cuda.is_available()``, a tensor on the GPU,
``import transformers``), a worker forked from the kernel would fail at its first CUDA
call, and a spawned one re-imports everything (seconds per launch). So, when nbaccel is
first *used* in a kernel whose CUDA driver is still untouched (the first launch or pool,
``%load_ext nbaccel``; never at ``import nbaccel``), :func:`take` forks one small process
from the kernel: it holds the modules the kernel has imported, never touches CUDA, and
forks workers on request. Unlike :mod:`multiprocessing`'s forkserver (a fresh interpreter
that imports a list of modules) it is a copy of the kernel's own state.

The kernel sends each worker's ends (stdout, stderr, channel, the rendezvous socket for
rank 0) over a Unix ``SOCK_SEQPACKET`` pair (``SCM_RIGHTS``); the server forks, and the
worker then reads its spec as a spawned one does (:func:`~..worker._worker.spawn_main`), the
function and arguments travelling with dill. The server reaps its workers and sends each
exit status back, so the kernel supervises them as its own. It ends with the kernel (end
of file on its socket, ``PR_SET_PDEATHSIG``), and its workers end with it.

``NBACCEL_FORK_SERVER``: ``1`` takes it in any process, ``0`` never; unset, it is taken in
an interactive kernel on a machine with an NVIDIA driver (elsewhere CUDA cannot be touched
and the kernel forks its workers itself).

Example:
    >>> from nbaccel.launch.start import _forkserver
    >>> _forkserver.usable(), _forkserver.wanted({"NBACCEL_FORK_SERVER": "0"})
    (False, False)
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Mapping

from ...platform import cudafork, environment, forksafe

ENV = "NBACCEL_FORK_SERVER"
_MESSAGE = struct.Struct("=4siii")  # kind, pid, and two numbers (fds, or an exit code)
_ANSWER_TIMEOUT = 30.0  # seconds to wait for the server to fork (it does nothing else)


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a fork server should be taken here (``NBACCEL_FORK_SERVER`` wins).

    Example:
        >>> wanted({"NBACCEL_FORK_SERVER": "1"})
        True
    """
    env = os.environ if environ is None else environ
    setting = env.get(ENV, "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    if not environment.in_kernel_process():
        return False
    return any(os.path.exists(path) for path in environment._NVIDIA_DRIVER_FILES)


class ForkServer:
    """Kernel side of a live fork server: ask it for workers, learn their exit status."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock
        self.dead: str | None = None  # why it is gone, once it is
        self._exits: dict[int, int] = {}
        self._lock = threading.Lock()

    def alive(self) -> bool:
        """Still serving (reads what it sent so far: an end of file means it is gone)."""
        with self._lock:
            self._drain()
        return self.dead is None

    def fork(self, fds: list[int]) -> tuple[int, list[int]]:
        """A worker forked with ``fds`` (stdout, stderr, channel[, store]): its pid and the
        numbers the other fds than stdout/stderr have in it."""
        with self._lock:
            self._drain()
            if self.dead is not None:
                raise OSError(f"the fork server is gone: {self.dead}")
            socket.send_fds(self.sock, [b"fork"], fds)
            deadline = time.monotonic() + _ANSWER_TIMEOUT
            while time.monotonic() < deadline:
                message = self._next(max(0.0, deadline - time.monotonic()))
                if message is None:
                    break
                kind, pid, first, second = message
                if kind == b"pid ":
                    return pid, [n for n in (first, second) if n >= 0]
            self._gone("it did not answer a request for a worker")
            raise OSError(f"the fork server is gone: {self.dead}")

    def returncode(self, pid: int) -> int | None:
        """``pid``'s exit status as ``subprocess`` gives it (None: still running)."""
        with self._lock:
            if pid not in self._exits:
                self._drain()
            # its workers end with it (PR_SET_PDEATHSIG): what is gone was killed
            if pid not in self._exits and self.dead is not None and not _exists(pid):
                self._exits[pid] = -signal.SIGKILL
            return self._exits.get(pid)

    def stop(self) -> None:
        """Ask the server to leave and reap it (the kernel's exit; tests)."""
        with self._lock:
            if self.dead is None:
                with contextlib.suppress(OSError):
                    self.sock.send(b"stop")
            self._gone("it was stopped", leaving=True)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not self._reaped():
                time.sleep(0.01)
            if not self._reaped():
                with contextlib.suppress(OSError):
                    os.kill(self.pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.pid, 0)

    def _next(self, timeout: float) -> tuple[bytes, int, int, int] | None:
        """The next message (exit statuses kept on the way); None: the server is gone."""
        while True:
            if not select.select([self.sock], [], [], timeout)[0]:
                return None
            try:
                data = self.sock.recv(_MESSAGE.size)
            except OSError:
                data = b""
            if len(data) != _MESSAGE.size:
                self._gone("it exited")
                return None
            kind, pid, first, second = _MESSAGE.unpack(data)
            if kind == b"exit":
                self._exits[pid] = first
                continue
            return kind, pid, first, second

    def _drain(self) -> None:
        while self.dead is None and select.select([self.sock], [], [], 0)[0]:
            if self._next(0) is None:
                break

    def _gone(self, why: str, *, leaving: bool = False) -> None:
        if self.dead is None:
            self.dead = why
            _CLOSE_IN_CHILD.discard(self.sock.fileno())
            self.sock.close()
        if leaving or self._reaped():
            return  # stop() waits for it itself
        # Its end of file can come before its exit is reapable (killed, still exiting), or it
        # stopped answering: end it, and reap it when it has gone, never leaving a zombie.
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        threading.Thread(target=self._reap, name="nbaccel-forkserver-reap", daemon=True).start()

    def _reap(self) -> None:
        with contextlib.suppress(ChildProcessError, InterruptedError):
            os.waitpid(self.pid, 0)

    def _reaped(self) -> bool:
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return True
        return pid != 0


class ServerWorker:
    """A worker the fork server started, as ``subprocess.Popen`` looks to the kernel."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.02)
        return self.returncode


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_server: ForkServer | None = None
_missed: list[str] = []  # why none was taken (said when a launch spawns instead)
_CLOSE_IN_CHILD: set[int] = set()  # the kernel's end: never inherited by what it forks


def _close_in_child() -> None:
    for fd in list(_CLOSE_IN_CHILD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _CLOSE_IN_CHILD.clear()


def take() -> ForkServer | None:
    """Fork the server from this process now, if wanted and CUDA is untouched (once).

    Called at nbaccel's first use in a kernel, in its main thread (the server's parent-death
    signal follows the thread that forks it). The caller has pre-imported what workers need.

    Returns:
        The live server, or None (not wanted, too late, not the main thread).
    """
    global _server
    if _server is not None or _missed or not hasattr(os, "fork"):
        return _server
    if threading.current_thread() is not threading.main_thread() or not wanted():
        return None
    if forksafe.fork_breaks_this_process():  # not now; perhaps once Ray is shut down
        return None
    if (state := cudafork.fork_state()).broken:
        _missed.append(
            f"{state.what().split(' (')[0]} since before nbaccel was first used here, so no "
            "fork server could be taken (run `%load_ext nbaccel` in the notebook's first cell)"
        )
        return None
    forksafe.release_openmp_threads()
    kernel_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for stream in (sys.stdout, sys.stderr):  # nothing buffered may be written twice
        with contextlib.suppress(Exception):
            stream.flush()
    parent = os.getpid()
    with forksafe.forking():  # the kernel's threads hold nothing the server uses
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the server; it always os._exit()s
        kernel_end.close()
        _serve(server_end, parent)
    server_end.close()
    if not _CLOSE_IN_CHILD:
        os.register_at_fork(after_in_child=_close_in_child)
    _CLOSE_IN_CHILD.add(kernel_end.fileno())
    _server = ForkServer(pid, kernel_end)
    atexit.register(_server.stop)
    return _server


def usable() -> bool:
    """A fork server was taken and still serves."""
    return _server is not None and _server.alive()


def why_not() -> str | None:
    """Why workers cannot come from a fork server here (None: they can, or none is wanted)."""
    if _server is not None:
        return None if _server.alive() else f"nbaccel's fork server has died ({_server.dead})"
    return _missed[0] if _missed else None


_said: set[str] = set()


def say_why_not() -> None:
    """One line in the cell, once per reason: the fork server that was wanted cannot serve."""
    if (why := why_not()) is None or why in _said:
        return
    _said.add(why)
    with contextlib.suppress(Exception):
        sys.stderr.write(f"nbaccel: workers are spawned, not forked: {why}.\n")


def server_pid() -> int | None:
    """The fork server's pid (None: none was taken)."""
    return _server.pid if _server is not None else None


def start_worker(fds: list[int]) -> tuple[ServerWorker, list[int]]:
    """A worker forked by the server with ``fds`` (stdout, stderr, channel[, store]), and
    the numbers the channel and the store have in it.

    Raises:
        OSError: the server is gone.
    """
    if _server is None:
        raise OSError("no fork server was taken in this kernel")
    pid, numbers = _server.fork(fds)
    return ServerWorker(_server, pid), numbers


def _reset() -> None:
    """Forget the server (tests that stop it)."""
    global _server
    _server = None
    _missed.clear()


def _serve(sock: socket.socket, kernel: int) -> None:  # pragma: no cover - in the server
    """The server's loop: fork a worker per request, send back each worker's exit status."""
    code = 0
    try:
        atexit._clear()  # the kernel's exit handlers are not the server's
        from ..worker import _worker_os

        _worker_os.reset_signals()  # SIGTERM: the server ends with its workers
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Jupyter interrupts the process group
        _worker_os.die_with_parent(kernel)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
        gc.freeze()  # the inherited objects stay in shared pages (copy-on-write)
        while True:
            ready = select.select([sock.fileno(), wake_r], [], [])[0]
            if wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
            _report_exits(sock)
            if sock.fileno() not in ready:
                continue
            message, fds, _, _ = socket.recv_fds(sock, 16, 8)
            if message != b"fork":  # b"stop", or the kernel is gone (end of file)
                for fd in fds:
                    os.close(fd)
                break
            pid = os.fork()
            if pid == 0:
                sock.close()
                for fd in (wake_r, wake_w):
                    os.close(fd)
                _worker(fds, kernel)
            for fd in fds:
                os.close(fd)
            extra = [*fds[2:], -1, -1]  # the channel's and the store's numbers in the worker
            sock.send(_MESSAGE.pack(b"pid ", pid, extra[0], extra[1]))
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _report_exits(sock: socket.socket) -> None:  # pragma: no cover - in the server
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        with contextlib.suppress(OSError):
            sock.send(_MESSAGE.pack(b"exit", pid, os.waitstatus_to_exitcode(status), 0))


def _worker(fds: list[int], kernel: int) -> None:  # pragma: no cover - in a worker
    """A worker forked by the server: stdout/stderr onto its pipes, then as a spawned one."""
    code = 70
    try:
        signal.set_wakeup_fd(-1)
        out, err, channel = fds[:3]
        for fd, target in ((out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        from ..worker._worker import spawn_main

        spawn_main(channel, forked_by=os.getppid())
    finally:
        os._exit(code)


__all__ = [
    "ENV",
    "ForkServer",
    "ServerWorker",
    "say_why_not",
    "server_pid",
    "start_worker",
    "take",
    "usable",
    "wanted",
    "why_not",
]
