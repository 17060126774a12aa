"""The TCP channel to a rank on another machine: authenticated before anything is unpickled.

The kernel listens on the one address the cluster's nodes reach it by (never every
interface), for the few seconds its ranks take to connect. Each connection proves, before
a byte of it is decoded, that it knows the launch's secret: ``multiprocessing.connection``'s
HMAC challenge, both ways (:func:`deliver_challenge` then :func:`answer_challenge`, as its
``Listener``/``Client`` do). Then comes one JSON hello (never a pickle: which rank, which
stream, and the node's nbaccel and torch versions, compared with the kernel's). Only then
does the socket become a rank's :class:`~._wire.Channel` or one of its output streams.
Every such connection, both ends, keeps TCP keepalive on (:func:`keepalive`): a warm pool's
channel may stay silent for hours, and a NAT or firewall in between forgets an idle
connection (then the next job would wait on a dead one), or a peer vanishes without a word.
A node that cannot open the connection at all (:class:`Unreachable`: refused, no route, no
answer within :data:`REACH_TRY`) is the caller's to route otherwise (:mod:`._ray_relay`).

Example:
    >>> import threading
    >>> listener = AuthListener("127.0.0.1", secret=b"k" * 32, timeout=30)
    >>> t = threading.Thread(target=connect, args=(listener.address, b"k" * 32,
    ...     {"rank": 0, "stream": "channel"}))
    >>> t.start(); sock, hello = listener.accept(); t.join()
    >>> hello["rank"], hello["stream"]
    (0, 'channel')
    >>> sock.close(); listener.close()
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import queue
import socket
import struct
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from ...errors import LaunchError, Unreachable

#: seconds one connection has to pass the challenge: a stranger never stalls the launch long
AUTH_TIMEOUT = 20.0
#: seconds a node's first connection to the kernel may take to open (the TCP handshake
#: only, done by the two machines' network stacks, not by a loaded process): a refused or
#: unroutable connection fails at once, a firewall that drops the packets costs this much
REACH_TRY = 5.0
#: TCP keepalive: seconds idle before the first probe, seconds between probes, probes
#: unanswered before the connection counts as dead (about two minutes in all)
KEEPALIVE = (60, 15, 4)
_MAX_HELLO = 1 << 16


def keepalive(sock: socket.socket) -> None:
    """TCP keepalive on ``sock`` with :data:`KEEPALIVE`'s timings (where the platform has
    each option: macOS names the idle time otherwise, and keeps its default)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in zip(
        ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE, strict=True
    ):
        option = getattr(socket, name, None)
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


def versions() -> dict[str, str]:
    """This install's nbaccel and torch versions (torch's from its metadata: not imported)."""
    from ..._version import __version__

    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    return {"nbaccel": __version__, "torch": torch}


def check_versions(theirs: dict[str, Any], where: str) -> None:
    """One error naming both installs when the node's nbaccel or torch is not the kernel's."""
    ours = versions()
    differ = [k for k in ours if str(theirs.get(k)) != ours[k]]
    if differ:
        both = "; ".join(f"{k} {ours[k]} in the kernel, {theirs.get(k)} on {where}" for k in differ)
        raise LaunchError(
            f"the cluster's node runs another install than this kernel ({both}). Fix: install "
            "the same nbaccel and torch versions on every node (e.g. a Ray runtime_env or the "
            "cluster's image), then launch again."
        )


def _timed(sock: socket.socket, seconds: float) -> None:
    """Blocking socket whose reads give up after ``seconds`` (Connection reads the raw fd,
    so a Python-level timeout, which makes the fd non-blocking, would not do)."""
    sock.settimeout(None)
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def _untimed(sock: socket.socket) -> None:
    """Reads and writes on ``sock`` wait as long as it takes again (after the challenge):
    a training step may keep a rank silent for any time."""
    _timed(sock, 0.0)


def node_ip() -> str:
    """The address Ray knows this node by (the one its peers reach it at); 127.0.0.1 when
    Ray cannot say (not installed, or not connected: one machine)."""
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:
        return "127.0.0.1"


