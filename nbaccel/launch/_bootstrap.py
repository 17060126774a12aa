"""What one worker does before and after the user's function.

The launcher starts each worker either by forking the kernel (:func:`fork_main`)
or as a fresh interpreter (:func:`spawn_main`, which reads its job from stdin).
Both end in :func:`_run`: redirect fds 1/2 to the launcher's pipes, restore
default signal handlers, arm faulthandler (stack dumps on ``SIGUSR1`` and on
fatal signals), drop any process state inherited from the kernel, size the
compute thread pool, call the function, and send the outcome back over the
control pipe as length-prefixed pickle frames. Tensors are moved to the CPU
and pickled as plain bytes (never torch's shared-memory reducers, whose
segments would die with the worker).

:func:`_setup` installs the sink of :mod:`nbaccel.tracking.events`, so what the
runtime publishes (``Accelerator.log``, progress bars) reaches ``LaunchHandle.status()``
in the kernel.

Example:
    >>> from nbaccel.tracking.events import publish
    >>> publish("log", step=3, values={"loss": 0.5})  # no-op outside a worker
"""

from __future__ import annotations

import contextlib
import faulthandler  # here, not in _setup: forked workers inherit it imported
import linecache
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from ..platform import forksafe, torchcompat
from ..tracking import events, progress  # progress (tqdm) here: workers inherit it imported
from . import _agreement, _rendezvous
from ._preload import IMPORTED_EVENT, worker_report_modules
from ._wire import HEADER, Channel, dumps
from ._worker_os import die_with_parent, flush_c_stdio, redirect_output, reset_signals

# Asks a worker for its Python stacks (faulthandler). POSIX only: Windows has no SIGUSR1,
# and nbaccel's launcher refuses Windows before starting anything (see _preflight).
STACK_SIGNAL: signal.Signals | None = getattr(signal, "SIGUSR1", None)


@dataclass
class WorkerSpec:
    """Everything one worker needs, minus the function (shipped separately for spawn)."""

    rank: int
    local_rank: int
    env: dict[str, str]
    fds: dict[str, int]  # write ends: "stdout", "stderr", "ctrl", "stack"
    send_value: bool
    threads: int | None
    parent_pid: int
    new_session: bool = False
    die_with_parent: bool = True
    close_fds: list[int] = field(default_factory=list)
    # global rank 0 only: the rendezvous socket reserved by the kernel (see _rendezvous)
    store_fd: int | None = None
    store_host: str = ""
    store_port: int = 0
    timeout: float | None = None


_channel: Channel | None = None


def _send_event(kind: str, data: dict[str, Any]) -> None:
    """The events sink of a launched worker: one frame on the control pipe."""
    channel = _channel
    if channel is not None:
        channel.send(("event", channel.rank, kind, data, time.time()))


def _error_info(exc: BaseException) -> dict[str, Any]:
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is _run.__code__:
        tb = tb.tb_next  # hide the bootstrap frame: the traceback starts in the user's code
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        message = str(exc)
    except Exception:
        message = f"<unprintable {type(exc).__name__}>"
    attributes: dict[str, tuple[str, bytes]] = {}  # the exception's own attributes
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


# ------------------------------------------------------------------ process set-up
def _forget_channel() -> None:
    """In grandchildren (e.g. forked DataLoader workers): the control pipe is not theirs."""
    global _channel
    if _channel is not None:
        with contextlib.suppress(OSError):
            os.close(_channel.fd)
        _channel = None
        events.install_sink(None)


def _set_threads(threads: int | None) -> None:
    torch = sys.modules.get("torch")
    if threads and torch is not None:
        with contextlib.suppress(Exception):
            torch.set_num_threads(threads)


def _drop_inherited_state() -> None:
    state = sys.modules.get("nbaccel.runtime.state")
    if state is not None:
        state.reset_state()


def _setup(spec: WorkerSpec) -> None:
    global _channel
    if spec.new_session:
        os.setsid()
    if spec.die_with_parent:
        die_with_parent(spec.parent_pid)
    for fd in spec.close_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    reset_signals()
    redirect_output(spec.fds["stdout"], spec.fds["stderr"])
    stack_file = open(spec.fds["stack"], "w", closefd=False)  # noqa: SIM115
    faulthandler.enable(file=stack_file, all_threads=True)
    if STACK_SIGNAL is not None:
        faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True, chain=False)
    sys.modules[__name__].__dict__["_stack_file"] = stack_file  # keep it alive
    os.environ.update(spec.env)
    _channel = Channel(spec.fds["ctrl"], spec.rank)
    events.install_sink(_send_event)  # Accelerator.log and progress bars publish through it
    _route_progress_bars()
    os.register_at_fork(after_in_child=_forget_channel)
    _drop_inherited_state()


