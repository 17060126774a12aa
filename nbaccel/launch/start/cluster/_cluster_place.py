"""Reaching a Ray cluster and reserving its nodes for one launch (Ray imported lazily).

``cluster="ray"``: the cluster this kernel is connected to (``ray.init()`` already
called), else ``RAY_ADDRESS``, else ``ray.init(address="auto")``; any other value is a Ray
address. :func:`reserve` asks for one placement group with ``STRICT_SPREAD`` bundles, one
per node, each holding that node's ranks (Ray places no two bundles of such a group on one
node: ranks of a node together, nodes apart). A request the cluster's nodes cannot hold is
refused before anything is placed, saying what is missing; one that fits but is not
placed in time (resources held by others) is removed and reported: never Ray's silent
wait for resources.

Example:
    >>> needs = Needs(num_nodes=2, per_node=2, cpus=1.0, gpus=0.0)
    >>> needs.bundle()
    {'CPU': 2.0}
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.util
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ....errors import ConfigError, LaunchError

INSTALL = "pip install 'nbaccel[ray]'"
#: seconds a feasible placement group may stay pending (held resources) when no timeout is set
PLACE_WAIT = 120.0
#: seconds a restart's placement may take before the cell is told what it waits for (a
#: lost node that Ray has not yet declared dead still looks able to hold a bundle)
SAY_WAITING_AFTER = 5.0
#: seconds to wait for the cluster's address to answer before ray.init is tried
REACH_WAIT = 10.0


def check_cluster_installed(cluster: str) -> None:
    """Ray importable here (without importing it): else one error naming the install."""
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(
            f"cluster={cluster!r} places the ranks with Ray, which is not installed in this "
            f"kernel's environment. Fix: {INSTALL} (and the same on every node), or "
            "cluster=None for this machine."
        )


def keep_print_plain() -> None:
    """Undo (and keep off) Ray's patch of ``builtins.print``: its driver replaces print by
    ``tqdm_ray.safe_print`` once a worker's log arrives, a function whose globals refer back
    to it (through ``instance``), and dill, which copies a notebook function with the globals
    it uses, print among them, then recurses without end (RecursionError: no function that
    prints could be launched). Ray reads RAY_TQDM_PATCH_PRINT when it patches."""
    os.environ.setdefault("RAY_TQDM_PATCH_PRINT", "0")
    bars = sys.modules.get("ray.experimental.tqdm_ray")
    if bars is not None and builtins.print is getattr(bars, "safe_print", None):
        builtins.print = bars._print


def connect(cluster: str) -> Any:
    """The ``ray`` module, connected to the cluster ``cluster`` names (see the module)."""
    check_cluster_installed(cluster)
    import ray

    if ray.is_initialized():
        return ray
    address = None if cluster == "ray" else cluster
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    _check_reachable(address, cluster)
    try:
        # the ranks' lines come over nbaccel's own channel: Ray's copy of the actors'
        # output would show each line twice (the actors themselves print nothing)
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    except Exception as err:
        raise LaunchError(
            f"could not reach the Ray cluster at {address!r} (cluster={cluster!r}): "
            f"{type(err).__name__}: {err}. Fix: start it (`ray start --head`), set "
            "RAY_ADDRESS, pass cluster='ray://host:10001', or call ray.init() first."
        ) from err
    return ray


def _check_reachable(address: str, cluster: str) -> None:
    """A "host:port" that nothing answers is said at once: ray.init would retry for minutes
    (and first rewrite a loopback host into the machine's own address)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_WAIT).close()
    except OSError as err:
        raise LaunchError(
            f"could not reach the Ray cluster at {address!r} (cluster={cluster!r}): {err}. "
            "Fix: start it (`ray start --head`), or pass the address its head prints."
        ) from err


@dataclass(frozen=True)
class Needs:
    """What one launch asks of the cluster: ``num_nodes`` nodes, ``per_node`` ranks each,
    ``cpus``/``gpus`` per rank."""

    num_nodes: int
    per_node: int
    cpus: float
    gpus: float

    def bundle(self) -> dict[str, float]:
        """One node's bundle: its ranks' resources together."""
        out = {"CPU": self.cpus * self.per_node}
        if self.gpus:
            out["GPU"] = self.gpus * self.per_node
        return out


def check_feasible(ray: Any, needs: Needs) -> None:
    """Refuse a request no set of the cluster's live nodes can hold, saying what is missing."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    want = needs.bundle()
    fits = [n for n in nodes if all(n.get("Resources", {}).get(k, 0) >= v for k, v in want.items())]
    if len(fits) >= needs.num_nodes:
        return
    have = ", ".join(
        f"{n.get('NodeManagerAddress')} ({n.get('NodeID', '')[:8]}): "
        + ", ".join(f"{k}={n.get('Resources', {}).get(k, 0):g}" for k in want)
        for n in nodes
    )
    raise LaunchError(
        f"the Ray cluster cannot place this launch: it needs {needs.num_nodes} node(s) with "
        f"{', '.join(f'{k}={v:g}' for k, v in want.items())} each ({needs.per_node} rank(s) "
        f"x {needs.cpus:g} CPU, {needs.gpus:g} GPU), and {len(fits)} of its {len(nodes)} "
        f"live node(s) can hold that [{have}]. Fix: add nodes, or lower num_nodes / "
        "num_processes."
    )


def reserve(
    ray: Any,
    needs: Needs,
    timeout: float | None,
    *,
    replace_wait: float | None = None,
    say: Callable[[str], None] | None = None,
) -> Any:
    """A ready placement group for ``needs`` (removed again if it is not placed in time).

    ``replace_wait`` (a restart after a lost node: the launch's ``replace_timeout``): a
    request the live nodes cannot hold now is not refused but asked of Ray all the same,
    and waited for that long, ``say`` telling the cell what it waits for; a pending
    placement group is what Ray's autoscaler adds nodes for, and a node that joins by hand
    gets the bundles the GCS could not place. Ray places the group; nbaccel only waits."""
    from ray.util.placement_group import placement_group, remove_placement_group

    short: LaunchError | None = None
    try:
        check_feasible(ray, needs)
    except LaunchError as err:
        if replace_wait is None:
            raise
        short = err
    group = placement_group([needs.bundle()] * needs.num_nodes, strategy="STRICT_SPREAD")
    wait = replace_wait if replace_wait is not None else (timeout or PLACE_WAIT)
    began = time.monotonic()
    try:
        if short is not None or replace_wait is None:
            if short is not None and say is not None:
                say(_waiting(needs, wait, short))
            ready, _ = ray.wait([group.ready()], timeout=wait)
        else:  # the live nodes can hold it (so Ray says): a dead node not yet seen as such
            ready, _ = ray.wait([group.ready()], timeout=min(wait, SAY_WAITING_AFTER))
            if not ready:
                if say is not None:
                    say(_waiting(needs, wait, None))
                ready, _ = ray.wait([group.ready()], timeout=max(0.0, wait - SAY_WAITING_AFTER))
    except BaseException:
        remove_placement_group(group)
        raise
    if not ready:
        remove_placement_group(group)
        if replace_wait is not None:
            raise LaunchError(
                f"no replacement came: the Ray cluster did not place {needs.num_nodes} node(s) "
                f"x {needs.bundle()} within replace_timeout={wait:g}s after a lost node "
                f"({time.monotonic() - began:.0f}s waited). Fix: add a node (`ray start "
                "--address=...`, or let Ray's autoscaler add one), raise replace_timeout=..., "
                "or launch again with a lower num_nodes; the run's checkpoints are where it "
                "wrote them."
            )
        raise LaunchError(
            f"the Ray cluster did not place {needs.num_nodes} node(s) x "
            f"{needs.bundle()} within {wait:g}s: its resources are held by other work. "
            "Fix: free them, or raise timeout=..."
        )
    return group


def _waiting(needs: Needs, wait: float, short: LaunchError | None) -> str:
    now = (
        str(short).split(" [", 1)[0].split(", and ", 1)[-1]
        if short is not None
        else "Ray has not placed it yet (a lost node stays listed alive until Ray declares it dead)"
    )
    return (
        f"nbaccel: waiting up to {wait:g}s (replace_timeout) for the Ray cluster to hold "
        f"{needs.num_nodes} node(s) with {', '.join(f'{k}={v:g}' for k, v in needs.bundle().items())} "
        f"each again: {now}. A node that joins (`ray start --address=...`, or Ray's "
        "autoscaler) is used as soon as it is up.\n"
    )


def release(ray: Any, actors: list[Any], group: Any) -> None:
    """End the launch's actors (their workers die with them) and remove its group."""
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        with contextlib.suppress(Exception):  # already gone with its node
            ray.kill(actor, no_restart=True)
    if group is not None:
        with contextlib.suppress(Exception):  # the cluster is gone: nothing of ours is on it
            remove_placement_group(group)


def resources_per_rank(cfg: Any) -> tuple[float, float]:
    """(CPUs, GPUs) one rank asks for: a GPU each when the launch computes on GPUs."""
    gpus = 1.0 if cfg.compute_device == "gpu" else 0.0
    return 1.0, gpus


__all__ = [
    "INSTALL",
    "Needs",
    "check_cluster_installed",
    "check_feasible",
    "connect",
    "keep_print_plain",
    "release",
    "reserve",
    "resources_per_rank",
]
