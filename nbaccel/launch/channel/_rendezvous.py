"""The rendezvous of one launch: torch's own TCPStore, listening on loopback only.

torch's ``env://`` store listens on every interface whatever ``MASTER_ADDR`` says. So the
kernel binds the socket itself (to ``master_addr``, 127.0.0.1 on one machine; a busy
``use_port`` fails before any worker exists), hands it to global rank 0, whose bootstrap
serves the store on it (``TCPStore(..., multi_tenant=True, master_listen_fd=fd)``), and
closes its copy; the user's later ``init_process_group("env://")`` reuses that server.
Other nodes check first that node 0's store answers. With ``rdzv_backend="c10d"``
(:func:`elastic_meet`) the machines meet through torch elastic's rendezvous at
``rdzv_endpoint``, which numbers them, and node 0 publishes its store's address there.
Nodes that differ in world size, nbaccel, torch or start method would collide and hang, so
before any training each worker publishes its node's view in the store under the restart
round, waits for every node's, and :func:`agree` raises naming both values on a mismatch.

Example:
    >>> from nbaccel.launch.channel._rendezvous import Rendezvous
    >>> rdzv = Rendezvous.reserve("127.0.0.1", None, num_nodes=1, node_rank=0)
    >>> rdzv.port > 0 and rdzv.listen_fd() is not None
    True
    >>> rdzv.close()
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import time
from typing import Any, NoReturn

from ...errors import ConfigError, LaunchError
from ...platform import environment, torchcompat

DEFAULT_TIMEOUT = 300.0  # torch's own default store timeout


def parse_endpoint(endpoint: str) -> tuple[str | None, int | None]:
    """``rdzv_endpoint`` as (host, port); either may be missing."""
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        return endpoint or None, None
    if not port.isdigit():
        raise ConfigError(f"rdzv_endpoint={endpoint!r} must look like 'host:port'.")
    return host or None, int(port)


def check_rendezvous_args(backend: Any, conf: Any, run_id: Any, endpoint: Any, nodes: int) -> None:
    """The static rendezvous, or c10d (elastic's): refuse what would otherwise be ignored
    (``backend`` is one of them: :class:`~nbaccel.config.options.StartOptions` checked it)."""
    if backend == "c10d" and nodes > 1 and not endpoint:
        raise ConfigError(
            f"rdzv_backend='c10d' with num_nodes={nodes} needs rdzv_endpoint='host:port': "
            "where the machines meet (a host every machine reaches, e.g. the first one's "
            "address, and a free port), the same on every machine."
        )
    if backend == "c10d":  # rdzv_conf and rdzv_id configure it
        return
    if conf:
        raise ConfigError(
            f"rdzv_conf={conf!r} configures the c10d rendezvous, not the static one: pass "
            "rdzv_backend='c10d', or remove it (the static rendezvous' waiting time is timeout=...)."
        )
    if run_id not in (None, "", "none"):
        raise ConfigError(
            f"rdzv_id={run_id!r} names a c10d rendezvous run, not a static one: pass "
            "rdzv_backend='c10d', or remove it (nodes of a static rendezvous meet at "
            "master_addr:use_port)."
        )


class Rendezvous:
    """Address, port and (on node 0) the reserved listening socket of one launch."""

    def __init__(
        self, addr: str, port: int, sock: socket.socket | None, num_nodes: int, node_rank: int
    ) -> None:
        self.addr, self.port, self._sock = addr, port, sock
        self.num_nodes, self.node_rank = num_nodes, node_rank

    @classmethod
    def reserve(
        cls, master_addr: str, port: int | None, *, num_nodes: int, node_rank: int
    ) -> Rendezvous:
        """Bind the rendezvous port on node 0 (``port=None``: a free one); raise if busy."""
        # Import torch.distributed before the workers are forked: they inherit it instead
        # of each importing torch again (seconds on a small machine). No CUDA is touched.
        import torch.distributed  # noqa: F401

        if node_rank != 0:
            assert port is not None, "LaunchConfig guarantees a port for multi-node runs"
            return cls(master_addr, port, None, num_nodes, node_rank)
        if num_nodes == 1 and master_addr in ("0.0.0.0", "::", ""):
            master_addr = "127.0.0.1"  # one machine: never listen on every interface
        sock = _bind(master_addr, port or 0, allow_wildcard=num_nodes > 1)
        return cls(master_addr, int(sock.getsockname()[1]), sock, num_nodes, node_rank)

    def listen_fd(self) -> int | None:
        """The reserved listening socket's fd, for global rank 0 (None on other nodes)."""
        return self._sock.fileno() if self._sock is not None else None

    def store_host(self) -> str:
        """Address rank 0's own store client connects to."""
        if self._sock is not None and self._sock.getsockname()[0] in ("0.0.0.0", "::"):
            return "127.0.0.1"
        return self.addr

    def check_reachable(self, timeout: float | None) -> None:
        """Other nodes: fail clearly when node 0's store does not answer in time (short
        TCP connects first: quiet and interruptible, unlike TCPStore's retries in C++)."""
        import torch.distributed as dist

        seconds = timeout or DEFAULT_TIMEOUT
        deadline = time.monotonic() + seconds
        error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.addr, self.port), timeout=1.0):
                    break
            except OSError as err:
                error = err
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        else:
            self._unreachable(seconds, error)
        left = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
        try:
            dist.TCPStore(self.addr, self.port, None, False, left, wait_for_workers=False)
        except Exception as err:
            self._unreachable(seconds, err)

    def _unreachable(self, seconds: float, error: Exception | None) -> NoReturn:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0]}" if error else "no answer"
        raise LaunchError(
            f"node {self.node_rank} could not reach the rendezvous at {self.addr}:{self.port} "
            f"within {seconds:g}s ({reason}). Fix: run the same launch on node 0 "
            "(node_rank=0) with the same use_port, check master_addr is node 0's address as "
            "seen from this machine and that the port is not firewalled, or raise timeout=..."
        ) from None

    def worker_env(self) -> dict[str, str]:
        """Variables that point the workers' ``env://`` rendezvous at this store."""
        env = {"MASTER_ADDR": self.addr, "MASTER_PORT": str(self.port)}
        if self.num_nodes == 1 and environment.is_loopback(self.addr):
            # gloo/NCCL pick their own listening interface from the host name, which
            # may be a public one; on a single node keep them on loopback as well.
            iface = environment.loopback_interface()
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                if iface and var not in os.environ:
                    env[var] = iface
        return env

    def close(self) -> None:
        """Close the kernel's copy of the socket (idempotent); rank 0 keeps its own."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def host_store(fd: int, host: str, port: int, timeout: float | None) -> Any:
    """Worker side (global rank 0): start torch's store server on the inherited socket.

    The store must stay referenced while the function runs (``env://`` finds it through
    torch's multi-tenant cache, keyed by port). None: this torch cannot adopt a socket, and
    rank 0's ``env://`` store binds the port itself. torch 2.4-2.7's default libuv backend
    refuses a listening socket (fixed in 2.8): the legacy backend serves it there.
    """
    import torch.distributed as dist

    delta = datetime.timedelta(seconds=timeout or DEFAULT_TIMEOUT)
    kwargs: dict[str, Any] = {"wait_for_workers": False, "multi_tenant": True}
    # Chosen up front rather than by trying: the refusal is also logged from C++ on
    # stderr, where it would reach the notebook as a confusing "[E ...]" line.
    if not torchcompat.libuv_store_adopts_socket():
        kwargs["use_libuv"] = False
    try:
        try:
            return dist.TCPStore(host, port, None, True, delta, master_listen_fd=fd, **kwargs)
        except NotImplementedError:  # a libuv backend without the fix: see above
            kwargs["use_libuv"] = False
            return dist.TCPStore(host, port, None, True, delta, master_listen_fd=fd, **kwargs)
    except TypeError:  # a torch without master_listen_fd / use_libuv
        os.close(fd)
        return None


# How long a finished rank waits for its peers to finish. Only the start-up race needs
# it (a peer still joining while a fast rank tears its group and store down); a peer
# that needs this rank for longer has a bug that its own collective will report.
EXIT_GRACE = 10.0
_EXITED, _ALL_EXITED = "nbaccel/exited", "nbaccel/all_exited"
_LEFT, _ALL_LEFT = "nbaccel/left", "nbaccel/all_left"


def connect_exit_client(host: str, port: int, timeout: float | None) -> Any:
    """Worker side (ranks other than 0): a store client for :func:`leave`, or None;
    connected at start-up, while rank 0's store is certainly up."""
    import torch.distributed as dist

    try:
        delta = datetime.timedelta(seconds=timeout or DEFAULT_TIMEOUT)
        return dist.TCPStore(host, port, None, False, delta, wait_for_workers=False)
    except Exception:  # the rendezvous itself will report an unreachable store
        return None


def _count(store: Any, key: str, done_key: str, total: int) -> None:
    if store.add(key, 1) == total:
        store.set(done_key, "1")


def leave(store: Any, *, is_host: bool, world_size: int) -> bool:
    """Exit barrier on the launcher's store, run before a worker tears its group down.

    A rank tearing down while a slower peer still joined made that peer fail ("connection
    closed"). So every rank waits until all have finished; then rank 0, the store's host,
    until all others left it (each wait bounded by :data:`EXIT_GRACE`). True when no peer
    will use this process's group or store again (also for one process): it may exit
    without tearing them down.
    """
    if world_size < 2:
        return True
    if store is None:
        return False
    grace = datetime.timedelta(seconds=EXIT_GRACE)
    try:
        _count(store, _EXITED, _ALL_EXITED, world_size)
        store.wait([_ALL_EXITED], grace)
        if is_host:
            store.wait([_ALL_LEFT], grace)
        else:
            _count(store, _LEFT, _ALL_LEFT, world_size - 1)
    except Exception:  # a peer died or timed out: tear down the careful way
        return False
    return True


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

    from ..._version import __version__

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


def _bind(addr: str, port: int, *, allow_wildcard: bool) -> socket.socket:
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as err:
        raise ConfigError(f"master_addr={addr!r} cannot be resolved ({err}).") from None
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does
    try:
        try:
            sock.bind(sockaddr)
        except OSError as err:
            if err.errno != errno.EADDRNOTAVAIL or not allow_wildcard:
                raise
            sock.bind(("0.0.0.0", port))  # node 0 behind NAT: its master_addr is not local
        sock.listen(128)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"use_port={port} is already in use on {addr} (another process is listening "
                "there, perhaps an earlier run that is still alive). Pass another port, or "
                "use_port=None to pick a free one."
            ) from None
        if err.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(
                f"master_addr={addr!r} is not an address of this machine, so node 0 cannot "
                "host the rendezvous there; use 127.0.0.1 on a single machine."
            ) from None
        raise ConfigError(f"cannot listen on {addr}:{port} for the rendezvous: {err}") from None
    return sock