def _authenticate(sock: socket.socket, secret: bytes, *, server: bool) -> socket.socket:
    """The HMAC challenge both ways on ``sock``; returns a socket on the same connection."""
    _timed(sock, AUTH_TIMEOUT)
    conn = Connection(os.dup(sock.fileno()))
    try:
        if server:
            deliver_challenge(conn, secret)
            answer_challenge(conn, secret)
        else:
            answer_challenge(conn, secret)
            deliver_challenge(conn, secret)
    finally:
        conn.close()  # its own dup of the fd; the socket stays open
    return sock


def _send_json(sock: socket.socket, value: dict[str, Any]) -> None:
    data = json.dumps(value).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed during the hello")
        data += chunk
    return data


def _recv_json(sock: socket.socket) -> dict[str, Any]:
    (size,) = struct.unpack("!I", _recv_exact(sock, 4))
    if size > _MAX_HELLO:
        raise ConnectionError(f"hello of {size} bytes")
    value = json.loads(_recv_exact(sock, size))
    if not isinstance(value, dict):
        raise ConnectionError("hello is not an object")
    return value


def connect(
    address: tuple[str, int],
    secret: bytes,
    hello: dict[str, Any],
    *,
    reach_wait: float = AUTH_TIMEOUT,
) -> socket.socket:
    """The rank's side: connect, pass the challenge, say ``hello`` (plus this install's
    versions); returns the connected socket, blocking, without timeouts, keepalive on.

    Raises:
        Unreachable: the connection could not be opened within ``reach_wait`` seconds
            (refused, no route, or no answer): nothing was sent.
    """
    try:
        sock = socket.create_connection(address, timeout=reach_wait)
    except OSError as err:
        raise Unreachable(f"{type(err).__name__}: {err}") from err
    try:
        keepalive(sock)
        _authenticate(sock, secret, server=False)
        _send_json(sock, {**hello, **versions()})
        _untimed(sock)
        return sock
    except BaseException:
        sock.close()
        raise


class AuthListener:
    """The kernel's listening socket for one launch's ranks (bound to ``host`` only).

    Connections are taken by a thread and each challenged in a thread of its own, so a
    stranger that connects and says nothing delays no rank."""

    def __init__(self, host: str, *, secret: bytes, timeout: float) -> None:
        if len(secret) < 16:
            raise ValueError("secret must hold at least 16 random bytes")
        self.secret, self.timeout = secret, timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind((host, 0))
            self._sock.listen(64)
        except OSError as err:
            self._sock.close()
            raise LaunchError(
                f"could not listen on {host} for the cluster's ranks: {err}. Fix: set "
                "NBACCEL_CLUSTER_HOST to the address the nodes reach this kernel by."
            ) from err
        self.refused = 0  # connections that failed the challenge or the hello
        self._passed: queue.Queue[tuple[socket.socket, dict[str, Any]]] = queue.Queue()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._taker = threading.Thread(target=self._take, name="nbaccel-cluster-door", daemon=True)
        self._taker.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def _take(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._check, args=(sock,), daemon=True).start()

    def _check(self, sock: socket.socket) -> None:
        try:
            keepalive(sock)
            _authenticate(sock, self.secret, server=True)
            hello = _recv_json(sock)
            _untimed(sock)
        except (AuthenticationError, OSError, EOFError, ValueError, ConnectionError):
            with self._lock:
                self.refused += 1
            with contextlib.suppress(OSError):
                sock.close()
            return
        with self._lock:
            if self._closed.is_set():
                sock.close()
                return
            self._passed.put((sock, hello))

    def accept(self, deadline: float | None = None) -> tuple[socket.socket, dict[str, Any]]:
        """The next connection that passed the challenge, and its hello (``deadline``: a
        ``time.monotonic()`` value; default: :attr:`timeout` from now). Strangers are closed,
        unread beyond the challenge, and counted in :attr:`refused`."""
        end = time.monotonic() + self.timeout if deadline is None else deadline
        try:
            return self._passed.get(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("no rank connected in time") from None

    def close(self) -> None:
        """Stop listening; connections passed but not taken are closed."""
        with self._lock:
            self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._taker.join(timeout=5)
        while not self._passed.empty():
            self._passed.get_nowait()[0].close()


__all__ = [
    "AUTH_TIMEOUT",
    "KEEPALIVE",
    "REACH_TRY",
    "AuthListener",
    "Unreachable",
    "check_versions",
    "connect",
    "keepalive",
    "versions",
]
