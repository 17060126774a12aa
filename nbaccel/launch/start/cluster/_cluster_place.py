"""Reaching a Ray cluster, and releasing what a launch placed on it (Ray imported lazily).

``cluster="ray"``: the cluster this kernel is connected to (``ray.init()`` already
called), else ``RAY_ADDRESS``, else ``ray.init(address="auto")``; any other value is a Ray
address. What each node holds and the placement group of one bundle per node are
:mod:`._cluster_nodes`' (each node's facts read there).

Example:
    >>> INSTALL
    "pip install 'nbaccel[ray]'"
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.util
import logging
import os
import socket
import sys
from typing import Any

from ....errors import ConfigError, LaunchError

INSTALL = "pip install 'nbaccel[ray]'"
#: seconds a feasible placement group may stay pending (held resources) when no timeout is set
PLACE_WAIT = 120.0
#: seconds to wait for the cluster's address to answer before ray.init is tried
REACH_WAIT = 10.0
#: connections tried when Ray Client's server for one dies as it starts (_client_server_died)
CLIENT_TRIES = 3


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
        _init(ray, address)
    except Exception as err:
        said = (
            f" (tried {CLIENT_TRIES} times: each time the head's Ray Client server for this "
            "connection died as it started, a known Ray bug, ray-project/ray#63202)"
            if _client_server_died(err)
            else ""
        )
        raise LaunchError(
            f"could not reach the Ray cluster at {address!r} (cluster={cluster!r}): "
            f"{type(err).__name__}: {err}{said}. Fix: start it (`ray start --head`), set "
            "RAY_ADDRESS, pass cluster='ray://host:10001', or call ray.init() first."
        ) from err
    return ray


def _init(ray: Any, address: str) -> None:
    """``ray.init``, tried again (a new Ray Client connection, so a new server for it) while
    the head's server for the connection dies as it starts."""
    tries = CLIENT_TRIES if address.startswith("ray://") else 1
    for attempt in range(1, tries + 1):
        try:
            # the ranks' lines come over nbaccel's own channel: Ray's copy of the actors'
            # output would show each line twice (the actors themselves print nothing)
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
            return
        except ConnectionAbortedError as err:
            if attempt == tries or not _client_server_died(err):
                raise


def _client_server_died(err: BaseException) -> bool:
    """Ray Client's first message failed because the server the head's proxy forked for this
    connection died as it started: gRPC's state, forked from the proxy's threads, aborts it
    in about 7% of starts (ray-project/ray#63202, open in Ray 2.60). The connection was
    closed (Ray disconnects a failed one); a new one gets a new server."""
    return isinstance(err, ConnectionAbortedError) and "Initialization failure from server" in str(
        err
    )


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


def release(ray: Any, actors: list[Any], group: Any) -> None:
    """End the launch's actors (their workers die with them) and remove its group."""
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        with contextlib.suppress(Exception):  # already gone with its node
            ray.kill(actor, no_restart=True)
    if group is not None:
        with contextlib.suppress(Exception):  # the cluster is gone: nothing of ours is on it
            remove_placement_group(group)


__all__ = [
    "INSTALL",
    "check_cluster_installed",
    "connect",
    "keep_print_plain",
    "release",
]
