"""One worker's life: set up, join the rendezvous, run jobs until told to stop.

A worker is forked from the kernel (:func:`fork_main`) or spawned (:func:`spawn_main`, its
spec the channel's first frame). It sets up (output onto the supervisor's pipes, signals,
faulthandler, the typed :class:`~nbaccel.config.LaunchConfig` and rank facts as process
state, the events sink, a channel reader that answers probes at once and ends the worker
with the channel); meets the others (rank 0 hosts the store on the kernel's socket; across
nodes, the agreement check) and says "ready"; runs jobs from the table ``_jobs.JOBS``, each
answered by one ``Done`` (value or error, and its collective count); a one-shot worker
leaves after its job. Leaving: the exit barrier, the group torn down, ``os._exit``.

Example:
    >>> from nbaccel.config import LaunchConfig
    >>> WorkerSpec(0, 0, 1, 1, 0, LaunchConfig(), {}, "fork").persistent
    False
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import linecache
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from ...config import LaunchConfig, install_launch_config
from ...platform import forksafe, torchcompat, tpu
from ...platform.process_env import EnvironmentSnapshot, install_process_facts
from ...tracking import events, progress, steps  # progress (tqdm) here: workers inherit it imported
from ..channel import _jobs, _messages, _rendezvous
from ..channel._messages import (
    Debug,
    Done,
    Event,
    Exit,
    Fatal,
    Hello,
    Job,
    Probe,
    ProbeAnswer,
    Ready,
    Setup,
)
from ..channel._wire import Channel, dumps
from . import _postmortem
from . import _worker_os as wos


@dataclass
class WorkerSpec:
    """Everything one worker needs (the function travels as its first job)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    config: LaunchConfig
    env: dict[str, str]  # torch's rendezvous contract (RANK, MASTER_ADDR, ...) and threads
    method: str  # "fork", "spawn" or "forkserver": the nodes compare it
    round: int = 0  # restart round: multi-node agreement keys carry it
    threads: int | None = None
    persistent: bool = False  # a pool worker: wait for the next job
    new_session: bool = False
    die_with_parent: bool = True
    parent_pid: int = 0
    fds: dict[str, int] = field(default_factory=dict)  # "stdout", "stderr", "channel"
    close_fds: list[int] = field(default_factory=list)
    store_fd: int | None = None  # global rank 0: the rendezvous socket the kernel reserved
    store_host: str = ""
    linger: float | None = None  # a failed one-shot worker waits this long for nbaccel.debug()
    tpu: bool = False  # the TPU backend sets the process up before its runtime starts

    def facts(self) -> EnvironmentSnapshot:
        cfg = self.config
        return EnvironmentSnapshot(
            self.rank, self.world_size, self.local_rank, self.local_world_size, self.node_rank,
            self.env.get("MASTER_ADDR"), self.env.get("MASTER_PORT"),
            use_cpu=cfg.compute_device == "cpu", timeout=cfg.timeout, debug=cfg.debug,
        )  # fmt: skip


#: On a collective's timeout torch's NCCL watchdog ends the process (SIGABRT, no error in
#: the cell); aborting the communicators only lets the error reach the function and the cell.
#: The user's own setting wins; no effect on gloo or XLA.
NCCL_SETTINGS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}

#: a job that imports it after the fork says so once; the kernel imports it before later forks
DYNAMO = "torch._dynamo"

_inbox: queue.Queue[Any] = queue.Queue()
_busy = False  # SIGINT raises KeyboardInterrupt only while a job runs


def _on_sigint(signum: int, frame: Any) -> None:
    if _busy:
        raise KeyboardInterrupt


