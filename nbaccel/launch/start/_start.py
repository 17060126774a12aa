"""Start one group of workers for a plan: rendezvous, specs, processes, their supervisor.

A one-shot group (notebook_launcher, ``nbaccel launch``) gets its job as it starts, a pool's
workers wait for jobs. What is started is handed to the returned
:class:`~..engine._supervisor.Supervisor` or ended before the exception propagates.

Example:
    >>> from nbaccel.launch.start._start import rank_environment
    >>> rank_environment(1, 0, world_size=2, local_world_size=2, node_rank=0)["LOCAL_RANK"]
    '0'
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..cell._cell_output import CellOutput
from ..cell._output import LineForwarder
from ..channel._messages import Job
from ..channel._rendezvous import Rendezvous
from ..debug import _kept
from ..debug._watchdog import HangPolicy, HangWatch, SubsetCheck
from ..engine._group import WorkerProcess, end_started
from ..engine._supervisor import Hook, Supervisor
from ..worker._worker import WorkerSpec
from ._local import start_processes
from ._preflight import LaunchPlan


def rank_environment(
    rank: int, local_rank: int, *, world_size: int, local_world_size: int, node_rank: int
) -> dict[str, str]:
    """The torchrun-compatible rank variables of one worker (torch's env:// reads them)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
    }


def forwarder(plan: LaunchPlan, ranks: list[int], output: Any) -> LineForwarder:
    """Where the workers' lines go: ``output`` (None: the cell's streams, a file-like
    object, or a callable ``output(rank, stream, line)``; a
    :class:`~nbaccel.launch.cell._cell_output.CellOutput`: the launching cell, also for a
    background run), with the plan's prefixes."""
    if isinstance(output, CellOutput):  # progress bars redrawn in place, not line by line
        streams: tuple[Any, Any] = output.streams()
        output = None
    elif output is None:
        streams = (sys.stdout, sys.stderr)
    else:
        streams = (None, None) if callable(output) else (output, output)
    info = {r: (lr, plan.config.node_rank, plan.world_size) for lr, r in enumerate(ranks)}
    callback = output if callable(output) else None
    return LineForwarder(
        *streams,
        plan.start.log_line_prefix_template,
        callback=callback,
        rank_info=info,
        num_processes=len(ranks),
    )


def start_group(
    plan: LaunchPlan,
    *,
    on_event: Callable[[int, str, dict], None],
    round_: int = 0,
    persistent: bool = False,
    first_job: Job | None = None,
    output: Any = None,
    say: Callable[[str], None] | None = None,
    replace_wait: float | None = None,
) -> Supervisor:
    """Reserve the rendezvous, start one worker per local rank, return their supervisor.
    ``round_``: the restart attempt (agreement keys carry it); ``first_job`` reaches forked
    workers through the fork, spawned ones as their first message; ``say``: a line for the
    launching cell while starting; ``replace_wait``: a cluster restart after a failure waits
    that long for the cluster to hold the group again (else a request it cannot hold now is
    refused at once)."""
    _kept.sweep()  # kept ranks whose time is over go before new workers start
    cfg = plan.config
    ranks = plan.ranks
    hooks: list[Hook] = [SubsetCheck(), HangWatch(HangPolicy.of(cfg))]
    if cfg.cluster is not None:  # the cluster backend: every rank placed on a Ray node
        from .cluster._cluster import NodeWatch, start_cluster_group

        procs = start_cluster_group(
            plan,
            round_=round_,
            persistent=persistent,
            rank_env=rank_environment,
            say=say,
            replace_wait=replace_wait,
        )
        left = None if persistent else cfg.max_restarts - round_  # None: a pool's
        hooks.append(NodeWatch(cfg.max_restarts, left))  # a lost node is said as such
    else:
        procs = _start_here(plan, round_, persistent, first_job)
    if persistent or plan.debug_timeout is not None:  # a pool, debug=True: nbaccel.debug()
        hooks.append(_kept.KeepFailed())
    try:
        supervisor = Supervisor(
            procs,
            forwarder(plan, ranks, output),
            timeout=cfg.timeout,
            interval=plan.start.monitor_interval,
            on_event=on_event,
            one_shot=not persistent,
            hooks=hooks,
        )
        if plan.method != "fork" and first_job is not None:
            supervisor.send(ranks, first_job)
        return supervisor
    except BaseException:  # e.g. an interrupt right now: no unsupervised worker may remain
        end_started(procs)
        raise


def _start_here(
    plan: LaunchPlan, round_: int, persistent: bool, first_job: Job | None
) -> list[WorkerProcess]:
    """This machine's workers (fork or spawn), around the rendezvous the kernel reserves."""
    cfg = plan.config
    rdzv = None
    if plan.world_size > 1:
        rdzv = Rendezvous.reserve(
            cfg.master_addr, cfg.master_port, num_nodes=cfg.num_nodes, node_rank=cfg.node_rank
        )
    try:
        if rdzv is not None and cfg.node_rank != 0:
            rdzv.check_reachable(cfg.timeout)  # before any worker exists
        specs = _specs(plan, rdzv, round_, persistent)
        listen_fd = rdzv.listen_fd() if rdzv is not None else None
        fds = (listen_fd,) if listen_fd is not None else ()
        return start_processes(specs, plan.method, first_job, close_in_children=fds)
    finally:
        if rdzv is not None:
            rdzv.close()  # rank 0 owns the listening socket now; the kernel keeps no copy


def _one_rank_env(plan: LaunchPlan) -> dict[str, str]:
    """MASTER_ADDR/MASTER_PORT for a launch of one rank, as torchrun sets them: code that
    builds its own process group whenever LOCAL_RANK is set (transformers' Trainer through
    Accelerate's state, on CPU and GPU) then finds them (issue 32: it failed with
    "MASTER_ADDR expected, but not set"). nbaccel's runtime forms no group for one rank."""
    if (port := plan.config.master_port) is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _specs(
    plan: LaunchPlan, rdzv: Rendezvous | None, round_: int, persistent: bool
) -> list[WorkerSpec]:
    cfg = plan.config
    # PR_SET_PDEATHSIG follows the *thread* that forks: only tie workers to the main one
    # (the channel's end of file ends the others when the kernel's process is gone).
    on_main = threading.current_thread() is threading.main_thread()
    shared = {**plan.env, **(rdzv.worker_env() if rdzv is not None else _one_rank_env(plan))}
    specs = []
    local, world = len(plan.ranks), plan.world_size
    for local_rank, rank in enumerate(plan.ranks):
        env = shared | rank_environment(
            rank, local_rank, world_size=world, local_world_size=local, node_rank=cfg.node_rank
        )
        specs.append(WorkerSpec(
            rank, local_rank, world, local, cfg.node_rank, cfg, env, plan.method, round_,
            plan.threads, persistent,
            new_session=not plan.call.block,  # background runs and pools ignore the kernel's ^C
            die_with_parent=on_main,
            parent_pid=os.getpid(),
            linger=plan.debug_timeout,  # debug=True: a failed rank waits for nbaccel.debug()
            tpu=plan.tpu,
        ))  # fmt: skip
    if rdzv is not None and (fd := rdzv.listen_fd()) is not None:  # rank 0 hosts the store
        specs[0].store_fd, specs[0].store_host = fd, rdzv.store_host()
    return specs


__all__ = ["forwarder", "rank_environment", "start_group"]