def _route_progress_bars() -> None:
    """A plain ``tqdm.auto`` bar in the user's function: rank 0 draws it as text (forwarded
    to the cell live); as a widget, ipykernel would drop it ("send message from fork")."""
    with contextlib.suppress(Exception):  # never fail a launch over a progress bar
        progress.use_text_bars_in_worker()


def _ship(value: Any) -> tuple[str, bytes]:
    try:
        return dumps(value)
    except Exception as err:
        raise TypeError(
            f"the function's return value (a {type(value).__name__}) cannot be sent back to "
            f"the kernel: {type(err).__name__}: {err}. Return plain data instead: numbers, "
            "tensors, lists/dicts of them, or model.state_dict()."
        ) from err


def _report_imports(channel: Channel, rank: int, missing: list[str]) -> None:
    """Tell the kernel which of the modules it did not pre-import this worker needed."""
    imported = [name for name in missing if name in sys.modules]
    if imported:
        channel.send(("event", rank, IMPORTED_EVENT, {"modules": imported}, time.time()))


def _run(spec: WorkerSpec, function: Any, args: tuple[Any, ...], *, forked: bool = False) -> int:
    """Run the function; report the outcome; return the exit code. Never raises."""
    channel = _channel
    assert channel is not None
    channel.send(("hello", spec.rank, os.getpid(), time.time()))
    # forked: modules the kernel did not pre-import (see nbaccel.launch._preload)
    missing = [m for m in worker_report_modules() if m not in sys.modules] if forked else []
    code = 0
    store = None
    world_size = int(spec.env.get("WORLD_SIZE", "1"))
    try:
        if spec.store_fd is not None:
            store = _rendezvous.host_store(
                spec.store_fd, spec.store_host, spec.store_port, spec.timeout
            )
        elif world_size > 1 and "MASTER_PORT" in spec.env:
            store = _rendezvous.connect_exit_client(
                spec.env["MASTER_ADDR"], int(spec.env["MASTER_PORT"]), spec.timeout
            )
        # multi-node: the nodes agree on world size, versions and start method first
        _agreement.agree(store, spec.env, spec.timeout)
        if forked:  # torch 2.4: a multi-threaded op would hang (see the function)
            forksafe.keep_forked_worker_single_threaded()
        _set_threads(spec.threads)
        try:
            value = function(*args)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
            value = None
        codec, data = _ship(value) if spec.send_value else ("none", b"")
        if missing:
            _report_imports(channel, spec.rank, missing)
        channel.send(("result", spec.rank, codec, data, time.time()))
    except BaseException as exc:  # ship every failure, KeyboardInterrupt included
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        try:
            channel.send(("error", spec.rank, _error_info(exc)))
        except Exception:
            traceback.print_exc()
    finally:
        everyone_left = _rendezvous.leave(
            store, is_host=spec.store_fd is not None, world_size=world_size
        )
        # Tearing a gloo group down costs ~20 ms per launch (its threads wind down in
        # step with the peers'). A forked worker ends in os._exit right after this, and
        # once every rank has passed the exit barrier no peer needs the group any more:
        # exiting closes its sockets just the same. Anything less sure tears down.
        if forked and everyone_left:
            torchcompat.skip_teardown_at_exit()  # nor when the exit handlers run
        else:
            torchcompat.destroy_process_group()
            del store  # stops rank 0's store server
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    return code


def fork_main(spec: WorkerSpec, function: Any, args: tuple[Any, ...]) -> None:
    """Body of a forked worker. Never returns into the kernel's code."""
    code = 70
    try:
        import atexit

        atexit._clear()  # the kernel's exit handlers are not ours to run
        _setup(spec)
        code = _run(spec, function, args, forked=True)
        atexit._run_exitfuncs()  # handlers the user's code registered in this worker
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        flush_c_stdio()
        os._exit(code)


def _read_exact(fd: int, size: int) -> bytes:
    chunks, remaining = [], size
    while remaining:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            raise EOFError("the launcher closed the job pipe early")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def spawn_main() -> None:
    """Entry point of a spawned worker: ``python -c "...spawn_main()"``, job on stdin."""
    job = pickle.loads(_read_exact(0, HEADER.unpack(_read_exact(0, HEADER.size))[0]))
    payload = _read_exact(0, HEADER.unpack(_read_exact(0, HEADER.size))[0])
    spec: WorkerSpec = job["spec"]
    sys.path[:] = job["sys_path"]
    linecache.cache.update(job["linecache"])  # notebook cells have no file on disk
    _setup(spec)
    try:
        import dill

        function, args = dill.loads(payload)
    except BaseException as exc:
        assert _channel is not None
        _channel.send(("hello", spec.rank, os.getpid(), time.time()))
        info = _error_info(exc)
        info["message"] = f"could not load the function in the spawned worker: {info['message']}"
        _channel.send(("error", spec.rank, info))
        sys.stdout.flush()
        os._exit(1)
    code = _run(spec, function, args)
    sys.exit(code)


__all__ = ["STACK_SIGNAL", "WorkerSpec", "fork_main", "spawn_main"]
