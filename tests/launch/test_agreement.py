"""The comparison behind multi-node agreement (the real two-node runs are in
test_kernel_multinode.py)."""

from __future__ import annotations

import pytest

from nbaccel.config import LaunchConfig
from nbaccel.launch.channel._rendezvous import agree, compare
from nbaccel.launch.worker._worker import WorkerSpec


def test_compare_names_every_node_value():
    views = {
        0: {"world_size": "4", "torch_version": "2.6.0", "start_method": "fork"},
        1: {"world_size": "4", "torch_version": "2.7.1", "start_method": "spawn"},
    }
    assert compare(views) == [
        "start_method: node 0 has fork, node 1 has spawn",
        "torch_version: node 0 has 2.6.0, node 1 has 2.7.1",
    ]
    assert compare({0: {"a": "1"}, 1: {"a": "1"}}) == []


def test_agreement_over_a_real_store_reports_a_missing_node():
    import torch.distributed as dist

    from nbaccel.errors import LaunchError
    from nbaccel.launch.testing import find_free_port

    port = find_free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    config = LaunchConfig(num_nodes=2, master_port=port, timeout=1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    spec = WorkerSpec(0, 0, 2, 1, 0, config, env, "fork", round=3)
    with pytest.raises(LaunchError, match=r"node\(s\) \[1\] did not reach round 3"):
        agree(store, spec)
    # node 1 arrives in the same round with another world size: named on both sides
    store.set("nbaccel/agree/3/node1", '{"world_size": "3"}')
    with pytest.raises(LaunchError, match="world_size: node 0 has 2, node 1 has 3"):
        agree(store, spec)
