"""Start worker processes: fork the kernel, or spawn fresh interpreters.

Each worker gets four pipes whose write ends become its stdout, stderr,
control channel (frames, see :mod:`nbaccel.launch._wire`) and faulthandler stack
channel; the kernel keeps the non-blocking read ends.

* fork: ``os.fork()`` directly, so the child closes every pipe end that is not
  its own (otherwise a sibling holding a write end would hide end-of-file) and
  never returns into the kernel's code (:func:`nbaccel.launch._bootstrap.fork_main`).
  Before forking, the kernel does once what every worker would otherwise repeat
  (:mod:`nbaccel.launch._preload`, :func:`nbaccel.launch._worker_os.before_fork`).
* spawn: ``python -c "...spawn_main()"`` with the pipes as fds 1/2 plus
  ``pass_fds``; the job (spec, ``sys.path``, notebook cell sources for
  tracebacks) and the dill payload (function and args, pickled with
  ``recurse=True`` so globals, lambdas and classes of earlier cells come along)
  are written to the child's stdin.

Example:
    >>> from nbaccel.launch._spawn import WorkerProcess
    >>> WorkerProcess.__name__
    'WorkerProcess'
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import LaunchError
from ..platform import environment, forksafe
from ._bootstrap import WorkerSpec, fork_main
from ._preload import preload
from ._wire import HEADER
from ._worker_os import after_fork_in_kernel, before_fork

STREAMS = ("stdout", "stderr", "ctrl", "stack")


@dataclass
class WorkerProcess:
    """Kernel-side view of one worker: pid, read ends, exit status."""

    rank: int
    local_rank: int
    pid: int
    fds: dict[str, int]
    popen: subprocess.Popen[bytes] | None = None
    returncode: int | None = None
    exit_time: float | None = None
    killed_by_us: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
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

    def wait(self, timeout: float) -> int | None:
        """Poll until exited or ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.returncode

    def reap(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for the exit; if it has not come, a daemon thread
        waits for it, so the kernel never keeps a zombie of a worker it let go."""
        code = self.wait(timeout)
        if code is None:
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


def _pipes(count: int) -> list[dict[str, tuple[int, int]]]:
    out = []
    for _ in range(count):
        out.append({name: os.pipe() for name in STREAMS})
    return out


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def start_workers(
    specs: list[WorkerSpec],
    method: str,
    function: Any,
    args: tuple[Any, ...],
    payload: bytes | None = None,
    *,
    close_in_children: tuple[int, ...] = (),
) -> list[WorkerProcess]:
    """Start one worker per spec (``spec.fds`` is filled in here). Cleans up on failure."""
    if method == "fork":
        preload(function, args)
        for stream in (sys.stdout, sys.stderr):  # nothing buffered may be written twice
            with contextlib.suppress(Exception):
                stream.flush()  # once for all workers: in a notebook, a round trip (~1 ms)
    pipes = _pipes(len(specs))
    every_fd = [fd for p in pipes for pair in p.values() for fd in pair]
    procs: list[WorkerProcess] = []
    if method == "fork":
        forksafe.warn_if_fork_unsafe()  # a warning in the cell unless the fork is checked safe
        before_fork()
    try:
        for spec, pipe in zip(specs, pipes, strict=True):
            spec.fds = {name: w for name, (_, w) in pipe.items()}
            reads = {name: r for name, (r, _) in pipe.items()}
            if method == "fork":
                own = set(spec.fds.values())
                spec.close_fds = [fd for fd in every_fd if fd not in own]
                spec.close_fds += [fd for fd in close_in_children if fd != spec.store_fd]
                with _interrupts_deferred():  # an interrupt now must not lose the pid
                    pid = _fork(spec, function, args)
                    procs.append(WorkerProcess(spec.rank, spec.local_rank, pid, reads))
            else:
                with _interrupts_deferred():
                    popen = _spawn(spec)
                    procs.append(WorkerProcess(spec.rank, spec.local_rank, popen.pid, reads, popen))
        if method != "fork":
            assert payload is not None
            for spec, proc in zip(specs, procs, strict=True):
                _send_job(proc, spec, payload)
    except BaseException as err:
        for proc in procs:
            proc.kill()
        _close_all(every_fd)
        if isinstance(err, OSError):
            raise LaunchError(f"could not start the worker processes: {err}") from err
        raise
    finally:
        # the kernel keeps only the read ends
        _close_all([w for p in pipes for (_, w) in p.values()])
        after_fork_in_kernel()
    for proc in procs:
        for fd in proc.fds.values():
            os.set_blocking(fd, False)
    return procs


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold a notebook interrupt (SIGINT) back until the block ends.

    An interrupt that lands while ``os.fork()`` runs raises KeyboardInterrupt as soon as
    the call returns, before its pid is stored anywhere: that worker would live on,
    unsupervised. Inside the block SIGINT is only recorded; after it, the kernel's own
    handler gets the signal, where the cleanup in :func:`start_workers` knows every worker.
    (Blocking the signal with ``pthread_sigmask`` would not do: the OS then hands it to
    another of the kernel's threads, and Python still raises in this one.)
    """
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


def _fork(spec: WorkerSpec, function: Any, args: tuple[Any, ...]) -> int:
    with forksafe.forking():  # Python >= 3.12's generic warning; check_fork decided instead
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, which always os._exit()s
        fork_main(spec, function, args)
    return pid


def _package_root() -> str:
    """The folder that holds the ``nbaccel`` package (not the package itself: on the path,
    that one would shadow the standard library with ``nbaccel/logging.py``)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.dirname(package)


def _spawn(spec: WorkerSpec) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(spec.env)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (env.get("PYTHONPATH", ""), _package_root()) if p
    )
    new_session, spec.new_session = spec.new_session, False  # Popen does the setsid
    keep = (spec.fds["ctrl"], spec.fds["stack"])
    store = (spec.store_fd,) if spec.store_fd is not None else ()
    popen = subprocess.Popen(
        [sys.executable, "-c", "from nbaccel.launch._bootstrap import spawn_main; spawn_main()"],
        stdin=subprocess.PIPE,
        stdout=spec.fds["stdout"],
        stderr=spec.fds["stderr"],
        pass_fds=keep + store,
        env=env,
        start_new_session=new_session,
    )
    spec.fds = {"stdout": 1, "stderr": 2, "ctrl": keep[0], "stack": keep[1]}
    return popen


def _notebook_sources() -> dict[str, Any]:
    """linecache entries without a file on disk (notebook cells), for remote tracebacks."""
    return environment.notebook_cell_sources()  # IPython 7's cells (Colab) and 8's


def _send_job(proc: WorkerProcess, spec: WorkerSpec, payload: bytes) -> None:
    job = pickle.dumps({"spec": spec, "sys_path": list(sys.path), "linecache": _notebook_sources()})
    assert proc.popen is not None and proc.popen.stdin is not None
    try:
        proc.popen.stdin.write(HEADER.pack(len(job)) + job + HEADER.pack(len(payload)) + payload)
        proc.popen.stdin.close()
    except BrokenPipeError:  # the child died at start-up; the supervisor reports its exit
        with contextlib.suppress(OSError):
            proc.popen.stdin.close()


__all__ = ["WorkerProcess", "start_workers"]
