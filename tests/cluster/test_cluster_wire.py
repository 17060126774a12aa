"""The cluster channel's door: nothing is unpickled before the launch's secret is proven.

Real sockets on 127.0.0.1 (and 127.0.0.2: loopback, any address of 127/8); no Ray needed.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import struct
import threading
import time

import pytest
from waits import HANG_GUARD_S

from nbaccel.errors import LaunchError
from nbaccel.launch.channel import _cluster_wire
from nbaccel.launch.channel._wire import HEADER, Channel

SECRET = b"s" * 32


class _Marker:
    """Unpickling this creates the file at ``path``: proof that someone unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _refused(listener, count: int) -> bool:
    """Whether ``listener`` counted ``count`` refusals: each connection is checked in a
    thread of its own, so the rank's may pass and be taken before the stranger's thread
    has counted (a CI run on a loaded machine saw 0); waited for, never timed."""
    deadline = time.monotonic() + HANG_GUARD_S
    while listener.refused < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return listener.refused == count


def _rank_connects(address, secret, result):
    try:
        result.append(_cluster_wire.connect(address, secret, {"rank": 0, "stream": "channel"}))
    except BaseException as err:  # the test reads it
        result.append(err)


def test_a_stranger_is_refused_before_anything_is_unpickled(tmp_path):
    marker = str(tmp_path / "unpickled")
    listener = _cluster_wire.AuthListener("127.0.0.1", secret=SECRET, timeout=120)
    try:
        # the stranger speaks first: a channel frame, and a hello-sized pickle, then leaves
        payload = pickle.dumps(_Marker(marker))
        with socket.create_connection(listener.address) as stranger:
            # the kernel may refuse and close before the stranger is done talking (a CI run:
            # ENOTCONN at the shutdown): what the stranger is told does not matter here
            with contextlib.suppress(OSError):
                stranger.sendall(HEADER.pack(len(payload)) + payload)
                stranger.sendall(struct.pack("!I", len(payload)) + payload)
                stranger.shutdown(socket.SHUT_WR)
            got = []
            rank = threading.Thread(target=_rank_connects, args=(listener.address, SECRET, got))
            rank.start()
            sock, hello = listener.accept()
            rank.join()
        assert _refused(listener, 1)
        assert hello["rank"] == 0 and hello["stream"] == "channel"
        assert hello["nbaccel"] == _cluster_wire.versions()["nbaccel"]
        # the accepted connection is a working channel: a pickle from the real rank arrives
        theirs = got[0]
        assert isinstance(theirs, socket.socket)
        Channel(theirs).send({"step": 1})
        assert Channel(sock).next() == {"step": 1}
        sock.close()
        theirs.close()
    finally:
        listener.close()
    assert not os.path.exists(marker)


def test_a_wrong_secret_gets_no_connection():
    listener = _cluster_wire.AuthListener("127.0.0.1", secret=SECRET, timeout=120)
    try:
        got: list = []
        wrong = threading.Thread(target=_rank_connects, args=(listener.address, b"w" * 32, got))
        wrong.start()
        wrong.join()  # refused: its challenge fails on both sides
        right = threading.Thread(target=_rank_connects, args=(listener.address, SECRET, got))
        right.start()
        sock, _ = listener.accept()
        right.join()
        sock.close()
        assert _refused(listener, 1)
        errors = [g for g in got if isinstance(g, BaseException)]
        socks = [g for g in got if isinstance(g, socket.socket)]
        assert len(errors) == 1 and len(socks) == 1
        socks[0].close()
    finally:
        listener.close()


def test_a_silent_stranger_delays_no_rank():
    """Ordered by events, not timed: the rank is taken while the stranger, connected
    before it and silent, is still being challenged (not yet refused). A door that checked
    connections one after another would let the rank in only once the stranger's challenge
    had timed out (AUTH_TIMEOUT) and been counted as refused, however fast the machine."""
    listener = _cluster_wire.AuthListener("127.0.0.1", secret=SECRET, timeout=120)
    try:
        with socket.create_connection(listener.address):  # connects, never answers
            got: list = []
            rank = threading.Thread(target=_rank_connects, args=(listener.address, SECRET, got))
            rank.start()
            # past the stranger's challenge timeout: a serial door fails the next assertion,
            # not this wait
            sock, hello = listener.accept(time.monotonic() + 3 * _cluster_wire.AUTH_TIMEOUT)
            pending = listener.refused
            rank.join()
            assert hello["rank"] == 0
            assert pending == 0, "the rank got in only after the silent stranger was refused"
            sock.close()
            got[0].close()
        assert _refused(listener, 1)  # the stranger, once gone, is refused
    finally:
        listener.close()


def test_listens_on_the_given_address_only():
    """Bound to 127.0.0.2 (not the default, not every address): it says so, and the same
    port on 127.0.0.1 has no listener (a socket bound to 0.0.0.0 would answer there)."""
    listener = _cluster_wire.AuthListener("127.0.0.2", secret=SECRET, timeout=1)
    try:
        host, port = listener.address
        assert host == "127.0.0.2"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()


def test_another_install_on_the_node_is_one_error_naming_both():
    ours = _cluster_wire.versions()
    with pytest.raises(LaunchError) as caught:
        _cluster_wire.check_versions({**ours, "torch": "1.0.0"}, "node 10.0.0.2, rank 1")
    text = str(caught.value)
    assert ours["torch"] in text and "1.0.0" in text and "node 10.0.0.2" in text
    _cluster_wire.check_versions(dict(ours), "here")  # the same install: no error


def test_a_short_secret_is_refused():
    with pytest.raises(ValueError, match="16 random bytes"):
        _cluster_wire.AuthListener("127.0.0.1", secret=b"short", timeout=1)


def _keepalive(sock: socket.socket) -> tuple[int, ...]:
    """SO_KEEPALIVE and the idle, interval and count times, as the kernel reports them."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE)] + [
        (socket.IPPROTO_TCP, getattr(socket, name))
        for name in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT")
    ]
    return tuple(sock.getsockopt(level, option) for level, option in options)


@pytest.mark.skipif(not hasattr(socket, "TCP_KEEPIDLE"), reason="Linux's keepalive options")
def test_both_ends_of_a_rank_connection_keep_alive():
    # a warm pool's channel may stay silent for hours: a NAT in between forgets it, or the
    # peer vanishes without a word, unless the connection says it is alive
    listener = _cluster_wire.AuthListener("127.0.0.1", secret=SECRET, timeout=120)
    result: list = []
    thread = threading.Thread(target=_rank_connects, args=(listener.address, SECRET, result))
    thread.start()
    try:
        kernel_end, _ = listener.accept()
        thread.join()
        rank_end = result[0]
        assert isinstance(rank_end, socket.socket), result
        wanted = (1, *_cluster_wire.KEEPALIVE)
        assert _keepalive(kernel_end) == wanted and _keepalive(rank_end) == wanted
        assert wanted[1] <= 120 and wanted[1] + wanted[2] * wanted[3] <= 300  # minutes, not hours
        kernel_end.close()
        rank_end.close()
    finally:
        listener.close()


def test_a_refused_connection_is_unreachable_at_once():
    # nothing listens there: the node learns it from the refusal, not from a timeout
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = probe.getsockname()
    with pytest.raises(_cluster_wire.Unreachable, match="ConnectionRefusedError"):
        _cluster_wire.connect(address, SECRET, {"rank": 0, "stream": "channel"}, reach_wait=600)
