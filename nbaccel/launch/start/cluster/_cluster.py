"""The cluster start backend: ranks placed on a Ray cluster's nodes, supervised from here.

One more way to start a group, beside fork, spawn and the TPU backend; what it returns is
the same :class:`~...engine._supervisor.Supervisor` over the same channel messages and the same
worker loop. Steps: reach the cluster and reserve its nodes (:mod:`._cluster_place`), one
:class:`~._cluster_host.RankHost` actor per rank (ranks of a node in that node's bundle),
rank 0's actor reserving torch's rendezvous socket on its node (``MASTER_ADDR`` is its
node's address); a per-launch secret and a listener on the address the nodes reach this
kernel by; each actor connects its rank's channel and output streams, authenticated and
version-checked (:mod:`...channel._cluster_wire`), and starts the worker; the kernel sends each its
:class:`~...channel._messages.Setup`. A rank whose node cannot open a connection to this
kernel (NAT, a firewall, Ray Client) starts its worker all the same, its streams relayed
through its actor instead (:mod:`...channel._ray_relay`), said once in the cell: the rest
sees the same sockets. A :class:`RemoteWorker` stands for a rank's process: its exit
status comes from the actor, its signals go through it, and the last one closed ends the
actors and removes the placement group, so nothing stays on the cluster.

Example:
    >>> node_of(rank=3, per_node=2)
    (1, 1)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from ....errors import LaunchError
from ....platform import environment
from ...channel import _cluster_wire, _ray_relay
from ...channel._messages import Done
from ...channel._wire import Channel
from ...engine._group import WorkerProcess, keep_kernel_ends, send_setups
from ...engine._supervisor import Hook, JobFailed, Supervisor
from ...engine._tidy import Failure
from ...worker._worker import WorkerSpec
from .._preflight import LaunchPlan
from . import _cluster_nodes, _cluster_place

#: where the nodes reach this kernel (default: the address Ray knows this machine by)
HOST_VAR = "NBACCEL_CLUSTER_HOST"
_STREAMS = _ray_relay.STREAMS
RankEnv = Callable[..., dict[str, str]]


def node_of(*, rank: int, per_node: int) -> tuple[int, int]:
    """(node index, local rank) of a global rank: ranks of a node are consecutive."""
    return rank // per_node, rank % per_node


class Placement:
    """The launch's actors and placement group, released when the last rank is closed."""

    def __init__(self, ray: Any, group: Any) -> None:
        self.ray, self.group = ray, group
        self.actors: list[Any] = []
        self.nodes: dict[int, str] = {}  # rank -> "node <ip> (<id>)"
        self._open = 0

    def opened(self) -> None:
        self._open += 1

    def closed(self) -> None:
        self._open -= 1
        if self._open <= 0:
            self.release()

    def release(self) -> None:
        actors, self.actors = self.actors, []
        group, self.group = self.group, None
        if actors or group is not None:
            _cluster_place.release(self.ray, actors, group)


class RemoteWorker(WorkerProcess):
    """A rank's worker on a cluster node, as the supervisor sees every worker."""

    placement: Placement
    actor: Any = None
    waiting: Any = None  # the actor's wait() call: its exit status, or the actor's loss
    lost: str | None = None
    relay: _ray_relay.KernelRelay | None = None  # its streams, when its node cannot reach us

    def poll(self) -> int | None:
        if self.returncode is not None or self.waiting is None:
            return self.returncode
        ray = self.placement.ray
        ready, _ = ray.wait([self.waiting], timeout=0)
        if not ready:
            return None
        try:
            code = int(ray.get(ready[0]))
        except Exception as err:  # the actor or its node is gone: the worker with it
            self.lost = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
            code = -int(signal.SIGKILL)
        self.returncode, self.exit_time = code, time.time()
        return code

    def alive(self) -> bool:
        return self.poll() is None

    def channel_closed(self) -> bool:
        """The kernel's end of the channel saw the end of the stream (or is closed)."""
        if self.channel is None:
            return True
        try:
            return self.channel.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self.actor is not None:
            with contextlib.suppress(Exception):
                self.actor.signal.remote(int(sig))

    def reap(self, timeout: float) -> int | None:
        return self.wait(timeout)  # the actor reaps its own child

    def descendants(self) -> list[Any]:
        return []  # on another machine: the actor ends them (RankHost.signal)

    def cpu_seconds(self) -> float | None:
        return None

    def close(self) -> None:
        had = bool(self.fds) or self.channel is not None
        super().close()
        if self.relay is not None:  # its threads end before the actors do
            self.relay.close()
            self.relay = None
        if had:
            self.placement.closed()


