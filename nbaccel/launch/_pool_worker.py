"""The worker side of a warm pool: a loop that runs jobs sent by the kernel.

A pool worker is started exactly like a ``notebook_launcher`` worker (fork, or
spawn with dill; :mod:`~nbaccel.launch._bootstrap` sets up output, signals,
faulthandler, the events sink and rank 0's rendezvous store); the "function" it
runs is :func:`serve`, which only returns when the pool closes. It connects back
to the kernel over a private Unix socket and executes one job at a time:

* ``run``: ``fn(*args, **kwargs)`` shipped with dill (so functions edited in the
  notebook after the pool started are the new ones);
* ``exec``: the source of a ``%%distributed`` cell, in the worker's namespace; the
  value of a final expression is sent back;
* ``push`` / ``pull``: set names in, read a name from, that namespace.

Every job ends with one ``pool_done`` frame on the control pipe (the value, or the
error with its remote traceback) and the process group's collective sequence
number, which lets the kernel see that ranks fell out of step. SIGINT (the kernel
forwards the interrupt button) raises ``KeyboardInterrupt`` in a running job and is
ignored between jobs. The process group, the ``Accelerator`` state and the
namespace live as long as the worker.

Nothing is left behind: SIGTERM, or the kernel disappearing (parent-death signal,
and a watchdog thread for a main thread blocked in C++), kills the worker's own
children (e.g. DataLoader workers) before it exits.

Example:
    >>> from nbaccel.launch._pool_worker import RemoteRepr
    >>> RemoteRepr("Linear(in_features=4)")
    Linear(in_features=4)
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import linecache
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from . import _bootstrap
from ._wire import HEADER, dumps
from ._worker_os import flush_c_stdio

_busy = False  # SIGINT raises KeyboardInterrupt only while a job runs


class RemoteRepr:
    """Stands in for a value that cannot travel to the kernel: shows the worker's repr."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _on_sigint(signum: int, frame: Any) -> None:
    if _busy:
        raise KeyboardInterrupt


def _die(code: int = 1) -> None:
    """Kill this worker's own children (DataLoader workers, subprocesses), then exit."""
    with contextlib.suppress(Exception):
        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(Exception):
                child.kill()
    flush_c_stdio()
    os._exit(code)


def _arm_death_watch(parent: int) -> None:
    """Die, children included, on SIGTERM or when the kernel is gone.

    The bootstrap's parent-death signal is SIGKILL, which would orphan our own
    children; here it becomes SIGTERM, whose handler cleans up. A thread watches
    the parent too: the handler cannot run while the main thread blocks in a C++
    collective.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            libc = ctypes.CDLL(None)
            current = ctypes.c_int(0)
            libc.prctl(2, ctypes.byref(current), 0, 0, 0)  # PR_GET_PDEATHSIG
            if current.value:  # only where the bootstrap tied us to the kernel's thread
                libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    signal.signal(signal.SIGTERM, lambda *_: _die(143))
    if os.getppid() != parent:
        _die()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        _die()

    threading.Thread(target=watch, name="nbaccel-pool-watchdog", daemon=True).start()


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    chunks, remaining = [], size
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _receive(sock: socket.socket) -> Any:
    """The next job (None: the kernel closed the socket)."""
    import pickle

    while True:
        try:
            head = _recv_exact(sock, HEADER.size)
            if head is None:
                return None
            body = _recv_exact(sock, HEADER.unpack(head)[0])
            return None if body is None else pickle.loads(body)
        except KeyboardInterrupt:  # a late interrupt between jobs: ignore it
            continue


def _sequence_number() -> int | None:
    """How many collectives the default group has run (None: no group)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_initialized():
            return None
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:
        return None


