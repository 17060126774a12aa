"""The kernel's side of a group of worker processes: start them, read them, end them.

Each worker gets two pipes for stdout/stderr and one end of a socket pair, its channel to
the supervisor. Every process forked from the kernel closes the kernel's ends at once (a
hook the first launch installs), so a worker's channel ends exactly when the supervisor's
process is gone. fork: ``os.fork()``, the child never returns into the kernel's code and
inherits its first job; spawn: ``python -c "...spawn_main(fd)"``, its spec, ``sys.path``
and the notebook's cell sources the channel's first frame; fork server (CUDA touched in
the kernel since it was taken, :mod:`..start._forkserver`): forked by it, then as spawn. Before
forking, the kernel imports what each worker would repeat: nbaccel's runtime, and
``torch._dynamo`` once a worker needed it (torch imports it lazily from every optimizer and
DDP, ~0.8 s of CPU):
learned, not predicted, so a launch that never trains never pays it; only on CPU-only torch
builds, where the import cannot touch the driver. One ``selectors`` loop over
every worker's pipes and channel: lines go to the :class:`~..cell._output.LineForwarder` (a tail
of stderr is kept for a fatal error's stack), messages to the supervisor. Ending: ask to
leave, SIGTERM, SIGKILL, reap, close.

Example:
    >>> WorkerProcess.KILL_WAIT, Group.DRAIN
    (5.0, 0.5)
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ...config.fields import field_kind
from ...errors import LaunchError
from ...platform import cudafork, environment, forksafe
from ..cell._output import LineForwarder
from ..channel._messages import Exit, Job, Setup
from ..channel._wire import Channel
from ..start import _forkserver
from ..worker import _worker_os
from ..worker._worker import DYNAMO, WorkerSpec, fork_main

_KERNEL_ENDS: set[int] = set()  # the kernel's ends of every live worker's pipes and channel
_hook_installed = False
_learned: set[str] = set()  # what workers imported themselves: pre-imported before forks


def remember_worker_imports(modules: list[str]) -> None:
    """A worker reported importing ``modules`` itself: pre-import them from now on."""
    _learned.update(m for m in modules if m == DYNAMO)


def _preload() -> None:
    """Prepare the kernel so that forked workers inherit a warm, fork-safe runtime: the
    imports above, then the OpenMP pool released (a child would hang in its first
    multi-threaded op). No CUDA, no threads; a failure is left for the worker to report."""
    with contextlib.suppress(Exception):
        from ...runtime.facade import accelerator  # noqa: F401
    with contextlib.suppress(Exception):  # a cache every worker's Accelerator() reads
        field_kind("mixed_precision")
    torch = sys.modules.get("torch")
    if torch is not None and DYNAMO in _learned and not torch.cuda._is_compiled():
        with contextlib.suppress(Exception):
            import torch._dynamo
    forksafe.release_openmp_threads()


@dataclass
class WorkerProcess:
    """Kernel-side view of one worker: pid, output pipes, channel, exit status."""

    rank: int
    pid: int
    fds: dict[str, int]  # read ends: "stdout", "stderr"
    channel: Channel | None = None
    popen: subprocess.Popen[bytes] | _forkserver.ServerWorker | None = None
    returncode: int | None = None
    exit_time: float | None = None
    killed_by_us: bool = False
    # poll() may run in the kernel's thread and in a background reaper at once: one waitpid
    # at a time, so the exit status is read once and a reused pid is never waited for
    _reap_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    #: seconds to wait for a worker to vanish after SIGKILL before a thread takes over
    KILL_WAIT = 5.0

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


def start_processes(
    specs: list[WorkerSpec],
    method: str,
    first_job: Job | None,
    *,
    close_in_children: tuple[int, ...] = (),
) -> list[WorkerProcess]:
    """Start one worker per spec (``spec.fds`` is filled in here). Cleans up on failure."""
    if method == "forkserver" and _forkserver.usable():
        try:
            return _start(specs, method, first_job, close_in_children)
        except LaunchError as err:
            if not isinstance(err.__cause__, OSError) or _forkserver.usable():
                raise
            # the server died between the look before the launch and the request (killed,
            # say, its end of file not read yet): this launch spawns, as the cell is told
    return _start(specs, method, first_job, close_in_children)


def _start(
    specs: list[WorkerSpec],
    method: str,
    first_job: Job | None,
    close_in_children: tuple[int, ...],
) -> list[WorkerProcess]:
    global _hook_installed
    if not _hook_installed:  # channels reach their end exactly when the kernel is gone
        os.register_at_fork(after_in_child=lambda: close_ends(_KERNEL_ENDS))
        _hook_installed = True
    if method == "forkserver" and not _forkserver.usable():  # died since the launch began
        _forkserver.say_why_not()
        method = "spawn"
    if method == "fork":
        forksafe.warn_if_fork_unsafe()  # a warning in the cell unless the fork is checked safe
        _preload()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered may be written twice
            with contextlib.suppress(Exception):
                stream.flush()  # once for all workers: in a notebook, a round trip (~1 ms)
    ends = [_ends() for _ in specs]
    children = [fd for mine, _ in ends for fd in mine.values()]
    procs: list[WorkerProcess] = []
    if method == "fork":
        _worker_os.before_fork()
    try:
        for spec, (mine, kernel) in zip(specs, ends, strict=True):
            spec.fds = dict(mine)
            spec.close_fds = [fd for fd in children if fd not in mine.values()]
            spec.close_fds += [fd for fd in close_in_children if fd != spec.store_fd]
            with _interrupts_deferred():  # an interrupt now must not lose the pid
                popen: subprocess.Popen[bytes] | _forkserver.ServerWorker | None = None
                if method == "fork":
                    pid = _fork(spec, mine, first_job)
                else:
                    popen = (
                        _from_server(spec, mine) if method == "forkserver" else _spawn(spec, mine)
                    )
                    pid = popen.pid
                pipes = {"stdout": kernel["stdout"], "stderr": kernel["stderr"]}
                procs.append(WorkerProcess(spec.rank, pid, pipes, kernel["channel"], popen))
        if method != "fork":
            sources = environment.notebook_cell_sources()  # IPython 7's cells (Colab) and 8's
            for spec, proc in zip(specs, procs, strict=True):
                with contextlib.suppress(OSError):  # died at start-up: its exit is reported
                    proc.channel.send(Setup(spec, list(sys.path), sources))  # type: ignore[union-attr]
    except BaseException as err:
        for proc in procs:
            proc.kill()
            proc.close()
        for _, kernel in ends[len(procs) :]:
            close_ends(kernel.values())
        if isinstance(err, OSError):
            raise LaunchError(f"could not start the worker processes: {err}") from err
        raise
    finally:
        for fd in children:  # the kernel keeps only its own ends
            with contextlib.suppress(OSError):
                os.close(fd)
        _worker_os.after_fork_in_kernel()
    for proc in procs:
        for fd in proc.fds.values():
            os.set_blocking(fd, False)
    return procs


def _ends() -> tuple[dict[str, int], dict[str, Any]]:
    """(the worker's ends, the kernel's ends) of two pipes and a socket pair."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    kernel_sock, worker_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    worker_fd = worker_sock.detach()
    os.set_inheritable(worker_fd, True)
    _KERNEL_ENDS.update((out_r, err_r, kernel_sock.fileno()))
    kernel = {"stdout": out_r, "stderr": err_r, "channel": Channel(kernel_sock)}
    return {"stdout": out_w, "stderr": err_w, "channel": worker_fd}, kernel