class NodeWatch(Hook):
    """A lost node ends the job with an error naming the node and its ranks (not the
    peers' "connection closed" that it causes first). Ray learns of the loss a few seconds
    after the node's sockets close: a failing job waits up to :attr:`WAIT` for that word
    about the ranks whose streams ended without an exit status."""

    WAIT = 30.0

    def __init__(self, max_restarts: int = 0, restarts_left: int | None = 0) -> None:
        # what follows the loss, for its message: a launch's restarts (None: a pool's call)
        self.max_restarts, self.restarts_left = max_restarts, restarts_left

    def look(self, sup: Supervisor, busy: list[int], done: Mapping[int, Done]) -> JobFailed | None:
        lost = [p for p in sup.procs.values() if isinstance(p, RemoteWorker) and p.lost]
        return JobFailed(self.error(lost), "a node was lost") if lost else None

    def failed(
        self, sup: Supervisor, problems: list[Failure], chosen: Failure, finished: set[int]
    ) -> None:
        remote = [p for p in sup.procs.values() if isinstance(p, RemoteWorker)]
        silent = [p for p in remote if p.returncode is None and p.channel_closed()]
        deadline = time.monotonic() + (self.WAIT if silent else 0)
        while silent and time.monotonic() < deadline and not any(p.lost for p in remote):
            for proc in silent:
                proc.poll()
            time.sleep(0.1)
        if lost := [p for p in remote if p.lost]:  # this error instead of the peers' one
            sup.end_early([*sup.procs.values()], self.error(lost), "a node was lost")

    def error(self, lost: list[RemoteWorker]) -> LaunchError:
        """The lost node's error: which node, its ranks, and what happens next, as the
        launcher's restart loop (:func:`._cluster_nodes.replace`) or the pool does it."""
        by_node: dict[str, list[int]] = {}
        for proc in lost:
            by_node.setdefault(proc.placement.nodes.get(proc.rank, "a node"), []).append(proc.rank)
        said = "; ".join(f"{node} with rank(s) {sorted(r)}" for node, r in by_node.items())
        # the first line is what a restart's announcement shows; the rest says what happens
        return LaunchError(
            f"the Ray cluster lost {said}\n"
            f"Those ranks are gone (Ray said: {lost[0].lost}). {self._next()}"
        )

    def _next(self) -> str:
        resume = (
            "runs the function again from its start: it continues where it was only if it "
            "loads its latest checkpoint (accelerator.load_state() with automatic checkpoint "
            "naming under project_dir, on storage every node reaches, e.g. s3:// or gs://)"
        )
        replace = (
            "ends every other rank and places the whole group again (the same num_nodes and "
            "num_processes) on the nodes Ray lists alive when they can hold it, else waits up "
            "to replace_timeout seconds for a node that joins"
        )
        if self.restarts_left is None:  # a pool's call: _replace, at once, no waiting
            return (
                "The pool ended every rank of this call and started new workers at once on "
                "the nodes Ray lists alive, without waiting for a node to join (where the "
                "cluster cannot hold them, that start's own error is raised instead): names "
                "set with push or in %%distributed cells are gone. Fix: check the node "
                "(memory, preemption), then call again (load your latest checkpoint to go on "
                "where it was), or start a pool with the nodes left (num_nodes=...)."
            )
        if self.restarts_left > 0:
            return (
                f"The launch restarts (max_restarts={self.max_restarts}, "
                f"{self.restarts_left} left): it {replace}, then {resume}."
            )
        used = (
            f"its max_restarts={self.max_restarts} restarts are used"
            if self.max_restarts
            else "max_restarts=0"
        )
        return (
            f"The launch ends here ({used}). With max_restarts=N a launch {replace}, then "
            f"{resume}. Fix: check the node (memory, preemption), then launch again, or pass "
            "max_restarts=..."
        )