def _trimmed(exc: BaseException) -> BaseException:
    """The traceback starts in the user's code, not in this module."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return exc.with_traceback(tb)


class Worker:
    """One pool worker's state: its rank, namespace, and the kernel's socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rank = int(os.environ.get("RANK", "0"))
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}

    def handle(self, job: tuple[Any, ...]) -> None:
        kind, call_id, send = job[0], job[1], job[2]
        linecache.cache.update(job[3])  # notebook cells, for remote tracebacks
        ok, payload = self._execute(kind, job[4:])
        if ok and self.rank in send:
            payload = _ship(payload, repr_fallback=kind == "exec")
        elif ok:
            payload = ("none", b"")
        for stream in (sys.stdout, sys.stderr):  # output first, then the "done" frame
            with contextlib.suppress(Exception):
                stream.flush()
        flush_c_stdio()
        channel = _bootstrap._channel
        assert channel is not None
        channel.send(("pool_done", self.rank, call_id, ok, payload, _sequence_number()))

    def _execute(self, kind: str, body: tuple[Any, ...]) -> tuple[bool, Any]:
        global _busy
        try:
            _busy = True
            try:
                value = getattr(self, f"_job_{kind}")(*body)
            finally:
                _busy = False
            return True, value
        except BaseException as exc:  # every failure is reported; the loop goes on
            _busy = False
            return False, _bootstrap._error_info(_trimmed(exc))

    def _job_run(self, payload: bytes) -> Any:
        import dill

        function, args, kwargs = dill.loads(payload)
        return function(*args, **kwargs)

    def _job_exec(self, source: str, filename: str) -> Any:
        lines = source.splitlines(keepends=True)
        linecache.cache[filename] = (len(source), None, lines, filename)
        tree = ast.parse(source, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            final = tree.body.pop()
            assert isinstance(final, ast.Expr)
            last = ast.Expression(final.value)  # shown like a notebook's Out[]
        code = compile(tree, filename, "exec")
        if "accelerator" not in self.namespace and _mentions(code, "accelerator"):
            from ..runtime.accelerator import Accelerator

            self.namespace["accelerator"] = Accelerator()  # the cell's ready-made handle
        exec(code, self.namespace)
        if last is None:
            return None
        return eval(compile(last, filename, "eval"), self.namespace)

    def _job_push(self, payload: bytes) -> None:
        import dill

        self.namespace.update(dill.loads(payload))

    def _job_pull(self, name: str) -> Any:
        if name not in self.namespace:
            raise NameError(
                f"name {name!r} is not defined on rank {self.rank}: set it first with "
                f"pool.push({name}=...) or in a %%distributed cell (pool.names() lists them)."
            )
        return self.namespace[name]

    def _job_names(self) -> list[str]:
        return sorted(k for k in self.namespace if not k.startswith("__"))


def _mentions(code: Any, name: str) -> bool:
    if name in code.co_names:
        return True
    return any(_mentions(c, name) for c in code.co_consts if hasattr(c, "co_names"))


CELL_VALUE_LIMIT = 8 << 20  # a bigger cell result is shown by its repr (pull it if needed)


def _ship(value: Any, *, repr_fallback: bool) -> tuple[str, bytes]:
    try:
        shipped = dumps(value)
        if repr_fallback and len(shipped[1]) > CELL_VALUE_LIMIT:
            return dumps(RemoteRepr(repr(value)))
        return shipped
    except Exception as err:
        if repr_fallback:
            return dumps(RemoteRepr(repr(value)))
        raise TypeError(
            f"the return value (a {type(value).__name__}) cannot be sent to the kernel: "
            f"{type(err).__name__}: {err}. Return plain data (numbers, tensors, lists/dicts "
            "of them, model.state_dict()), or keep it on the workers and pull what you need."
        ) from err


def serve(address: str, token: bytes) -> None:
    """A pool worker's life: connect to the kernel, run jobs until told to stop."""
    _arm_death_watch(os.getppid())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    rank = int(os.environ.get("RANK", "0"))
    sock.sendall(token + HEADER.pack(rank))
    # grandchildren (forked DataLoader workers) must not hold the kernel's socket
    os.register_at_fork(after_in_child=sock.close)
    signal.signal(signal.SIGINT, _on_sigint)
    worker = Worker(sock)
    while True:
        job = _receive(sock)
        if job is None or job[0] == "exit":
            return
        try:
            worker.handle(job)
        except KeyboardInterrupt:  # an interrupt that arrived after the job ended
            continue


__all__ = ["RemoteRepr", "Worker", "serve"]
