"""A rank's three streams carried by Ray, for a kernel its cluster's nodes cannot reach.

A notebook behind NAT or a firewall (Colab, Kaggle, a laptop), or one driving the cluster
through Ray Client (``ray://``), accepts no connection from the nodes: the rank's channel,
stdout and stderr then travel as Ray actor calls, which only go from the kernel (the
driver) to the cluster. Only the transport changes: the worker and the engine each hold an
ordinary socket per stream, as over TCP.

On the node (:class:`NodeEnds`, kept by the rank's actor): one socket pair per stream,
one end the worker's (its channel fd, its fds 1 and 2), the other read by :meth:`pull`
(a long poll: bytes as soon as there are some, ``None`` after :data:`PULL_WAIT` seconds
without, ``b""`` at the end) and written by :meth:`push`; :meth:`end` is the kernel
closing its end of the channel. In the kernel (:class:`KernelRelay`): one socket pair per
stream too, :attr:`KernelRelay.ends` taking the place of the accepted sockets, and a thread
per direction pumping bytes between the other end and those actor calls, one call at a
time (the stream's order is kept). An end seen on either side is passed on as an end;
:meth:`KernelRelay.close` stops the threads and closes every socket.

Authentication: none of nbaccel's own is needed. The calls ride Ray's own connection from
this driver to the cluster, and only the driver that created the rank's actor holds its
handle; whoever can call it can already run any code on the cluster.

Example:
    >>> import asyncio
    >>> async def echo():
    ...     node = NodeEnds()
    ...     node.worker["stdout"].sendall(b"hi")
    ...     return await node.pull("stdout", 16)
    >>> asyncio.run(echo())
    b'hi'
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import threading
from typing import Any

STREAMS = ("channel", "stdout", "stderr")
#: seconds one pull waits on the node for bytes before it answers None (one round trip of
#: an idle stream per this many seconds; the kernel's threads look at their stop this often)
PULL_WAIT = 1.0
#: bytes one call carries at most
CHUNK = 1 << 16
#: seconds a kernel thread waits in one ray.get before it looks whether it was stopped
_LOOK = 0.25
#: seconds close() waits for its threads (each sees the stop within _LOOK)
_JOIN_WAIT = 5.0


# ------------------------------------------------------------------ on the node
class NodeEnds:
    """The node's side of a relayed rank: :attr:`worker` holds the worker's end of each
    stream (closed here by :meth:`handed` once the worker has them)."""

    def __init__(self) -> None:
        self._ours: dict[str, socket.socket] = {}
        self.worker: dict[str, socket.socket] = {}
        self._drained = dict.fromkeys(STREAMS, False)
        for stream in STREAMS:
            ours, theirs = socket.socketpair()
            ours.setblocking(False)  # read and written by the actor's event loop
            self._ours[stream], self.worker[stream] = ours, theirs

    def handed(self) -> None:
        """The worker holds its ends now: this process keeps no copy (else no end is seen)."""
        for sock in self.worker.values():
            sock.close()
        self.worker = {}

    def _sock(self, stream: str) -> socket.socket:
        if stream not in self._ours:
            raise ValueError(f"stream={stream!r} is not one of {STREAMS}")
        return self._ours[stream]

    async def pull(self, stream: str, max_bytes: int) -> bytes | None:
        """Up to ``max_bytes`` the worker wrote on ``stream``: as soon as there are any,
        ``None`` after :data:`PULL_WAIT` seconds without, ``b""`` at its end."""
        sock = self._sock(stream)
        loop = asyncio.get_running_loop()
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, max_bytes), PULL_WAIT)
        except asyncio.TimeoutError:
            return None
        except OSError:
            data = b""
        if not data:
            self._drained[stream] = True
        return data

    async def push(self, stream: str, data: bytes) -> None:
        """Write ``data`` for the worker to read on ``stream`` (waits while it does not
        read: the kernel's thread sends the next bytes after this call returned)."""
        await asyncio.get_running_loop().sock_sendall(self._sock(stream), data)

    def end(self, stream: str) -> None:
        """The kernel closed its end of ``stream``: the worker reads the end of it."""
        with contextlib.suppress(OSError):
            self._sock(stream).shutdown(socket.SHUT_WR)

    def drained(self) -> bool:
        """The kernel has pulled every stream to its end (the worker's last words)."""
        return all(self._drained.values())

    def close(self) -> None:
        """Close every end held here (the actor's death does it too)."""
        for sock in [*self._ours.values(), *self.worker.values()]:
            sock.close()
        self.worker = {}


# ------------------------------------------------------------------ in the kernel
#: the kernel's relay ends alive now: a process forked from the kernel closes its copies
_LIVE: set[socket.socket] = set()
_fork_hook = False


def _close_in_child() -> None:
    for sock in list(_LIVE):
        with contextlib.suppress(OSError):
            sock.close()  # this copy only: never shutdown(), which would end the kernel's
    _LIVE.clear()


class KernelRelay:
    """The kernel's side of one relayed rank.

    Args:
        ray: the connected ``ray`` module.
        actor: the rank's actor (its ``pull``, ``push`` and ``end`` methods).
        rank: the rank (names the threads).

    :attr:`ends` (``"channel"``, ``"stdout"``, ``"stderr"``) are the engine's: a
    :class:`~._wire.Channel` and the output fds are made of them as of accepted sockets.
    """

    def __init__(self, ray: Any, actor: Any, *, rank: int) -> None:
        global _fork_hook
        if not _fork_hook and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_close_in_child)
            _fork_hook = True
        self._ray, self._actor = ray, actor
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ours: dict[str, socket.socket] = {}
        self.ends: dict[str, socket.socket] = {}
        for stream in STREAMS:
            ours, theirs = socket.socketpair()
            self._ours[stream], self.ends[stream] = ours, theirs
            _LIVE.add(ours)
        # each of our ends is closed by the last of its stream's threads
        self._users = {stream: 1 for stream in STREAMS}
        self._users["channel"] = 2
        self._threads = [
            threading.Thread(
                target=self._from_node, args=(stream,), name=f"nbaccel-relay-{rank}-{stream}",
                daemon=True,
            )
            for stream in STREAMS
        ]  # fmt: skip
        self._threads.append(
            threading.Thread(target=self._to_node, name=f"nbaccel-relay-{rank}-in", daemon=True)
        )
        for thread in self._threads:
            thread.start()

    def _get(self, ref: Any) -> Any:
        """``ray.get(ref)``, looking every :data:`_LOOK` seconds whether to stop (raises
        :class:`_Stopped` then)."""
        from ray.exceptions import GetTimeoutError

        while True:
            try:
                return self._ray.get(ref, timeout=_LOOK)
            except GetTimeoutError:
                if self._stop.is_set():
                    raise _Stopped from None

    def _from_node(self, stream: str) -> None:
        """The worker's bytes on ``stream`` into our end, until its end (then ours)."""
        ours = self._ours[stream]
        try:
            while not self._stop.is_set():
                data = self._get(self._actor.pull.remote(stream, CHUNK))
                if data is None:  # nothing within PULL_WAIT: ask again
                    continue
                if not data:
                    break
                ours.sendall(data)  # waits while the engine does not read
        except Exception:  # _Stopped, the actor or its node gone, our end closed: the end
            pass
        finally:
            with contextlib.suppress(OSError):
                ours.shutdown(socket.SHUT_WR)  # the engine reads the end of the stream
            self._left(stream)

    def _to_node(self) -> None:
        """What the engine sends on the channel, to the worker; its close, as an end."""
        ours = self._ours["channel"]
        try:
            while not self._stop.is_set():
                if not select.select([ours], [], [], _LOOK)[0]:
                    continue
                data = ours.recv(CHUNK)
                if not data:  # the engine closed the channel: the worker reads its end
                    with contextlib.suppress(Exception):
                        self._actor.end.remote("channel")
                    break
                self._get(self._actor.push.remote("channel", data))
        except Exception:  # the worker or its node is gone: the engine's sends fail now
            with contextlib.suppress(OSError):
                ours.shutdown(socket.SHUT_RD)
        finally:
            self._left("channel")

    def _left(self, stream: str) -> None:
        with self._lock:
            self._users[stream] -= 1
            last = self._users[stream] == 0
        if last:
            _LIVE.discard(self._ours[stream])
            self._ours[stream].close()

    def close(self) -> None:
        """Stop every thread and close our ends (the engine closes :attr:`ends`)."""
        self._stop.set()
        with self._lock:
            open_ = [self._ours[s] for s, users in self._users.items() if users]
            for sock in open_:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a thread in select or sendall
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(_JOIN_WAIT)


class _Stopped(Exception):
    """The relay was closed while a thread waited for the node."""


__all__ = ["CHUNK", "PULL_WAIT", "STREAMS", "KernelRelay", "NodeEnds"]