#: (kernel directory, node) pairs already said in this kernel: said once, not every launch
_SAID_WORKDIRS: set[tuple[str, str]] = set()
#: kernel addresses the nodes could not reach, already said in this kernel
_SAID_RELAYED: set[str] = set()


def _say_relayed(host: str, why: Mapping[int, str], say: Callable[[str], None] | None) -> None:
    """One line in the cell (once per kernel address): the ranks' streams go through Ray."""
    if host in _SAID_RELAYED:
        return
    _SAID_RELAYED.add(host)
    first = why[min(why)]
    text = (
        f"nbaccel: the cluster's nodes could not reach this kernel at {host} (rank "
        f"{min(why)}: {first}), so the ranks' output and messages travel through Ray: "
        f"slower, and fine. To connect directly, set {HOST_VAR} to an address of this "
        "machine that the nodes reach.\n"
    )
    if say is not None:
        say(text)
    else:
        with contextlib.suppress(Exception):
            sys.stderr.write(text)


def _say_other_workdirs(
    workdir: str, infos: list[dict[str, Any]], nodes: Mapping[int, str]
) -> None:
    """Warn (once per node and directory) about ranks whose node lacks the kernel's working
    directory: their relative paths resolve elsewhere than the notebook's, silently else."""
    elsewhere: dict[tuple[str, str], list[int]] = {}
    for rank, info in enumerate(infos):
        if not info.get("in_kernel_dir", True):
            elsewhere.setdefault((nodes[rank], str(info["workdir"])), []).append(rank)
    new = [
        (key, ranks) for key, ranks in elsewhere.items() if (workdir, key[0]) not in _SAID_WORKDIRS
    ]
    if not new:
        return
    _SAID_WORKDIRS.update((workdir, node) for (node, _), _ in new)
    said = "; ".join(f"rank(s) {ranks} on {node} run in {there}" for (node, there), ranks in new)
    warnings.warn(
        f"this kernel's directory {workdir} does not exist on every node: {said}, so their "
        "relative paths (data files, save_state('ckpt'), output_dir) resolve there, not "
        "beside the notebook. Fix: keep the notebook's directory on storage every node "
        "mounts, or use absolute paths to shared storage. (Said once per node.)",
        RuntimeWarning,
        stacklevel=2,
    )


def _kernel_host() -> str:
    """Where the kernel listens for its ranks: NBACCEL_CLUSTER_HOST, else Ray's address."""
    return os.environ.get(HOST_VAR, "").strip() or _cluster_wire.node_ip()


def start_cluster_group(
    plan: LaunchPlan,
    *,
    round_: int,
    persistent: bool,
    rank_env: RankEnv,
    say: Callable[[str], None] | None = None,
    replace_wait: float | None = None,
) -> list[WorkerProcess]:
    """Place and start every rank of ``plan`` on the cluster; their kernel-side views
    (``rank_env``: the torchrun-compatible rank variables, as the start step makes them).
    ``replace_wait`` (a launch's restart after a failure: its ``replace_timeout``): seconds
    to wait for the cluster to hold the group again (a lost node replaced), ``say`` telling
    the cell what it waits for; without it a request the cluster cannot hold is refused at
    once (a first start, a pool's restart).
    Whatever was placed is released before an exception propagates."""
    cfg = plan.config
    assert cfg.cluster is not None
    ray = _cluster_place.connect(cfg.cluster)
    per_node = plan.num_processes or 1
    wait = cfg.timeout or _cluster_place.PLACE_WAIT
    # each node's facts, read there; each node's plan from its own (never this machine's)
    if replace_wait is None:
        nodes = _cluster_nodes.plan_nodes(ray, cfg, per_node, plan.function, wait)
        group = _cluster_nodes.reserve(ray, nodes, wait)
    else:
        nodes, group = _cluster_nodes.replace(
            ray, cfg, per_node, plan.function, wait, replace_wait=replace_wait, say=say
        )
    placement = Placement(ray, group)
    procs: list[RemoteWorker] = []  # filled as each rank's worker is made: closed on a failure
    try:
        _start(ray, plan, placement, nodes, round_, persistent, rank_env, procs, say)
    except BaseException:
        for proc in procs:
            proc.close()
        placement.release()
        raise
    return list(procs)


