"""Errors said before anything starts: Ray missing, the cluster unreachable. No cluster
needed (nothing may be placed: these fail first)."""

from __future__ import annotations

import importlib.machinery
import socket
import sys
import types

import pytest

from nbaccel import LaunchConfig, notebook_launcher
from nbaccel.errors import ConfigError, LaunchError

pytestmark = [pytest.mark.cluster]


def _unused_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


def test_ray_missing_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # how Python says "not installed"
    with pytest.raises(ConfigError, match=r"pip install 'nbaccel\[ray\]'"):
        notebook_launcher(print, ("x",), num_processes=1, num_nodes=2, cluster="ray")


def test_an_unreachable_cluster_names_the_address_tried():
    pytest.importorskip("ray", reason="needs the ray extra: pip install 'nbaccel[ray]'")
    address = f"127.0.0.2:{_unused_loopback_port()}"
    with pytest.raises(LaunchError, match=f"could not reach the Ray cluster at '{address}'"):
        notebook_launcher(print, ("x",), num_processes=1, num_nodes=2, cluster=address)


@pytest.mark.parametrize("bad", ["", "  ", 3])
def test_a_malformed_cluster_setting_is_refused(bad):
    with pytest.raises(ConfigError, match="cluster="):
        LaunchConfig(cluster=bad)


def test_the_cluster_setting_needs_no_master_port_for_several_nodes():
    cfg = LaunchConfig(num_nodes=2, cluster="ray")
    assert cfg.master_port is None and cfg.cluster == "ray"
    with pytest.raises(ConfigError, match="master_port"):
        LaunchConfig(num_nodes=2)  # without a cluster the nodes must agree on a port


def _ray_whose_init_raises(monkeypatch, error: Exception) -> list[str]:
    """A stand-in ``ray`` module (no cluster: what is tested is nbaccel's handling of what
    ``ray.init`` raised) whose ``init`` raises ``error``; returns the addresses tried."""
    tried: list[str] = []

    def init(address: str, **_: object) -> None:
        tried.append(address)
        raise error

    ray = types.ModuleType("ray")
    ray.__spec__ = importlib.machinery.ModuleSpec("ray", None)
    ray.is_initialized = lambda: False
    ray.init = init
    monkeypatch.setitem(sys.modules, "ray", ray)
    return tried


def test_a_ray_client_server_dying_at_every_start_is_tried_three_times_and_said(monkeypatch):
    from nbaccel.launch.start.cluster import _cluster_place

    died = ConnectionAbortedError("Initialization failure from server:\nProxy failed")
    tried = _ray_whose_init_raises(monkeypatch, died)
    with socket.socket() as head:  # something answers the address: it is reachable
        head.bind(("127.0.0.2", 0))
        head.listen()
        cluster = f"ray://127.0.0.2:{head.getsockname()[1]}"
        with pytest.raises(LaunchError, match=r"tried 3 times.*ray-project/ray#63202"):
            _cluster_place.connect(cluster)
    assert tried == [cluster] * 3


def test_any_other_ray_init_error_is_said_at_once(monkeypatch):
    from nbaccel.launch.start.cluster import _cluster_place

    tried = _ray_whose_init_raises(monkeypatch, ConnectionAbortedError("version mismatch"))
    with socket.socket() as head:
        head.bind(("127.0.0.2", 0))
        head.listen()
        cluster = f"ray://127.0.0.2:{head.getsockname()[1]}"
        with pytest.raises(LaunchError, match="version mismatch") as said:
            _cluster_place.connect(cluster)
    assert "tried" not in str(said.value)
    assert tried == [cluster]
