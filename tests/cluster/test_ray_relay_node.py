"""The node's side of a relayed rank (:class:`NodeEnds`): real socket pairs, no Ray needed.

What the rank's actor answers the kernel's threads: the worker's bytes as soon as there are
some, ``None`` when a pull waited :data:`PULL_WAIT` without any, ``b""`` at the end (and then
``drained``); the kernel's bytes to the worker in order; the kernel's close as an end.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from nbaccel.launch.channel._ray_relay import CHUNK, STREAMS, NodeEnds


def test_a_pull_answers_bytes_then_none_while_idle_then_the_end():
    async def scenario():
        node = NodeEnds()
        worker = node.worker
        worker["stdout"].sendall(b"line\n")
        first = await node.pull("stdout", CHUNK)
        idle = await node.pull("stdout", CHUNK)  # nothing written: answered, not held
        for sock in worker.values():
            sock.close()  # the worker exits
        ends = [await node.pull(stream, CHUNK) for stream in STREAMS]
        node.close()
        return first, idle, ends, node.drained()

    first, idle, ends, drained = asyncio.run(scenario())
    assert (first, idle, ends, drained) == (b"line\n", None, [b"", b"", b""], True)


def test_the_kernels_bytes_reach_the_worker_in_order_and_its_close_is_an_end():
    async def scenario():
        node = NodeEnds()
        channel = node.worker["channel"]
        channel.setblocking(False)
        big = bytes(range(256)) * 4096  # more than a socket buffer: push waits for reads
        loop = asyncio.get_running_loop()

        async def read_all() -> bytes:
            got = bytearray()
            while chunk := await loop.sock_recv(channel, CHUNK):
                got += chunk
            return bytes(got)

        reader = asyncio.ensure_future(read_all())
        await node.push("channel", big)
        await node.push("channel", b"tail")
        node.end("channel")  # the kernel closed its end: the worker reads the end
        received = await reader
        node.close()
        return big + b"tail", received, node.drained()

    sent, received, drained = asyncio.run(scenario())
    assert received == sent
    assert drained is False  # the worker's own streams were not pulled to their end


def test_an_unknown_stream_is_refused():
    async def scenario():
        node = NodeEnds()
        try:
            await node.pull("stdin", CHUNK)
        finally:
            node.close()

    with pytest.raises(ValueError, match="stdin"):
        asyncio.run(scenario())


def test_the_worker_ends_are_closed_once_handed():
    node = NodeEnds()
    ends = list(node.worker.values())
    node.handed()
    assert node.worker == {} and all(sock.fileno() == -1 for sock in ends)
    assert all(isinstance(sock, socket.socket) for sock in ends)
    node.close()