def _actors(ray: Any, plan: LaunchPlan, placement: Placement,
            nodes: list[_cluster_nodes.NodePlan]) -> list[Any]:  # fmt: skip
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ._cluster_host import RankHost

    host = ray.remote(RankHost)
    for rank in plan.ranks:
        node, _ = node_of(rank=rank, per_node=nodes[0].ranks)
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=placement.group, placement_group_bundle_index=node
        )
        placement.actors.append(host.options(
            num_cpus=nodes[node].cpus, num_gpus=nodes[node].gpus, scheduling_strategy=strategy,
            name=None, max_restarts=0,
        ).remote())  # fmt: skip
    return placement.actors


def _start(ray: Any, plan: LaunchPlan, placement: Placement,
           nodes: list[_cluster_nodes.NodePlan], round_: int, persistent: bool,
           rank_env: RankEnv, procs: list[RemoteWorker],
           say: Callable[[str], None] | None) -> None:  # fmt: skip
    """Start every rank's worker, appending each to ``procs`` as soon as it holds anything of
    the kernel's (its streams, direct or relayed), so that the caller closes it if a later
    step fails; sockets and relays not handed to a worker yet are closed here."""
    cfg = plan.config
    actors = _actors(ray, plan, placement, nodes)
    wait = cfg.timeout or _cluster_place.PLACE_WAIT
    workdir = os.getcwd()
    infos = ray.get(
        [
            a.describe.remote(reserve_store=rank == 0, workdir=workdir)
            for rank, a in enumerate(actors)
        ],
        timeout=wait,
    )
    for rank, info in enumerate(infos):
        where = f"node {info['ip']} ({info['node_id'][:8]})"
        placement.nodes[rank] = where
        _cluster_wire.check_versions(info, f"{where}, rank {rank}")
    _say_other_workdirs(workdir, infos, placement.nodes)
    specs = _specs(plan, infos, nodes, round_, persistent, rank_env)
    listener = _cluster_wire.AuthListener(
        _kernel_host(), secret=secrets.token_bytes(32), timeout=wait
    )
    host = listener.address[0]
    try:
        launched = [
            a.launch.remote(listener.address, listener.secret, rank)
            for rank, a in enumerate(actors)
        ]
        streams, unreachable = _accept(ray, listener, launched, len(actors), placement)
    finally:
        listener.close()
    relays: dict[int, _ray_relay.KernelRelay] = {}
    try:
        started = ray.get(launched, timeout=wait)
        if unreachable:
            _say_relayed(host, unreachable, say)
        for rank in unreachable:  # the same sockets, their bytes carried by the rank's actor
            relays[rank] = _ray_relay.KernelRelay(ray, actors[rank], rank=rank)
            streams[rank] = dict(relays[rank].ends)
        for rank, actor in enumerate(actors):
            got = streams[rank]  # each stream leaves it once the worker holds it
            proc = RemoteWorker(rank, int(started[rank]["pid"]), {})
            proc.placement, proc.actor = placement, actor
            proc.relay = relays.pop(rank, None)
            proc.node = placement.nodes.get(rank)  # every message about the rank names it
            placement.opened()
            procs.append(proc)
            for name in ("stdout", "stderr"):
                proc.fds[name] = fd = got[name].detach()
                del got[name]
                keep_kernel_ends(fd)  # the engine's, as for a local worker (and its close)
                os.set_blocking(fd, False)
            proc.channel = Channel(got["channel"])
            del got["channel"]
            keep_kernel_ends(proc.channel)
            proc.waiting = actor.wait.remote()
        send_setups(procs, specs)  # the engine's first message, as to a spawned worker
    finally:
        for left in streams.values():
            for sock in left.values():
                sock.close()
        for relay in relays.values():  # a relay handed to a worker is closed with it
            relay.close()


