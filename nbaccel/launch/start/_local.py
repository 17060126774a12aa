"""The local start backend: this machine's workers, forked, spawned or from the fork server.

Each worker gets two pipes for stdout/stderr and one end of a socket pair, its channel to
the supervisor; the kernel's ends go to the engine (``engine/_group``'s public names:
:func:`~..engine._group.keep_kernel_ends`, :func:`~..engine._group.send_setups`,
:func:`~..engine._group.end_started`) as one :class:`~..engine._group.WorkerProcess` each.
fork: ``os.fork()``, the child never returns into the kernel's code and inherits its first
job; spawn: ``python -c "...spawn_main(fd)"``, its spec, ``sys.path`` and the notebook's
cell sources the channel's first frame; fork server (CUDA touched in the kernel since it was
taken, :mod:`._forkserver`): forked by it, then as spawn. Before forking, the kernel imports
what each worker would repeat: nbaccel's runtime, and ``torch._dynamo`` once a worker needed
it (torch imports it lazily from every optimizer and DDP, ~0.8 s of CPU): learned, not
predicted (:func:`~..engine._group.worker_imports`), so a launch that never trains never
pays it; only on CPU-only torch builds, where the import cannot touch the driver.

Example:
    >>> os.path.isdir(os.path.join(package_root(), "nbaccel", "launch", "start"))
    True
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ...config.fields import field_kind
from ...errors import LaunchError
from ...platform import cudafork, forksafe
from ...platform.environment import package_root
from ..channel._messages import Job
from ..channel._wire import Channel
from ..engine._group import (
    WorkerProcess,
    close_ends,
    close_kernel_ends_in_children,
    end_started,
    keep_kernel_ends,
    send_setups,
    worker_imports,
)
from ..worker import _worker_os
from ..worker._worker import DYNAMO, WorkerSpec, fork_main
from . import _forkserver


def _preload() -> None:
    """Prepare the kernel so that forked workers inherit a warm, fork-safe runtime: the
    imports above, then the OpenMP pool released (a child would hang in its first
    multi-threaded op). No CUDA, no threads; a failure is left for the worker to report."""
    with contextlib.suppress(Exception):
        from ...runtime.facade import accelerator  # noqa: F401
    with contextlib.suppress(Exception):  # a cache every worker's Accelerator() reads
        field_kind("mixed_precision")
    torch = sys.modules.get("torch")
    learned = DYNAMO in worker_imports()  # what a worker needed, not a guess
    if torch is not None and learned and not torch.cuda._is_compiled():
        with contextlib.suppress(Exception):
            import torch._dynamo
    forksafe.release_openmp_threads()


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
    close_kernel_ends_in_children()  # channels reach their end exactly when the kernel is gone
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
            send_setups(procs, specs)
    except BaseException as err:
        end_started(procs)
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
    channel = Channel(kernel_sock)
    keep_kernel_ends(out_r, err_r, channel)
    kernel = {"stdout": out_r, "stderr": err_r, "channel": channel}
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
    if not _forkserver.wanted() or _forkserver.server_pid() is not None:
        return
    close_kernel_ends_in_children()  # the server must not keep the kernel's ends open
    if not cudafork.fork_state().broken:
        _preload()
    _forkserver.take()


def _spawn(spec: WorkerSpec, mine: dict[str, int]) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), package_root()) if p)
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


__all__ = ["start_processes", "take_fork_server"]
