"""Start the workers of a pool and connect to each of them.

The workers are started as in :mod:`~nbaccel.launch._attempt` (same rendezvous,
rank environment, fork or spawn, pipes and supervisor); each then runs
:func:`nbaccel.launch._pool_worker.serve`, which connects back to a Unix socket
that only this kernel's user can open (a fresh ``0700`` directory) and proves
with a random token that it is one of ours. The pool sends jobs over these
connections; everything else travels as for ``notebook_launcher``.

Example:
    >>> from nbaccel.launch._pool_start import WORKER_TIMEOUT
    >>> WORKER_TIMEOUT > 0
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import LaunchError
from ._attempt import _specs
from ._failures import pick_failure, remote_exception
from ._output import LineForwarder
from ._pool_call import PoolSupervisor
from ._pool_worker import serve
from ._preflight import LaunchPlan
from ._rendezvous import Rendezvous
from ._spawn import start_workers as start_processes
from ._wire import HEADER

WORKER_TIMEOUT = 120.0  # seconds the workers get to start and connect (more if timeout= says)


@dataclass
class Workers:
    """A started pool: the supervisor and one job connection per rank."""

    supervisor: PoolSupervisor
    conns: dict[int, socket.socket]
    tmpdir: str

    def close_sockets(self) -> None:
        for conn in self.conns.values():
            with contextlib.suppress(OSError):
                conn.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def forwarder(plan: LaunchPlan, ranks: list[int], streams: tuple[Any, Any]) -> LineForwarder:
    """The output forwarder for one call (its own destination, the pool's prefixes)."""
    cfg = plan.config
    info = {r: (lr, cfg.node_rank, plan.world_size) for lr, r in enumerate(ranks)}
    callback = plan.output if callable(plan.output) else None
    return LineForwarder(
        *streams, plan.template, callback=callback, rank_info=info, num_processes=len(ranks)
    )


def boot(
    plan: LaunchPlan,
    ranks: list[int],
    streams: tuple[Any, Any],
    on_event: Callable[[int, str, dict], None],
    round_: int = 0,
) -> Workers:
    """Start one worker per rank and wait until all are connected (or raise).

    ``round_`` counts the pool's restarts: multi-node agreement keys carry it, so the
    workers of a restart never meet the previous workers' keys (see ``_agreement``).
    """
    tmpdir = tempfile.mkdtemp(prefix="nbaccel-pool-")  # mode 0700: only this user
    address = os.path.join(tmpdir, "jobs")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    token = os.urandom(16)
    try:
        listener.bind(address)
        listener.listen(len(ranks))
        args = (address, token)
        payload = None
        if plan.method == "spawn":
            import dill

            payload = bytes(dill.dumps((serve, args)))
        plan = dataclasses.replace(plan, function=serve, args=args, payload=payload)
        supervisor = _start(plan, ranks, streams, on_event, listener.fileno(), round_)
        try:
            conns = _accept(listener, token, supervisor, plan)
        except BaseException:
            supervisor.terminate()
            supervisor.close()
            raise
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    finally:
        listener.close()
    return Workers(supervisor, conns, tmpdir)


def _start(
    plan: LaunchPlan,
    ranks: list[int],
    streams: tuple[Any, Any],
    on_event: Callable[[int, str, dict], None],
    listener_fd: int,
    round_: int,
) -> PoolSupervisor:
    cfg = plan.config
    rdzv = Rendezvous.reserve(
        cfg.master_addr, cfg.master_port, num_nodes=cfg.num_nodes, node_rank=cfg.node_rank
    )
    try:
        if cfg.node_rank != 0:
            rdzv.check_reachable(cfg.timeout)  # before any worker exists
        specs = _specs(plan, ranks, set(), rdzv, round_)
        listen_fd = rdzv.listen_fd()
        close = (listener_fd,) + ((listen_fd,) if listen_fd is not None else ())
        procs = start_processes(
            specs, plan.method, plan.function, plan.args, plan.payload, close_in_children=close
        )
    finally:
        rdzv.close()  # rank 0 owns the store's socket now
    try:
        return PoolSupervisor(
            procs,
            forwarder(plan, ranks, streams),
            timeout=cfg.timeout,
            interval=plan.monitor_interval,
            want=set(),
            on_event=on_event,
        )
    except BaseException:
        for proc in procs:
            proc.kill()
        raise


def _accept(
    listener: socket.socket, token: bytes, supervisor: PoolSupervisor, plan: LaunchPlan
) -> dict[int, socket.socket]:
    """Take one connection per worker while watching for workers that die at start-up."""
    listener.settimeout(0.05)
    wanted = {p.rank for p in supervisor.procs}
    conns: dict[int, socket.socket] = {}
    seconds = max(WORKER_TIMEOUT, plan.config.timeout or 0.0)
    deadline = time.monotonic() + seconds
    try:
        while set(conns) != wanted:
            supervisor._pump(0.0)
            failures = supervisor._failures()
            if failures:
                raise remote_exception(pick_failure(failures))
            if time.monotonic() > deadline:
                missing = sorted(wanted - set(conns))
                raise LaunchError(
                    f"pool worker(s) {missing} did not start within {seconds:g}s; the machine "
                    "may be overloaded. Try again, or pass timeout=... to start_workers."
                )
            try:
                conn, _ = listener.accept()
            except (TimeoutError, BlockingIOError):
                continue
            conn.settimeout(5.0)
            try:
                hello = conn.recv(len(token) + HEADER.size, socket.MSG_WAITALL)
            except OSError:
                hello = b""
            if len(hello) != len(token) + HEADER.size or hello[: len(token)] != token:
                conn.close()  # not one of ours
                continue
            rank = HEADER.unpack(hello[len(token) :])[0]
            if rank not in wanted:
                conn.close()  # not one of ours
                continue
            conn.settimeout(None)
            conns[rank] = conn
    except BaseException:
        for conn in conns.values():
            conn.close()
        raise
    return conns


__all__ = ["WORKER_TIMEOUT", "Workers", "boot", "forwarder"]
