"""Start one attempt of a launch: rendezvous, worker specs, processes, supervisor.

Kept apart from :mod:`nbaccel.launch.handle` (which owns the lifecycle and the status
model) so that each does one thing. Everything started here is either handed
to the returned :class:`~nbaccel.launch._supervise.Supervisor` or killed and reaped
before the exception propagates; the kernel keeps no listening socket.

Example:
    >>> from nbaccel.launch._attempt import rank_environment
    >>> rank_environment(1, 0, world_size=2, local_world_size=2, node_rank=0)["LOCAL_RANK"]
    '0'
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

from ._bootstrap import WorkerSpec
from ._output import LineForwarder
from ._preflight import LaunchPlan
from ._rendezvous import Rendezvous
from ._spawn import WorkerProcess, start_workers
from ._supervise import Supervisor


def rank_environment(
    rank: int, local_rank: int, *, world_size: int, local_world_size: int, node_rank: int
) -> dict[str, str]:
    """The torchrun-compatible rank variables of one worker."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
    }


def start_attempt(
    plan: LaunchPlan,
    ranks: list[int],
    want: set[int],
    streams: tuple[Any, Any],
    on_event: Callable[[int, str, dict], None],
    round_: int = 0,
) -> Supervisor:
    """Reserve the rendezvous, start one worker per rank, return their supervisor.

    ``round_`` is the restart attempt: multi-node agreement keys carry it, so that a
    restarted node never meets the previous attempt's keys (see ``_agreement``).
    """
    cfg = plan.config
    rdzv = Rendezvous.reserve(
        cfg.master_addr, cfg.master_port, num_nodes=cfg.num_nodes, node_rank=cfg.node_rank
    )
    try:
        if cfg.node_rank != 0:
            rdzv.check_reachable(cfg.timeout)  # before any worker exists
        specs = _specs(plan, ranks, want, rdzv, round_)
        listen_fd = rdzv.listen_fd()
        procs = start_workers(
            specs,
            plan.method,
            plan.function,
            plan.args,
            plan.payload,
            close_in_children=(listen_fd,) if listen_fd is not None else (),
        )
    finally:
        rdzv.close()  # rank 0 owns the listening socket now; the kernel keeps no copy
    try:
        return _supervisor(plan, ranks, want, streams, on_event, procs)
    except BaseException:  # e.g. an interrupt right now: no unsupervised worker may remain
        for proc in procs:
            proc.kill()
            for fd in proc.fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
        raise


def _specs(
    plan: LaunchPlan, ranks: list[int], want: set[int], rdzv: Rendezvous, round_: int = 0
) -> list[WorkerSpec]:
    cfg = plan.config
    # PR_SET_PDEATHSIG follows the *thread* that forks: only tie workers to the main one.
    on_main = threading.current_thread() is threading.main_thread()
    specs = []
    rendezvous_env = rdzv.worker_env()  # the same for every worker (resolves names, interfaces)
    for local_rank, rank in enumerate(ranks):
        env = {
            **plan.env,
            **rendezvous_env,
            **rank_environment(
                rank,
                local_rank,
                world_size=plan.world_size,
                local_world_size=len(ranks),
                node_rank=cfg.node_rank,
            ),
            # what the nodes compare before training (multi-node; see _agreement). Not
            # NBACCEL_<field> names: those are LaunchConfig settings for Accelerator()
            "NBACCEL_RDZV_NODES": str(cfg.num_nodes),
            "NBACCEL_RDZV_START": plan.method,
            "NBACCEL_RDZV_ROUND": str(round_),
        }
        spec = WorkerSpec(rank, local_rank, env, {}, rank in want, plan.threads, os.getpid())
        spec.new_session = not plan.block  # background runs ignore the kernel's interrupts
        spec.die_with_parent, spec.timeout = on_main, cfg.timeout
        specs.append(spec)
    listen_fd = rdzv.listen_fd()
    if listen_fd is not None:  # global rank 0 hosts the store on the reserved socket
        specs[0].store_fd, specs[0].store_port = listen_fd, rdzv.port
        specs[0].store_host = rdzv.store_host()
    return specs


def _supervisor(
    plan: LaunchPlan,
    ranks: list[int],
    want: set[int],
    streams: tuple[Any, Any],
    on_event: Callable[[int, str, dict], None],
    procs: list[WorkerProcess],
) -> Supervisor:
    cfg = plan.config
    callback = plan.output if callable(plan.output) else None
    info = {r: (lr, cfg.node_rank, plan.world_size) for lr, r in enumerate(ranks)}
    forwarder = LineForwarder(
        *streams, plan.template, callback=callback, rank_info=info, num_processes=len(procs)
    )
    return Supervisor(
        procs,
        forwarder,
        timeout=cfg.timeout,
        interval=plan.monitor_interval,
        want=want,
        on_event=on_event,
    )


__all__ = ["rank_environment", "start_attempt"]