# the last c10d rendezvous of this kernel: its store (hosted here, perhaps) must outlive the
# meeting, while the other machines still read node 0's address from it
_MET: list[Any] = []


def elastic_meet(
    endpoint: str,
    *,
    run_id: str,
    num_nodes: int,
    conf: dict[str, Any] | None,
    port: int | None,
    timeout: float | None,
) -> tuple[int, str, int]:
    """Meet the other machines through torch elastic's c10d rendezvous at ``endpoint``:
    ``(node_rank, master_addr, master_port)``, this machine's number and where node 0 hosts
    the launch's store (its address towards ``endpoint``; ``port``, else a free one)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    options = dict(conf or {})
    options.setdefault("join_timeout", timeout or DEFAULT_TIMEOUT)
    params = RendezvousParameters(
        backend="c10d",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=num_nodes,
        max_nodes=num_nodes,
        **options,
    )
    try:
        handler = get_rendezvous_handler(params)
        info: Any = handler.next_rendezvous()  # torch < 2.4: (store, rank, world_size)
    except Exception as err:
        raise LaunchError(
            f"the c10d rendezvous at rdzv_endpoint={endpoint!r} (rdzv_id={run_id!r}, "
            f"{num_nodes} machines) failed: {type(err).__name__}: {err}. Fix: start the same "
            "launch on every machine with the same rdzv_endpoint (a host:port every machine "
            "reaches), num_nodes and rdzv_id, or raise timeout=..."
        ) from None
    store, rank = (info.store, info.rank) if hasattr(info, "store") else (info[0], info[1])
    if rank == 0:
        host = _towards(endpoint.rpartition(":")[0] or "127.0.0.1")
        if not port:
            probe = _bind(host, 0, allow_wildcard=True)
            port = int(probe.getsockname()[1])
            probe.close()
        store.set("nbaccel/master", f"{host}:{port}")
    host, _, chosen = store.get("nbaccel/master").decode().rpartition(":")
    # Heartbeats serve an elastic agent that meets again; nbaccel meets once, and their
    # thread would make forking the workers unsafe: stop it (torch has no public call).
    stop = getattr(handler, "_stop_heartbeats", None)
    if callable(stop):
        stop()
    _MET[:] = [handler]
    return int(rank), host, int(chosen)


def _towards(host: str) -> str:
    """This machine's address on the route to ``host`` (the interface others reach it by)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # UDP: no packet is sent, the route is chosen
            return str(probe.getsockname()[0])
    except OSError:
        return socket.getfqdn()


__all__ = ["Rendezvous", "agree", "compare", "elastic_meet", "host_store", "node_facts"]
