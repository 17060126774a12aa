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
import linecache
import os
import pickle
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..errors import LaunchError
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

    def poll(self) -> int | None:
        """Reap without blocking; negative return codes are signals (as in subprocess)."""
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
        before_fork()
    try:
        for spec, pipe in zip(specs, pipes, strict=True):
            spec.fds = {name: w for name, (_, w) in pipe.items()}
            reads = {name: r for name, (r, _) in pipe.items()}
            if method == "fork":
                own = set(spec.fds.values())
                spec.close_fds = [fd for fd in every_fd if fd not in own]
                spec.close_fds += [fd for fd in close_in_children if fd != spec.store_fd]
                pid = _fork(spec, function, args)
                procs.append(WorkerProcess(spec.rank, spec.local_rank, pid, reads))
            else:
                popen = _spawn(spec)
                procs.append(WorkerProcess(spec.rank, spec.local_rank, popen.pid, reads, popen))
        if method != "fork":
            assert payload is not None
            for spec, proc in zip(specs, procs, strict=True):
                _send_job(proc, spec, payload)
    except BaseException as err:
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait(5)
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


def _fork(spec: WorkerSpec, function: Any, args: tuple[Any, ...]) -> int:
    with warnings.catch_warnings():
        # Python >= 3.12 warns about fork() in a multi-threaded process (every kernel is
        # one); the child only runs nbaccel's bootstrap and the user's function.
        warnings.simplefilter("ignore", DeprecationWarning)
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
    return {
        name: entry
        for name, entry in list(linecache.cache.items())
        if len(entry) == 4 and entry[1] is None
    }


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