def _setup(spec: WorkerSpec, channel: Channel) -> None:
    if spec.new_session:
        os.setsid()
    for fd in spec.close_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    wos.reset_signals()
    signal.signal(signal.SIGINT, _on_sigint)
    if spec.die_with_parent:
        wos.die_with_parent(spec.parent_pid)
    wos.redirect_output(spec.fds["stdout"], spec.fds["stderr"])
    faulthandler.enable(file=sys.stderr, all_threads=True)  # fatal errors: stack on stderr
    os.environ.update(spec.env)  # torch's own env:// rendezvous reads these
    for name, value in NCCL_SETTINGS.items():
        os.environ.setdefault(name, value)
    torchcompat.reread_debug_level()  # debug_collectives: forked after torch read it
    install_launch_config(spec.config)  # the process's state: the runtime reads these two
    install_process_facts(spec.facts())
    if spec.tpu:  # this process's chips and the runtime's local process variables
        tpu.require_backend().setup_process(spec.local_rank, spec.local_world_size)
    events.install_sink(lambda kind, data: channel.send(Event(kind, data, time.time())))
    with contextlib.suppress(Exception):  # never fail a launch over a progress bar
        progress.use_text_bars_in_worker()  # tqdm.auto bars: text on rank 0, into the cell
    os.register_at_fork(after_in_child=functools.partial(_forget_channel, channel.fileno()))
    if (state := sys.modules.get("nbaccel.runtime.process.state")) is not None:
        state.reset_state()  # never the kernel's inherited process state
    threading.Thread(target=_read, args=(channel, spec.rank), daemon=True).start()


def _forget_channel(fd: int) -> None:
    """In the worker's own children (DataLoader workers): the channel is not theirs."""
    events.install_sink(None)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(OSError):
        os.close(fd)


def _read(channel: Channel, rank: int) -> None:
    """The channel's reader: questions answered here, jobs queued for the main thread."""
    while True:
        message = channel.next()
        if message is None:  # the supervisor is gone (killed, or closed the channel)
            wos.die(1)
        elif isinstance(message, Probe):
            report = wos.main_thread_report(rank)
            report["collectives"] = _jobs.collective_count()  # the hang watchdog's progress
            if message.flight:
                report["flight"] = _jobs.last_collective()
            channel.send(ProbeAnswer(message.request, report))
        else:
            _inbox.put(message)


