"""Per-node decisions from a node's own facts (no cluster: the pure part of
``_cluster_nodes``)."""

from __future__ import annotations

import pytest

from nbaccel import LaunchConfig
from nbaccel.errors import ConfigError
from nbaccel.launch.start.cluster._cluster_nodes import (
    NodeFacts,
    decide_node,
    gpu_env,
    threads_per_rank,
    why_not,
)
from nbaccel.platform.gpufacts import GpuFacts

pytestmark = [pytest.mark.cluster]

T4S = GpuFacts(("Tesla T4",) * 2, ((7, 5),) * 2, ((False, False),) * 2, ((False, False),) * 2,
               shm_bytes=64 << 20)  # fmt: skip


def _node(**kw) -> NodeFacts:
    return NodeFacts(**{"node_id": "f" * 56, "ip": "10.0.0.3", "cores": 64, "cpus": 64.0, **kw})


def test_threads_are_the_nodes_usable_cores_over_its_ranks_unless_set():
    assert threads_per_rank(_node(), 8, None) == 8
    assert threads_per_rank(_node(cores=64, cpus=16.0), 4, None) == 4  # Ray lends 16
    assert threads_per_rank(_node(cores=2, cpus=2.0), 4, None) == 1  # never 0
    assert threads_per_rank(_node(), 8, 3) == 3


def test_a_gpu_node_gets_its_own_nccl_settings_and_no_cpu_flag():
    plan = decide_node(_node(ray_gpus=2.0, gpu=T4S), ranks=2, cpus_per_rank=None, device="gpu")
    assert plan.env == {"OMP_NUM_THREADS": "32", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    assert plan.bundle() == {"CPU": 64.0, "GPU": 2.0, "node:10.0.0.3": 0.001}
    assert all("on node 10.0.0.3 (ffffffff)" in line for line in plan.lines), plan.lines
    cpu = decide_node(_node(), ranks=2, cpus_per_rank=1, device="cpu")
    assert cpu.env == {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"} and not cpu.gpus


def test_a_node_says_why_it_cannot_hold_the_ranks():
    assert why_not(_node(ray_gpus=2.0, gpu=T4S), 2, None, gpu=True) is None
    assert "1 GPU(s) for 2 rank(s)" in why_not(_node(ray_gpus=1.0, gpu=T4S), 2, None, gpu=True)
    assert "64 CPU(s) for 2 rank(s) x 40" in why_not(_node(), 2, 40, gpu=False)


def test_a_nodes_ranks_see_all_its_lent_gpus_in_order():
    assert gpu_env([["3"], ["1"]]) == {"CUDA_VISIBLE_DEVICES": "1,3"}
    assert gpu_env([[], []]) == {}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_cpus_per_rank_must_be_a_positive_int(bad):
    with pytest.raises(ConfigError, match=rf"cpus_per_rank={bad!r} must be an int >= 1"):
        LaunchConfig(cluster="ray", cpus_per_rank=bad)


def test_gpu_ids_are_refused_with_a_cluster():
    from nbaccel.launch.start._preflight import check_cluster_gpu_ids

    with pytest.raises(ConfigError, match="gpu_ids='0,1' picks GPUs of this machine"):
        check_cluster_gpu_ids(LaunchConfig(cluster="ray", num_nodes=2, gpu_ids="0,1"))
