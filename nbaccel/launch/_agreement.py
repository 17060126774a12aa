"""Multi-node agreement: before any training, the nodes check they launched the same job.

Nodes that differ in world size, nbaccel, torch or start method collide and hang until the
timeout. So each worker publishes its node's view in the rendezvous store under the
current restart round, waits for every node's, and raises naming both values on a mismatch.

Example:
    >>> compare({0: {"world_size": "4"}, 1: {"world_size": "2"}})
    ['world_size: node 0 has 4, node 1 has 2']
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

from ..errors import LaunchError
from ._rendezvous import DEFAULT_TIMEOUT

_PREFIX = "nbaccel/agree"

_FIXES = {
    "world_size": "pass the same num_processes on every node (num_processes=None counts "
    "each node's own GPUs)",
    "nbaccel_version": "install the same nbaccel version on every node",
    "torch_version": "install the same torch version on every node",
    "start_method": "pass the same start_method on every node (with 'auto' a node whose "
    "kernel has initialised CUDA spawns instead of forking: restart that kernel)",
    "num_nodes": "pass the same num_nodes on every node",
}


def node_facts(spec: Any) -> dict[str, str]:
    """What must be equal on every node, as this worker (its ``WorkerSpec``) sees it."""
    import torch

    from .._version import __version__

    return {
        "world_size": str(spec.world_size),
        "num_nodes": str(spec.config.num_nodes),
        "nbaccel_version": __version__,
        "torch_version": str(torch.__version__),
        "start_method": spec.method,
    }


def compare(views: dict[int, dict[str, str]]) -> list[str]:
    """The facts on which the nodes differ, each naming every node's value."""
    problems = []
    for name in sorted({name for view in views.values() for name in view}):
        values = {node: view.get(name, "?") for node, view in sorted(views.items())}
        if len(set(values.values())) > 1:
            said = ", ".join(f"node {node} has {value}" for node, value in values.items())
            problems.append(f"{name}: {said}")
    return problems


def agree(store: Any, spec: Any) -> None:
    """Publish this node's facts for the current round, wait for all nodes, compare
    (a no-op without a store or with one node); LaunchError naming each difference and
    its fix, or the nodes that did not come within the timeout."""
    num_nodes = spec.config.num_nodes
    if store is None or num_nodes < 2:
        return
    keys = [f"{_PREFIX}/{spec.round}/node{node}" for node in range(num_nodes)]
    if spec.local_rank == 0:
        store.set(keys[spec.node_rank], json.dumps(node_facts(spec)))
    seconds = spec.config.timeout or DEFAULT_TIMEOUT
    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
    except Exception:
        missing = [node for node, key in enumerate(keys) if not store.check([key])]
        where = f"{spec.env.get('MASTER_ADDR')}:{spec.env.get('MASTER_PORT')}"
        raise LaunchError(
            f"node(s) {missing} did not reach round {spec.round} of the rendezvous at {where} "
            f"within {seconds:g}s (node {spec.node_rank} did). Fix: run the same launch on "
            "every node; with max_restarts every node restarts together, so check the other "
            "nodes' output for the failure that made them stop."
        ) from None
    views = {node: json.loads(store.get(key)) for node, key in enumerate(keys)}
    if problems := compare(views):
        fixes = "; ".join(_FIXES[p.split(":")[0]] for p in problems if p.split(":")[0] in _FIXES)
        raise LaunchError(
            f"the {num_nodes} nodes of this launch disagree (seen on node {spec.node_rank}, "
            f"pid {os.getpid()}, before any training): " + "; ".join(problems) + f". Fix: {fixes}."
        )


__all__ = ["agree", "compare", "node_facts"]