def error_info(exc: BaseException, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """An exception as the kernel gets it: type, message, traceback, own attributes."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in skip):
        tb = tb.tb_next  # the traceback starts in the user's code
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        message = str(exc)
    except Exception:
        message = f"<unprintable {type(exc).__name__}>"
    attributes: dict[str, tuple[str, bytes]] = {}
    for name, value in getattr(exc, "__dict__", {}).items():
        with contextlib.suppress(Exception):
            attributes[name] = dumps(value)
    return {
        "type_module": type(exc).__module__,
        "type_qualname": type(exc).__qualname__,
        "message": message,
        "traceback": text,
        "time": time.time(),
        "attributes": attributes,
    }


def _run_job(worker: _jobs.Worker, channel: Channel, job: Job) -> int:
    """Run one job and send its ``done``; return the exit code a one-shot worker takes."""
    global _busy
    code = 0
    steps.reset()  # the live monitor's step clock starts afresh with each job
    _postmortem.forget()
    try:
        _busy = True
        try:
            value = _jobs.JOBS[job.kind](worker, *job.body)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
            value = None  # sys.exit(0) ends a function as returning does
        finally:
            _busy = False
        payload: Any = _jobs.ship(value, job.kind) if worker.rank in job.want else ("none", b"")
        ok = True
    except BaseException as exc:  # every failure is reported; a pool's loop goes on
        ok, payload = False, error_info(exc, skip=(__file__, _jobs.__file__))
        _postmortem.keep(exc, skip=(__file__, _jobs.__file__))  # for nbaccel.debug()
        if isinstance(exc, SystemExit) and isinstance(exc.code, int):
            code = payload["exit_code"] = exc.code
        else:
            code = 130 if isinstance(exc, KeyboardInterrupt) else 1
    for stream in (sys.stdout, sys.stderr):  # the job's output first, then its "done"
        with contextlib.suppress(Exception):
            stream.flush()
    wos.flush_c_stdio()
    events.flush()  # events are batched (tracking.events): the job's all arrive before it ends
    channel.send(Done(job.id, ok, payload, _jobs.collective_count()))
    return code


def serve(spec: WorkerSpec, channel: Channel, job: Job | None, forked: bool) -> int:
    """The worker's life after set-up; returns its exit code. Never raises."""
    channel.send(Hello(os.getpid()))
    worker = _jobs.Worker(spec.rank)
    learn = forked and DYNAMO not in sys.modules
    code, store, lingered = 0, None, False
    try:
        if spec.store_fd is not None:
            store = _rendezvous.host_store(
                spec.store_fd, spec.store_host, int(spec.env["MASTER_PORT"]), spec.config.timeout
            )
        elif spec.world_size > 1 and "MASTER_PORT" in spec.env:
            store = _rendezvous.connect_exit_client(
                spec.env["MASTER_ADDR"], int(spec.env["MASTER_PORT"]), spec.config.timeout
            )
        _rendezvous.agree(store, spec)  # several nodes: the same job everywhere, or an error
        if forked:  # torch 2.4: a multi-threaded op would hang (see the function)
            forksafe.keep_forked_worker_single_threaded()
        torch = sys.modules.get("torch")
        if spec.threads and torch is not None:
            with contextlib.suppress(Exception):
                torch.set_num_threads(spec.threads)
        channel.send(Ready())
        while True:
            message = job if job is not None else _inbox.get()
            job = None
            if isinstance(message, Exit):
                break
            if isinstance(message, Debug):  # nbaccel.debug(): pdb on the last failed job
                _postmortem.session(message.sid, channel, _inbox)
            if not isinstance(message, Job):  # nothing this loop acts on
                continue
            code = _run_job(worker, channel, message)
            if learn and DYNAMO in sys.modules:
                learn = False
                channel.send(_messages.Imported([DYNAMO]))
            if not spec.persistent:
                if code and spec.linger and _postmortem.kept() is not None:
                    _postmortem.linger(channel, _inbox, spec.linger)
                    lingered = True  # its peers are gone: no exit barrier to wait at
                break
    except BaseException as exc:  # set-up, rendezvous or agreement failed
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        with contextlib.suppress(Exception):
            channel.send(Fatal(error_info(exc, skip=(__file__,))))
    finally:
        if lingered:
            torchcompat.skip_teardown_at_exit()  # os._exit closes the group's sockets
        else:
            code = _leave(store, spec, forked, code)
    return code


def _leave(store: Any, spec: WorkerSpec, forked: bool, code: int) -> int:
    try:
        everyone_left = _rendezvous.leave(
            store, is_host=spec.store_fd is not None, world_size=spec.world_size
        )
        # Tearing a gloo group down costs ~20 ms per launch (its threads wind down in step
        # with the peers'). A forked worker ends in os._exit right after this, and once
        # every rank has passed the exit barrier no peer needs the group any more: exiting
        # closes its sockets just the same. Anything less sure tears down.
        if forked and everyone_left:
            torchcompat.skip_teardown_at_exit()  # nor when the exit handlers run
        else:
            torchcompat.destroy_process_group()
        del store  # stops rank 0's store server
    except BaseException:
        code = code or 1
    return code


def _finish(code: int) -> None:
    """Exit handlers the user's code registered here, flushed streams, then ``os._exit``
    with whatever this worker started (never the C++ teardown of an interpreter with
    torch threads: an abort, code 134)."""
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    wos.die(code)


def fork_main(spec: WorkerSpec, sock: socket.socket, job: Job | None) -> None:
    """Body of a forked worker. Never returns into the kernel's code."""
    code = 70
    try:
        atexit._clear()  # the kernel's exit handlers are not ours to run
        channel = Channel(sock)
        _setup(spec, channel)
        code = serve(spec, channel, job, forked=True)
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        _finish(code)


def spawn_main(fd: int, forked_by: int | None = None) -> None:
    """Entry point of a spawned worker (``python -c ...``): the spec is the first frame.
    ``forked_by``: the fork server's pid, for a worker it forked (it dies with that one)."""
    channel = Channel(socket.socket(fileno=fd))
    first = channel.next()
    if not isinstance(first, Setup):
        os._exit(70)  # the supervisor is gone already
    spec = first.spec
    if forked_by is not None:
        atexit._clear()  # the kernel's exit handlers, inherited through the server
        spec.parent_pid, spec.die_with_parent = forked_by, True
    sys.path[:] = first.sys_path
    linecache.cache.update(first.sources)  # notebook cells have no file on disk
    _setup(spec, channel)
    _finish(serve(spec, channel, None, forked=forked_by is not None))


__all__ = ["WorkerSpec", "error_info", "fork_main", "serve", "spawn_main"]
