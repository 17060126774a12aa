"""Each node's facts, read on that node, and the decisions made per node from them.

A cluster's nodes are not the kernel's machine: before anything is reserved, one light Ray
task on every live node (no CPU asked: it runs beside other work) reads what that node has
(:func:`read_here`: usable cores, GPUs, compute capabilities and NVLink as ``nvidia-smi``
reports them, ``/dev/shm``, the user's ``NCCL_*`` settings there), once per node and
kernel. :func:`plan_nodes` then decides per node: whether it can hold the launch's ranks
(a node with fewer GPUs than its ranks is refused, named), the device (``"auto"``: GPUs
when every chosen node has one per rank, else the CPU everywhere, said in the cell),
compute threads and CPUs per rank (``cpus_per_rank``, else the node's usable cores divided
by its ranks), and the NCCL settings of :mod:`.._freegpus` from that node's facts. Nothing
measured on the kernel's machine reaches a node. :func:`reserve` asks for one bundle per
node, pinned to it (Ray's ``node:<ip>`` resource), holding all its ranks' CPUs and GPUs.

Example:
    >>> facts = NodeFacts("ab" * 28, "10.0.0.2", cores=8, cpus=8.0, ray_gpus=0.0)
    >>> plan = decide_node(facts, ranks=2, cpus_per_rank=None, device="cpu")
    >>> plan.cpus, plan.env["OMP_NUM_THREADS"], plan.bundle()["CPU"]
    (4, '4', 8.0)
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ....errors import LaunchError
from ....platform import environment, gpufacts
from ....platform.gpufacts import GpuFacts
from .. import _freegpus

#: a bundle's share of its node's ``node:<ip>`` resource: pins the bundle to that node
PIN = 0.001
#: how long a restart's placement may stay pending before the live nodes are planned again
_REPLAN_S = 5.0


@dataclass(frozen=True)
class NodeFacts:
    """One live node as it is: read there (cores, GPUs) and as Ray counts it (CPUs, GPUs).

    Attributes:
        node_id: Ray's id of the node.
        ip: the address Ray knows it by.
        cores: the cores a process there may use (affinity mask, cgroup quota).
        cpus: its CPUs as Ray counts them (``ray start --num-cpus``).
        ray_gpus: its GPUs as Ray counts them (``ray start --num-gpus``).
        gpu: its GPU facts, from its own ``nvidia-smi``.
        p2p_ok: a copy between its GPUs over the peer path worked (None: not tried).
        environ: the ``NCCL_*`` variables set there (the user's: they win).
    """

    node_id: str
    ip: str
    cores: int = 1
    cpus: float = 0.0
    ray_gpus: float = 0.0
    gpu: GpuFacts = field(default_factory=GpuFacts)
    p2p_ok: bool | None = None
    environ: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        """How every message names the node: ``node <ip> (<first 8 of its id>)``."""
        return f"node {self.ip} ({self.node_id[:8]})"

    @property
    def gpus(self) -> int:
        """GPUs a launch can use there: what ``nvidia-smi`` lists, at most what Ray lends
        (Ray's count alone where the node has no ``nvidia-smi``)."""
        ray_gpus = int(self.ray_gpus)
        return min(self.gpu.count, ray_gpus) if self.gpu.count else ray_gpus


@dataclass(frozen=True)
class NodePlan:
    """What one node runs: ``ranks`` ranks, each with ``cpus`` CPUs (its compute threads)
    and ``gpus`` GPUs (0 or 1), on ``device``, with ``env`` (node-wide: threads, NCCL,
    Accelerate's CPU flag); ``lines`` said in the cell."""

    facts: NodeFacts
    ranks: int
    cpus: int
    gpus: int
    device: str
    env: dict[str, str]
    lines: tuple[str, ...] = ()

    def bundle(self) -> dict[str, float]:
        """The node's placement-group bundle: all its ranks' CPUs and GPUs, pinned to it."""
        out = {"CPU": float(self.cpus * self.ranks), f"node:{self.facts.ip}": PIN}
        if self.gpus:
            out["GPU"] = float(self.gpus * self.ranks)
        return out


# ------------------------------------------------------------------ on the node
def read_here() -> dict[str, Any]:
    """This node's facts (run on the node, as a Ray task): cores, GPU facts from its own
    ``nvidia-smi`` (on its ``PATH``; no driver check: a node is asked once), the peer-path
    copy between its GPUs where they lack NVLink and the driver reports a path, and the
    ``NCCL_*`` variables set here."""
    facts = gpufacts.read_gpu_facts(need_driver=False)
    p2p_ok = None
    pairs = [(a, b) for a in range(facts.count) for b in range(a + 1, facts.count)]
    linked = all(_cell(facts.nvlink, a, b) for a, b in pairs)
    refused = any(_cell(facts.p2p, a, b) is False for a, b in pairs)
    if pairs and not linked and not refused:
        p2p_ok = gpufacts.p2p_works(pairs, timeout=_freegpus.P2P_CHECK_TIMEOUT)
    return {
        "cores": environment.cpu_count(),
        "gpu": facts,
        "p2p_ok": p2p_ok,
        "environ": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    }


def _cell(matrix: tuple[tuple[bool, ...], ...], a: int, b: int) -> bool | None:
    return matrix[a][b] if a < len(matrix) and b < len(matrix[a]) else None


# ------------------------------------------------------------------ in the kernel
#: node id -> what read_here said there: a node's hardware is read once per kernel
_READ: dict[str, dict[str, Any]] = {}


def node_facts(ray: Any, timeout: float) -> list[NodeFacts]:
    """Every live node's facts, the kernel's own node first, then by address. A node whose
    facts could not be read within ``timeout`` is left out (said in the refusal, if any)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = [n for n in ray.nodes() if n.get("Alive")]
    task = ray.remote(num_cpus=0, max_retries=0)(read_here)
    todo = {
        n["NodeID"]: task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote()
        for n in alive
        if n["NodeID"] not in _READ
    }
    if todo:
        ray.wait(list(todo.values()), num_returns=len(todo), timeout=timeout)
    for node_id, ref in todo.items():
        with contextlib.suppress(Exception):  # gone, or not answering: not a node to use
            _READ[node_id] = ray.get(ref, timeout=0)
        if node_id not in _READ:
            ray.cancel(ref, force=True)
    here = ""
    with contextlib.suppress(Exception):
        here = ray.get_runtime_context().get_node_id()
    out = []
    for n in alive:
        if (read := _READ.get(n["NodeID"])) is None:
            continue
        resources = n.get("Resources", {})
        out.append(NodeFacts(
            n["NodeID"], str(n.get("NodeManagerAddress", "")), int(read["cores"]),
            float(resources.get("CPU", 0)), float(resources.get("GPU", 0)), read["gpu"],
            read["p2p_ok"], dict(read["environ"]),
        ))  # fmt: skip
    return sorted(out, key=lambda f: (f.node_id != here, f.ip, f.node_id))


def threads_per_rank(facts: NodeFacts, ranks: int, cpus_per_rank: int | None) -> int:
    """``cpus_per_rank``, else the node's usable cores (read there, at most Ray's CPUs)
    divided by its ranks, at least 1: as a local launch's cores / processes."""
    if cpus_per_rank is not None:
        return cpus_per_rank
    usable = min(facts.cores, int(facts.cpus)) if facts.cpus >= 1 else facts.cores
    return max(1, usable // max(ranks, 1))


def why_not(facts: NodeFacts, ranks: int, cpus_per_rank: int | None, gpu: bool) -> str | None:
    """Why the node cannot hold ``ranks`` ranks (None: it can)."""
    cpus = threads_per_rank(facts, ranks, cpus_per_rank)
    if facts.cpus < cpus * ranks:
        return f"{facts.cpus:g} CPU(s) for {ranks} rank(s) x {cpus} CPU(s)"
    if gpu and facts.gpus < ranks:
        return (
            f"{facts.gpus} GPU(s) for {ranks} rank(s) (nvidia-smi there lists "
            f"{facts.gpu.count}, Ray lends {facts.ray_gpus:g})"
        )
    return None


def decide_node(
    facts: NodeFacts,
    *,
    ranks: int,
    cpus_per_rank: int | None,
    device: str,
    mixed_precision: str | None = None,
    compiles: bool = False,
) -> NodePlan:
    """One node's plan from its own facts (see the module)."""
    cpus = threads_per_rank(facts, ranks, cpus_per_rank)
    env = {"OMP_NUM_THREADS": str(cpus)}
    lines: list[str] = []
    if device == "gpu":
        decided = _freegpus.decide(
            facts.gpu if facts.gpu.count else GpuFacts(), nproc=ranks, gpu_ids=None,
            mixed_precision=mixed_precision, compiles=compiles, environ=facts.environ,
            check=lambda pairs: facts.p2p_ok is not False,
        )  # fmt: skip
        env.update(decided.env)
        lines = [
            line.replace("nbaccel: ", f"nbaccel: on {facts.where}: ", 1) for line in decided.lines
        ]
    elif device == "cpu":  # Accelerate's own state joins a CPU group only when told so
        env["ACCELERATE_USE_CPU"] = "true"
    return NodePlan(facts, ranks, cpus, 1 if device == "gpu" else 0, device, env, tuple(lines))


def plan_nodes(ray: Any, cfg: Any, ranks: int, function: Any, timeout: float) -> list[NodePlan]:
    """The launch's nodes (``cfg.num_nodes`` of them, ``ranks`` each) and each one's plan;
    lines said in the cell. Raises LaunchError, naming each node and what it lacks, where
    fewer nodes than asked can hold the launch."""
    facts = node_facts(ray, timeout)
    device = cfg.compute_device
    said: list[str] = []
    if device == "auto":  # each node's accelerator: GPUs where all the nodes have them
        with_gpus = [f for f in facts if why_not(f, ranks, cfg.cpus_per_rank, True) is None]
        device = "gpu" if len(with_gpus) >= cfg.num_nodes else "cpu"
        if device == "cpu" and any(f.gpus for f in facts):
            said.append(
                f"nbaccel: compute_device='auto' trains on the CPU: {len(with_gpus)} of the "
                f"cluster's nodes have GPUs for {ranks} rank(s) each, {cfg.num_nodes} are "
                "needed (every node of a launch computes on the same kind of device). Pass "
                "compute_device='gpu' to be refused instead, or lower num_nodes."
            )
    gpu = device == "gpu"
    reasons = {f.node_id: why_not(f, ranks, cfg.cpus_per_rank, gpu) for f in facts}
    fits = [f for f in facts if reasons[f.node_id] is None]
    if len(fits) < cfg.num_nodes:
        each = "; ".join(f"{f.where}: {reasons[f.node_id] or 'fits'}" for f in facts)
        per_rank = f"{cfg.cpus_per_rank or 'its cores / ranks'} CPU(s)" + (", 1 GPU" if gpu else "")
        raise LaunchError(
            f"the Ray cluster cannot place this launch: it needs {cfg.num_nodes} node(s) "
            f"with {ranks} rank(s) each ({per_rank} per rank), and {len(fits)} of its "
            f"{len(facts)} live node(s) can hold that [{each}]. Fix: add nodes, lower "
            "num_nodes / num_processes / cpus_per_rank"
            + (", or compute_device='cpu'." if gpu else ".")
        )
    compiles = _freegpus.compiles(function)
    plans = [
        decide_node(f, ranks=ranks, cpus_per_rank=cfg.cpus_per_rank, device=device,
                    mixed_precision=cfg.mixed_precision, compiles=compiles)
        for f in fits[: cfg.num_nodes]
    ]  # fmt: skip
    for line in [*said, *(line for plan in plans for line in plan.lines)]:
        sys.stderr.write(line + "\n")
    return plans


def reserve(ray: Any, plans: list[NodePlan], timeout: float) -> Any:
    """A ready placement group of one bundle per planned node (removed again if it is not
    placed within ``timeout``: resources held by other work)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([plan.bundle() for plan in plans], strategy="STRICT_SPREAD")
    try:
        ready, _ = ray.wait([group.ready()], timeout=timeout)
    except BaseException:
        remove_placement_group(group)
        raise
    if not ready:
        remove_placement_group(group)
        said = "; ".join(f"{p.facts.where}: {p.bundle()}" for p in plans)
        raise LaunchError(
            f"the Ray cluster did not place [{said}] within {timeout:g}s: its resources are "
            "held by other work. Fix: free them, lower cpus_per_rank, or raise timeout=..."
        )
    return group


def replace(
    ray: Any,
    cfg: Any,
    ranks: int,
    function: Any,
    timeout: float,
    *,
    replace_wait: float,
    say: Callable[[str], None] | None = None,
) -> tuple[list[NodePlan], Any]:
    """A restart after a failure (a lost node): the nodes' plans and their ready placement
    group, waiting up to ``replace_wait`` (the launch's ``replace_timeout``) for the cluster
    to hold the launch again, ``say`` telling the cell once what it waits for. Each try plans
    from the live nodes as they are then (a node that joined is read, a dead one is gone);
    a plan whose group Ray does not place soon (a lost node still listed alive) is planned
    again. A pending placement group is also what Ray's autoscaler adds nodes for.

    Raises:
        LaunchError: no replacement within ``replace_wait``, saying how to go on.
    """
    from ray.util.placement_group import placement_group, remove_placement_group

    began = time.monotonic()
    said = False
    while True:
        left = replace_wait - (time.monotonic() - began)
        why = ""
        try:
            plans = plan_nodes(ray, cfg, ranks, function, min(timeout, max(left, 1.0)))
        except LaunchError as err:
            why = str(err).split(" [", 1)[0].split(", and ", 1)[-1]
        else:
            group = placement_group([plan.bundle() for plan in plans], strategy="STRICT_SPREAD")
            try:
                ready, _ = ray.wait([group.ready()], timeout=min(max(left, 0.0), _REPLAN_S))
            except BaseException:
                remove_placement_group(group)
                raise
            if ready:
                return plans, group
            remove_placement_group(group)
            why = "Ray has not placed it yet (a lost node stays listed alive until Ray declares it dead)"
        if time.monotonic() - began >= replace_wait:
            raise LaunchError(
                f"no replacement came: the Ray cluster did not hold {cfg.num_nodes} node(s) x "
                f"{ranks} rank(s) within replace_timeout={replace_wait:g}s after a lost node "
                f"({why}). Fix: add a node (`ray start --address=...`, or let Ray's "
                "autoscaler add one), raise replace_timeout=..., or launch again with a lower "
                "num_nodes; the run's checkpoints are where it wrote them."
            )
        if not said and say is not None:
            say(
                f"nbaccel: waiting up to {replace_wait:g}s (replace_timeout) for the Ray "
                f"cluster to hold {cfg.num_nodes} node(s) x {ranks} rank(s) again: {why}. A "
                "node that joins (`ray start --address=...`, or Ray's autoscaler) is used as "
                "soon as it is up.\n"
            )
            said = True
        time.sleep(min(_REPLAN_S, max(0.0, replace_wait - (time.monotonic() - began))))


def gpu_env(gpu_ids: list[list[Any]]) -> dict[str, str]:
    """One node's ``CUDA_VISIBLE_DEVICES`` for every rank there: the GPUs Ray lent its ranks'
    actors, together, in order (each rank then takes ``cuda:LOCAL_RANK``, as locally), not
    Ray's one GPU per actor.

    Example:
        >>> gpu_env([["1"], ["0"]])
        {'CUDA_VISIBLE_DEVICES': '0,1'}
    """
    ids = sorted(
        {str(i) for ids in gpu_ids for i in ids},
        key=lambda i: (not i.isdigit(), int(i) if i.isdigit() else 0, i),
    )
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids)} if ids else {}


__all__ = [
    "NodeFacts",
    "NodePlan",
    "decide_node",
    "gpu_env",
    "node_facts",
    "plan_nodes",
    "read_here",
    "replace",
    "reserve",
    "threads_per_rank",
    "why_not",
]
