"""The launch's rendezvous on every torch the package claims (run on each matrix torch too).

The kernel reserves the listening socket and rank 0 serves torch's TCPStore on it
(``host_store``); the ``env://`` store that ``init_process_group`` creates later
must then reuse that server. torch 2.4-2.7's default (libuv) backend refuses a
handed-over socket, which broke every multi-process launch there.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch.distributed as dist

from nbaccel.launch.channel._rendezvous import Rendezvous, host_store

pytestmark = pytest.mark.integration
TIMEOUT = datetime.timedelta(seconds=10)


def test_host_store_serves_on_the_reserved_socket_quietly(capfd):
    rdzv = Rendezvous.reserve("127.0.0.1", None, num_nodes=1, node_rank=0)
    fd = rdzv.listen_fd()
    assert fd is not None
    fd = os.dup(fd)  # what rank 0 inherits; the kernel closes its own copy
    rdzv.close()
    store = host_store(fd, rdzv.store_host(), rdzv.port, 10)
    assert store is not None, "this torch could not adopt the reserved socket"
    client = dist.TCPStore("127.0.0.1", rdzv.port, None, False, TIMEOUT, wait_for_workers=False)
    client.set("nbaccel/test", "served")
    assert store.get("nbaccel/test") == b"served"
    # init_process_group("env://") on rank 0: a multi-tenant server store on the same port
    # must reuse the running server rather than fail to bind the port a second time.
    env_store = dist.TCPStore(
        "127.0.0.1", rdzv.port, None, True, TIMEOUT, wait_for_workers=False, multi_tenant=True
    )
    assert env_store.get("nbaccel/test") == b"served"
    # No C++ "[E ...] ... libuv ... listen fd" line reaches the notebook's output.
    assert "listen fd" not in capfd.readouterr().err


def _store_pair():
    rdzv = Rendezvous.reserve("127.0.0.1", None, num_nodes=1, node_rank=0)
    fd = os.dup(rdzv.listen_fd())
    rdzv.close()
    host = host_store(fd, rdzv.store_host(), rdzv.port, 10)
    client = dist.TCPStore("127.0.0.1", rdzv.port, None, False, TIMEOUT, wait_for_workers=False)
    return host, client


def test_leave_says_whether_every_rank_arrived(monkeypatch):
    import threading

    from nbaccel.launch.channel import _rendezvous

    assert _rendezvous.leave(None, is_host=True, world_size=1) is True  # nobody to wait for
    assert _rendezvous.leave(None, is_host=False, world_size=2) is False  # no barrier held
    host, client = _store_pair()
    seen: dict[str, bool] = {}
    peer = threading.Thread(
        target=lambda: seen.update(peer=_rendezvous.leave(client, is_host=False, world_size=2))
    )
    peer.start()
    seen["host"] = _rendezvous.leave(host, is_host=True, world_size=2)
    peer.join(10)
    assert seen == {"host": True, "peer": True}
    # a peer that never arrives: the barrier gives up after the grace and says so
    monkeypatch.setattr(_rendezvous, "EXIT_GRACE", 0.3)
    alone, _ = _store_pair()
    assert _rendezvous.leave(alone, is_host=True, world_size=2) is False