def _fork(spec: WorkerSpec, mine: dict[str, int], job: Job | None) -> int:
    """The fork site: the child becomes the worker and never returns from here."""
    with forksafe.forking():  # Python >= 3.12's generic warning; check_fork decided instead
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, which always os._exit()s
        fork_main(spec, socket.socket(fileno=mine["channel"]), job)
    return pid


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold a notebook interrupt (SIGINT) back until the block ends: one raised as
    ``os.fork()`` returns would lose the pid, and the worker would live on unsupervised;
    inside, SIGINT is only recorded, then raised where the cleanup knows every worker.
    (``pthread_sigmask`` would not do: the OS hands the signal to another thread, and
    Python still raises in this one.)"""
    if (
        threading.current_thread() is not threading.main_thread()  # handlers run there only
        or signal.getsignal(signal.SIGINT) is None  # not Python's: cannot be put back
    ):
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)


def _package_root() -> str:
    """The folder that holds the ``nbaccel`` package (not the package itself: on the path,
    that one would shadow the standard library with ``nbaccel/logging.py``)."""
    here = os.path.abspath(__file__)  # nbaccel/launch/engine/_group.py
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(here))))


def _from_server(spec: WorkerSpec, mine: dict[str, int]) -> _forkserver.ServerWorker:
    """A worker forked by the fork server; like a spawned one, its spec comes as Setup."""
    store = [spec.store_fd] if spec.store_fd is not None else []
    popen, numbers = _forkserver.start_worker([mine["stdout"], mine["stderr"], mine["channel"],
                                               *store])  # fmt: skip
    spec.fds = {"stdout": 1, "stderr": 2, "channel": numbers[0]}
    spec.close_fds = []  # the server's worker holds only what it was sent
    if store:
        spec.store_fd = numbers[1]
    return popen


def take_fork_server() -> None:
    """nbaccel's first use in a kernel whose CUDA is untouched: the fork server is taken
    from the kernel prepared as for a fork (runtime imported, OpenMP pool released), so
    that workers still fork once the kernel has touched CUDA."""
    global _hook_installed
    if not _forkserver.wanted() or _forkserver.server_pid() is not None:
        return
    if not _hook_installed:  # the server must not keep the kernel's ends open
        os.register_at_fork(after_in_child=lambda: close_ends(_KERNEL_ENDS))
        _hook_installed = True
    if not cudafork.fork_state().broken:
        _preload()
    _forkserver.take()


def _spawn(spec: WorkerSpec, mine: dict[str, int]) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (env.get("PYTHONPATH", ""), _package_root()) if p
    )
    new_session, spec.new_session = spec.new_session, False  # Popen does the setsid
    channel = mine["channel"]
    store = (spec.store_fd,) if spec.store_fd is not None else ()
    code = f"from nbaccel.launch.worker._worker import spawn_main; spawn_main({channel})"
    popen = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        stdout=mine["stdout"],
        stderr=mine["stderr"],
        pass_fds=(channel, *store),
        env=env,
        start_new_session=new_session,
    )
    spec.fds = {"stdout": 1, "stderr": 2, "channel": channel}
    spec.close_fds = []
    return popen


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
    "WorkerProcess",
    "close_ends",
    "remember_worker_imports",
    "start_processes",
    "take_fork_server",
]
