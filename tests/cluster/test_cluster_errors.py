"""Errors said before anything starts: Ray missing, the cluster unreachable. No cluster
needed (nothing may be placed: these fail first)."""

from __future__ import annotations

import socket
import sys

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