def _accept(ray: Any, listener: _cluster_wire.AuthListener, launched: list[Any], count: int,
            placement: Placement) -> tuple[dict[int, dict[str, socket.socket]], dict[int, str]]:  # fmt: skip
    """Every rank's three authenticated streams (their node's versions checked), and the
    ranks whose node could not reach this kernel (why): their actors relay their streams."""
    got: dict[int, dict[str, socket.socket]] = {}
    unreachable: dict[int, str] = {}
    answered: set[int] = set()  # ranks whose launch() returned
    deadline = time.monotonic() + listener.timeout

    def waiting() -> list[int]:
        return [r for r in range(count) if len(got.get(r, {})) < len(_STREAMS)
                and r not in unreachable]  # fmt: skip

    try:
        while waiting():
            done, _ = ray.wait(launched, num_returns=len(launched), timeout=0)
            for index in {launched.index(ref) for ref in done} - answered:
                answered.add(index)  # a rank that could not start: its error, as it is
                if why := ray.get(launched[index])["unreachable"]:
                    unreachable[index] = why
            if not waiting():
                break
            try:
                sock, hello = listener.accept(min(deadline, time.monotonic() + 0.25))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise LaunchError(
                        f"rank(s) {waiting()} on the cluster did not connect back to this "
                        f"kernel at {listener.address[0]}:{listener.address[1]} in "
                        f"{listener.timeout:g}s. Fix: set {HOST_VAR} to an address of this "
                        "machine that the nodes reach (no firewall in between)."
                    ) from None
                continue
            rank, stream = hello.get("rank"), hello.get("stream")
            if not isinstance(rank, int) or stream not in _STREAMS or not 0 <= rank < count:
                sock.close()
                continue
            try:
                _cluster_wire.check_versions(hello, f"{placement.nodes.get(rank)}, rank {rank}")
            except BaseException:
                sock.close()
                raise
            got.setdefault(rank, {})[stream] = sock
    except BaseException:
        for streams in got.values():
            for sock in streams.values():
                sock.close()
        raise
    return got, unreachable


def _specs(plan: LaunchPlan, infos: list[dict[str, Any]], nodes: list[_cluster_nodes.NodePlan],
           round_: int, persistent: bool, rank_env: RankEnv) -> list[WorkerSpec]:  # fmt: skip
    """Each rank's spec from its node's plan: its node's threads, device (the config's
    ``compute_device`` as decided there), NCCL settings and GPUs (every GPU lent to the
    node's ranks, in order), never this kernel's machine's."""
    cfg, world, per_node = plan.config, plan.world_size, nodes[0].ranks
    master = infos[0]["ip"]
    env = {k: v for k, v in plan.env.items() if k != "OMP_NUM_THREADS"}
    shared = {**env, "MASTER_ADDR": master, "MASTER_PORT": str(infos[0]["store_port"])}
    if environment.is_loopback(master):  # gloo/NCCL would pick the host name's interface
        iface = environment.loopback_interface()
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if iface:
                shared.setdefault(var, iface)
    lent = [
        _cluster_nodes.gpu_env(
            [i.get("gpu_ids", []) for i in infos[n * per_node : (n + 1) * per_node]]
        )
        for n in range(len(nodes))
    ]
    specs = []
    for rank, info in enumerate(infos):
        node, local = node_of(rank=rank, per_node=per_node)
        there = nodes[node]
        if info.get("node_id") and info["node_id"] != there.facts.node_id:
            raise LaunchError(
                f"rank {rank} was placed on node {info['ip']} ({info['node_id'][:8]}), not on "
                f"{there.facts.where}, whose facts decided its plan. Fix: launch again."
            )
        env = (
            shared
            | there.env
            | (lent[node] if there.gpus else {})
            | rank_env(rank, local, world_size=world, local_world_size=per_node, node_rank=node)
        )
        config = (
            cfg.replace(compute_device=there.device) if there.device != cfg.compute_device else cfg
        )
        spec = WorkerSpec(
            rank, local, world, per_node, node, config, env, "spawn", round_, there.cpus,
            persistent, new_session=False, die_with_parent=True, parent_pid=int(info["pid"]),
            linger=plan.debug_timeout,
        )  # fmt: skip
        spec.fds = {"stdout": 1, "stderr": 2, "channel": -1}
        if rank == 0:
            spec.store_fd, spec.store_host = int(info["store_fd"]), master
        specs.append(spec)
    return specs


__all__ = ["HOST_VAR", "NodeWatch", "Placement", "RemoteWorker", "node_of", "start_cluster_group"]
