"""What runs on a cluster's node for one rank: a Ray actor that starts nbaccel's own worker.

The actor (an async one: every method runs on one long-lived thread, the one whose death
the worker's parent-death signal follows) says where it is, reserves rank 0's rendezvous
socket on its node, then connects three authenticated TCP streams back to the kernel
(:mod:`...channel._cluster_wire`: the channel, stdout, stderr) and starts the worker exactly as the
spawn backend does (``python -c "spawn_main(fd)"``), its fds 1/2 those streams: its lines
reach the kernel over nbaccel's own route, never through Ray's log forwarding, so each is
shown once. The kernel reads the exit status with :meth:`RankHost.wait` and signals
through :meth:`RankHost.signal`; when the actor dies (``ray.kill``, a lost node) the
worker dies with it.

A node that cannot open the first connection to the kernel (refused, no route, no answer
within :data:`~...channel._cluster_wire.REACH_TRY`: NAT, a firewall, a kernel driving the
cluster through Ray Client) starts the worker on socket pairs instead, which the kernel
reads and writes through this actor (:meth:`RankHost.pull`, :meth:`RankHost.push`,
:meth:`RankHost.end`; :mod:`...channel._ray_relay`).

Example:
    >>> import asyncio
    >>> asyncio.run(RankHost().describe(reserve_store=False, workdir="/"))["workdir"]
    '/'
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from typing import Any

from ....platform.environment import package_root
from ...channel import _cluster_wire, _ray_relay

#: seconds the exit status waits, after the worker exited, for the kernel to pull its last
#: output and messages (a grandchild holding the worker's stdout would hold it for ever)
DRAIN_WAIT = 30.0


class RankHost:
    """One rank's host process on a node (made a Ray actor by :mod:`._cluster`)."""

    def __init__(self) -> None:
        self._store: socket.socket | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self._workdir: str | None = None
        self._relay: _ray_relay.NodeEnds | None = None

    async def describe(self, *, reserve_store: bool, workdir: str) -> dict[str, Any]:
        """Node id, ip, pid and versions; global rank 0 also binds the rendezvous socket
        its worker will host torch's store on (the kernel cannot reserve it remotely).

        ``workdir``: the kernel's working directory; the worker runs there if this node has
        it (a home or project directory every node mounts), as a local rank would, so that
        relative paths (data, ``save_state("ckpt")``) mean what they mean in the notebook.
        Else it stays in the directory Ray started the actor in (``ray start``'s): said
        back as ``workdir`` with ``in_kernel_dir`` False, for the kernel to say."""
        ip = _cluster_wire.node_ip()
        here = os.path.isdir(workdir)
        self._workdir = workdir if here else None
        node_id, gpu_ids = "", []
        with contextlib.suppress(Exception):
            import ray

            if ray.is_initialized():  # in an actor; never start a Ray of its own elsewhere
                node_id = ray.get_runtime_context().get_node_id()
                gpu_ids = [str(i) for i in ray.get_gpu_ids()]  # lent to this rank's actor
        port = None
        if reserve_store:
            family = socket.AF_INET6 if ":" in ip else socket.AF_INET
            self._store = socket.socket(family, socket.SOCK_STREAM)
            self._store.bind((ip, 0))
            self._store.listen(128)
            os.set_inheritable(self._store.fileno(), True)
            port = int(self._store.getsockname()[1])
        return {
            "ip": ip,
            "node_id": node_id,
            "gpu_ids": gpu_ids,
            "pid": os.getpid(),
            "store_fd": self._store.fileno() if self._store is not None else None,
            "store_port": port,
            "workdir": workdir if here else os.getcwd(),
            "in_kernel_dir": here,
            **_cluster_wire.versions(),
        }

    async def launch(self, address: tuple[str, int], secret: bytes, rank: int) -> dict[str, Any]:
        """Connect the rank's three streams to the kernel and start its worker: ``pid``;
        ``unreachable`` (why) where the kernel could not be reached, the streams then
        relayed through this actor."""
        streams: dict[str, socket.socket] = {}
        kernel = (str(address[0]), int(address[1]))  # a list, after Ray's serialization
        try:
            for stream in _ray_relay.STREAMS:
                hello = {"rank": rank, "stream": stream, "pid": os.getpid()}
                # the first connection is the try: a short bound on its opening alone
                wait = _cluster_wire.REACH_TRY if not streams else _cluster_wire.AUTH_TIMEOUT
                streams[stream] = _cluster_wire.connect(kernel, secret, hello, reach_wait=wait)
        except _cluster_wire.Unreachable as err:
            for sock in streams.values():
                sock.close()
            if streams:  # it reached the kernel once: not a network that forbids it
                raise
            self._relay = _ray_relay.NodeEnds()
            pid = self._start(self._relay.worker)
            self._relay.handed()
            return {"pid": pid, "unreachable": f"{kernel[0]}:{kernel[1]}: {err}"}
        except BaseException:
            for sock in streams.values():
                sock.close()
            raise
        pid = self._start(streams)
        for sock in streams.values():
            sock.close()  # the worker holds them now; the actor keeps no copy
        return {"pid": pid, "unreachable": None}

    def _start(self, streams: dict[str, socket.socket]) -> int:
        """Start the worker on ``streams`` (its channel, fds 1 and 2), as spawn does."""
        channel = streams["channel"].fileno()
        os.set_inheritable(channel, True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (env.get("PYTHONPATH", ""), package_root()) if p
        )
        store = (self._store.fileno(),) if self._store is not None else ()
        code = f"from nbaccel.launch.worker._worker import spawn_main; spawn_main({channel})"
        self._popen = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.DEVNULL,
            stdout=streams["stdout"].fileno(),
            stderr=streams["stderr"].fileno(),
            pass_fds=(channel, *store),
            env=env,
            cwd=self._workdir,
        )
        if self._store is not None:
            self._store.close()  # the worker's now
            self._store = None
        return self._popen.pid

    async def pull(self, stream: str, max_bytes: int) -> bytes | None:
        """Relay: the worker's next bytes on ``stream`` (see :meth:`.NodeEnds.pull`)."""
        return await self._relayed().pull(stream, max_bytes)

    async def push(self, stream: str, data: bytes) -> None:
        """Relay: ``data`` from the kernel, for the worker to read on ``stream``."""
        await self._relayed().push(stream, data)

    async def end(self, stream: str) -> None:
        """Relay: the kernel closed its end of ``stream``."""
        self._relayed().end(stream)

    def _relayed(self) -> _ray_relay.NodeEnds:
        if self._relay is None:
            raise RuntimeError("this rank's streams are not relayed (it reached the kernel)")
        return self._relay

    async def wait(self) -> int:
        """The worker's exit status once it exits (negative: a signal, as subprocess says)."""
        while self._popen is None or self._popen.poll() is None:
            await asyncio.sleep(0.05)
        if self._relay is not None:  # its last words first: they precede its exit
            loop = asyncio.get_running_loop()
            deadline = loop.time() + DRAIN_WAIT
            while not self._relay.drained() and loop.time() < deadline:
                await asyncio.sleep(0.05)
        return int(self._popen.returncode)

    async def signal(self, signum: int) -> None:
        """Send ``signum`` to the worker (and its own children, for SIGKILL)."""
        if self._popen is None or self._popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if signum == signal.SIGKILL:
                with contextlib.suppress(Exception):
                    import psutil

                    for child in psutil.Process(self._popen.pid).children(recursive=True):
                        child.kill()
            self._popen.send_signal(signum)


__all__ = ["RankHost"]
