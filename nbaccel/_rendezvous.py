"""The rendezvous of one launch: torch's own TCPStore, hosted by the kernel on node 0.

This mirrors what ``torchrun`` does: the launching process (its "agent") hosts
the ``TCPStore`` server and every worker, rank 0 included, connects as a client
(``TORCHELASTIC_USE_AGENT_STORE=True`` makes torch's ``env://`` rendezvous do
exactly that), so the store outlives any single rank. nbaccel adds one thing:
a plain ``TCPStore`` server listens on all interfaces, so the kernel binds the
listening socket itself (to ``master_addr``, i.e. 127.0.0.1 on a single node)
and hands it over with ``master_listen_fd``. Binding first also turns a busy
``use_port`` into a clear error before any worker exists.

Other nodes check, before starting their workers, that node 0's store answers
within the timeout, and fail with the address and port otherwise.

Example:
    >>> from nbaccel._rendezvous import Rendezvous
    >>> rdzv = Rendezvous.reserve("127.0.0.1", None, num_nodes=1, node_rank=0)
    >>> rdzv.port > 0
    True
    >>> rdzv.close()
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
from typing import Any

from . import environment
from .errors import ConfigError, LaunchError

DEFAULT_TIMEOUT = 300.0  # torch's own default store timeout


class Rendezvous:
    """Address, port and (on node 0) the listening socket / store of one launch."""

    def __init__(
        self, addr: str, port: int, sock: socket.socket | None, num_nodes: int, node_rank: int
    ) -> None:
        self.addr, self.port, self._sock = addr, port, sock
        self.num_nodes, self.node_rank = num_nodes, node_rank
        self._store: Any = None

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
        """The reserved listening socket's fd (forked workers must close it), if any."""
        return self._sock.fileno() if self._sock is not None else None

    def start(self, timeout: float | None) -> None:
        """Node 0: start the store on the reserved socket. Other nodes: check reachability.

        Called after the workers were forked, so no store thread is copied into them.
        """
        import torch.distributed as dist

        delta = datetime.timedelta(seconds=timeout or DEFAULT_TIMEOUT)
        if self._sock is None:
            self._check_reachable(dist, delta)
            return
        host = "127.0.0.1" if self._sock.getsockname()[0] in ("0.0.0.0", "::") else self.addr
        fd = self._sock.detach()  # the store's server owns (and closes) the fd from now on
        self._sock = None
        try:
            self._store = dist.TCPStore(
                host, self.port, None, True, delta, wait_for_workers=False, master_listen_fd=fd
            )
        except TypeError:  # torch without master_listen_fd: let the store bind the port
            os.close(fd)
            self._store = dist.TCPStore(host, self.port, None, True, delta, wait_for_workers=False)

    def _check_reachable(self, dist: Any, delta: datetime.timedelta) -> None:
        try:
            dist.TCPStore(self.addr, self.port, None, False, delta, wait_for_workers=False)
        except Exception as err:
            raise LaunchError(
                f"node {self.node_rank} could not reach the rendezvous at "
                f"{self.addr}:{self.port} within {delta.total_seconds():g}s "
                f"({type(err).__name__}: {err}). Fix: run the same launch on node 0 "
                "(node_rank=0) with the same use_port, check master_addr is node 0's "
                "address as seen from this machine and that the port is not firewalled, "
                "or raise timeout=..."
            ) from None

    def worker_env(self, attempt: int = 0) -> dict[str, str]:
        """Variables that point the workers' ``env://`` rendezvous at this store."""
        env = {
            "MASTER_ADDR": self.addr,
            "MASTER_PORT": str(self.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
        }
        if self.num_nodes == 1 and environment.is_loopback(self.addr):
            # gloo/NCCL pick their own listening interface from the host name, which
            # may be a public one; on a single node keep them on loopback as well.
            iface = environment.loopback_interface()
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                if iface and var not in os.environ:
                    env[var] = iface
        return env

    def close(self) -> None:
        """Stop the store / release the port (idempotent)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._store = None  # the server thread stops and its socket closes with the last ref


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


__all__ = ["Rendezvous"]
