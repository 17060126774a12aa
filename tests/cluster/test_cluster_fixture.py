"""The test cluster's start waits for events, never for Ray's fixed 30 s, and takes ports no
outgoing connection can take (issue 49).

A loaded machine made a node's raylet register with the GCS after ``ray start`` had given
up (30 s, fixed): here node b's raylet is held stopped until its ``ray start`` has given up,
on every try, and the cluster must still start, with node b listed alive. And a node's
raylet died at its start when a port chosen for it had meanwhile become an outgoing
connection's source port: the cluster's ports now come from outside the ephemeral range.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
from conftest import (
    HANG_GUARD_S,
    HEAD_IP,
    HEAD_ROOM_NICE,
    NODE_B_IP,
    RAY_CLIENT_SERVER_PORTS,
    LocalCluster,
    _ephemeral_ports,
    _free_ports,
    _is_raylet,
)

pytestmark = [pytest.mark.cluster, pytest.mark.integration]


def _ray_start_of(cluster: LocalCluster, name: str) -> list[psutil.Process]:
    found = []
    for proc in cluster.processes(str(cluster.root / name)):
        with contextlib.suppress(psutil.Error):
            cmd = proc.cmdline()
            if "start" in cmd and any(part.endswith("/ray") for part in cmd[:2]):
                found.append(proc)
    return found


def _hold_raylets_until_ray_start_gives_up(
    cluster: LocalCluster, stop: threading.Event
) -> list[int]:
    """Stops each raylet of node b as it appears and resumes it once the ``ray start`` that
    started it has exited: its registration comes after Ray's deadline, whatever the load."""
    held: list[int] = []
    while not stop.is_set():
        for raylet in cluster.processes(str(cluster.root / "b")):
            if raylet.pid in held or not _is_raylet(raylet):
                continue
            with contextlib.suppress(psutil.Error):
                raylet.suspend()
                held.append(raylet.pid)
                starters = _ray_start_of(cluster, "b")
                while not stop.is_set() and any(
                    p.is_running() and p.status() != "zombie" for p in starters
                ):
                    time.sleep(0.1)
                raylet.resume()
        time.sleep(0.02)
    return held


def _can_lower_session_nice() -> bool:
    probe = "open('/proc/self/autogroup', 'w').write('-1')"
    return subprocess.run([sys.executable, "-c", probe], start_new_session=True).returncode == 0


def _runs_a_task_on_node_b(cluster: LocalCluster) -> str:
    """The address a task placed on node b reports (from a fresh process: this one never
    imports Ray)."""
    probe = (
        "import sys, ray\n"
        "ray.init(address=sys.argv[1], _node_ip_address=sys.argv[2], log_to_driver=False)\n"
        "where = ray.remote(resources={'node_b': 0.01})(ray.util.get_node_ip_address)\n"
        "print(ray.get(where.remote()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, cluster.address, HEAD_IP], env=cluster.env,
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()[-1]


def test_a_node_that_registers_after_rays_deadline_still_joins():
    pytest.importorskip("ray", reason="needs the ray extra: pip install 'nbaccel[ray]'")
    cluster = LocalCluster()
    stop = threading.Event()
    held: list[int] = []
    holder = threading.Thread(
        target=lambda: held.extend(_hold_raylets_until_ray_start_gives_up(cluster, stop))
    )
    holder.start()
    try:
        cluster.start()
        stop.set()
        holder.join()
        assert len(held) == 1, held  # one try: the late node was waited for, not restarted
        assert cluster.late_nodes == ["b"]
        # each node started with head room (where Linux lets this process give it), and
        # competes as any other session once up
        if _can_lower_session_nice():
            assert cluster.head_room == {"head": HEAD_ROOM_NICE, "b": HEAD_ROOM_NICE}
        assert cluster._session_nice("head") == cluster._session_nice("b") == 0
        assert NODE_B_IP in cluster.alive_nodes()
        assert _runs_a_task_on_node_b(cluster) == NODE_B_IP  # a node, not only a listing
    finally:
        stop.set()
        holder.join()
        cluster.stop()
    assert not cluster.processes()


def test_the_clusters_ports_are_none_an_outgoing_connection_can_take():
    # a port found free by binding port 0 is an ephemeral one: any connection the suite
    # opens can take it as its source port before Ray binds it, and the raylet dies
    # ("Failed to start the grpc server"); a connection's source port is held here as one
    server = socket.create_server(("127.0.0.1", 0))
    clients = [socket.create_connection(server.getsockname()) for _ in range(50)]
    try:
        held = {c.getsockname()[1] for c in clients}
        ports = _free_ports(9)
        assert len(set(ports)) == 9
        assert not [p for p in ports if p in _ephemeral_ports()], ports
        assert not [p for p in ports if p in RAY_CLIENT_SERVER_PORTS], ports
        assert not held & set(ports)
        for port in ports:  # free on every address, as Ray's gRPC servers bind them
            with socket.socket() as probe:
                probe.bind(("0.0.0.0", port))
    finally:
        for c in clients:
            c.close()
        server.close()
