"""Nodes unlike the kernel's machine (issue 51): facts read on each node, decisions per node.

A cluster of its own (conftest's ``LocalCluster``, two ``ray start`` nodes on loopback)
whose node b has a stand-in ``nvidia-smi`` on its ``PATH`` (two Tesla T4s, no NVLink, no
peer-to-peer path) and ``--num-gpus=2``; the kernel's machine has no GPU. Each rank says
the plan it received (device, threads, GPUs, NCCL settings) and returns before touching
CUDA; on the CPU the ranks then train to the end. Every test ends with nothing left on
the cluster.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import HEAD_IP, NODE_B_IP, RAY_ENV, LocalCluster, wait_until
from kernel_harness import KernelSession, isolated_env
from test_cluster_kernel import CONNECT, IMPORTS

pytestmark = [pytest.mark.cluster, pytest.mark.kernel, pytest.mark.integration]

STAND_IN_SMI = """#!/bin/sh
# nvidia-smi as two Tesla T4s without NVLink or a peer-to-peer path would answer
case "$*" in
  *--query-gpu*) printf 'Tesla T4, 7.5\\nTesla T4, 7.5\\n' ;;
  *"topo -p2p r"*) printf ' \\tGPU0\\tGPU1\\t\\nGPU0\\tX\\tNS\\t\\nGPU1\\tNS\\tX\\t\\n' ;;
  *"topo -m"*) printf '\\tGPU0\\tGPU1\\tCPU Affinity\\nGPU0\\t X \\tPHB\\t0-1\\nGPU1\\tPHB\\t X \\t0-1\\n' ;;
  *) exit 1 ;;
esac
"""

PLANNED = """
import nbaccel.platform.environment as _environment
import nbaccel.platform.gpufacts as _gpufacts
from nbaccel import LaunchConfig
from nbaccel.platform.gpufacts import GpuFacts

KEYS = ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "GROUP_RANK", "OMP_NUM_THREADS",
        "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "ACCELERATE_USE_CPU")

def planned():
    from nbaccel.config.precedence import installed_launch_config
    return {"env": {k: os.environ.get(k) for k in KEYS}, "threads": torch.get_num_threads(),
            "device": installed_launch_config().compute_device}

def train_where(steps):
    return [train(steps).tolist(), os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"]]

def with_kernel_gpus(run):
    # this machine as a 4-GPU one with NVLink and a 64 MB /dev/shm: none of it may reach a node
    facts = GpuFacts(("A100",) * 4, ((8, 0),) * 4, ((True,) * 4,) * 4, ((True,) * 4,) * 4, 64 << 20)
    saved = _gpufacts.gpu_facts, _environment.gpu_count
    _gpufacts.gpu_facts, _environment.gpu_count = (lambda: facts), (lambda: 4)
    try:
        return run()
    finally:
        _gpufacts.gpu_facts, _environment.gpu_count = saved
"""


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    pytest.importorskip("ray", reason="needs the ray extra: pip install 'nbaccel[ray]'")
    bin_dir = tmp_path_factory.mktemp("standin")
    smi = bin_dir / "nvidia-smi"
    smi.write_text(STAND_IN_SMI)
    smi.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    with LocalCluster(node_b_args=("--num-gpus=2",), node_b_env=env) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> Iterator[KernelSession]:
    workdir: Path = tmp_path_factory.mktemp("nodes-kernel")
    session = KernelSession(cwd=workdir, env={**isolated_env(workdir), **RAY_ENV})
    session.start()
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="module")
def connected(kernel, gpu_cluster) -> KernelSession:
    kernel.run(IMPORTS, timeout=180)
    kernel.run(CONNECT.format(address=gpu_cluster.address, ip=HEAD_IP), timeout=180)
    kernel.run(PLANNED, timeout=60)
    return kernel


@pytest.fixture(autouse=True)
def _left_clean(connected: KernelSession) -> Iterator[None]:
    yield
    assert not connected.busy and connected.is_alive(), "the kernel was left busy or died"
    empty = {"groups": 0, "actors": 0}
    assert wait_until(lambda: connected.evaluate_json("left_on_cluster()") == empty)
    connected.assert_no_descendants(timeout=5)


def _cores() -> int:
    from nbaccel.platform.environment import cpu_count

    return cpu_count()


def test_threads_per_rank_follow_each_nodes_cores_and_cpus_per_rank(connected):
    # each node was started with --num-cpus=2, one rank each: 2 threads (its usable cores /
    # its ranks, read there), reserved as 2 CPUs by the rank's actor; cpus_per_rank=1: 1
    expected = min(2, _cores())
    if expected < 2:
        pytest.skip("needs 2 cores to tell 2 threads from 1")
    ranks = connected.evaluate_json(
        "notebook_launcher(planned, num_processes=1, num_nodes=2, cluster='ray',"
        " return_all_ranks=True)",
        timeout=300,
    )
    assert [r["threads"] for r in ranks] == [2, 2], ranks
    assert [r["env"]["OMP_NUM_THREADS"] for r in ranks] == ["2", "2"], ranks
    # 'auto' with GPUs on one node of the two: the CPU on both, said; Accelerate told so
    assert [r["device"] for r in ranks] == ["cpu", "cpu"], ranks
    assert [r["env"]["ACCELERATE_USE_CPU"] for r in ranks] == ["true", "true"], ranks
    ranks = connected.evaluate_json(
        "notebook_launcher(planned, num_processes=1, num_nodes=2, cluster='ray',"
        " cpus_per_rank=1, return_all_ranks=True)",
        timeout=300,
    )
    assert [(r["threads"], r["env"]["OMP_NUM_THREADS"]) for r in ranks] == [(1, "1")] * 2


def test_a_bad_cpus_per_rank_is_refused_naming_the_argument(connected):
    cell = connected.execute(
        "notebook_launcher(planned, num_processes=1, num_nodes=2, cluster='ray', cpus_per_rank=0)",
        timeout=120,
    )
    assert cell.error is not None and "cpus_per_rank=0" in cell.error.evalue, cell.error


def test_the_first_error_names_its_rank_and_node(connected):
    ids = connected.evaluate_json("node_ids()")
    cell = connected.execute(
        "notebook_launcher(train, (1, 1), num_processes=1, num_nodes=2, cluster='ray')",
        timeout=300,
    )
    assert cell.error is not None and cell.error.ename == "ValueError", cell.error
    text = "\n".join(cell.error.traceback)
    assert "bad batch on rank 1" in text, text
    assert "rank 1 (pid " in text and f"on node {NODE_B_IP} ({ids[NODE_B_IP][:8]})" in text, text


def test_a_local_launch_in_a_ray_driver_spawns_and_ray_still_answers(connected):
    # A fork of a kernel connected to Ray leaves Ray's gRPC connection in the kernel stuck:
    # in a whole run the launch after a forked local one waited for ever in ray.nodes()
    # (ray-project/ray#59661). 'auto' spawns there, said once; an explicit 'fork' is refused.
    connected.run(
        "def started_as():\n"
        "    import psutil\n"
        "    return 'spawned' if 'spawn_main' in ' '.join(psutil.Process().cmdline()) else 'forked'"
    )
    cell = connected.execute(
        "how = notebook_launcher(started_as, num_processes=2, return_all_ranks=True)", timeout=600
    )
    assert cell.error is None, cell.error
    assert connected.evaluate_json("how") == ["spawned", "spawned"]
    said = "workers are spawned, not forked: this kernel is connected to Ray"
    assert cell.stderr.count(said) == 1, cell.stderr
    assert len(connected.evaluate_json("node_ids()", timeout=600)) == 2  # Ray answers
    cell = connected.execute(
        "notebook_launcher(started_as, num_processes=2, start_method='fork')", timeout=600
    )
    assert cell.error is not None and cell.error.ename == "ConfigError", cell.error
    assert "start_method='fork'" in cell.error.evalue and "Ray" in cell.error.evalue
    again = connected.execute("notebook_launcher(started_as, num_processes=2)", timeout=600)
    assert again.error is None and said not in again.stderr, again.stderr  # once per kernel


def test_two_nodes_of_two_ranks_train_bit_equal_to_four_local_processes(connected):
    connected.run(
        "local = notebook_launcher(train, (3,), num_processes=4, return_all_ranks=True)\n"
        "remote = notebook_launcher(train_where, (3,), num_processes=2, num_nodes=2,"
        " cluster='ray', return_all_ranks=True)\n"
        "same = [a.tolist() == b[0] for a, b in zip(local, remote)]",
        timeout=600,
    )
    assert connected.evaluate_json("same") == [True] * 4
    where = connected.evaluate_json("[r[1:] for r in remote]")
    assert where == [["0", "0"], ["1", "0"], ["0", "1"], ["1", "1"]], where  # LOCAL, GROUP


def test_a_gpu_node_plans_its_ranks_from_its_own_facts_not_the_kernels(connected):
    # the kernel: no GPU, then shown as 4 NVLinked GPUs with a 64 MB /dev/shm; node b: two
    # T4s without a peer path. 'auto' and 'gpu' pick node b; its ranks get its GPUs, in
    # order, NCCL_P2P_DISABLE from its facts, nothing of the kernel's (no ACCELERATE_USE_CPU,
    # no NCCL_SHM_DISABLE), and its cores / its 2 ranks as threads
    for device in ("auto", "gpu"):
        ranks = connected.evaluate_json(
            "with_kernel_gpus(lambda: notebook_launcher(planned, num_processes=2, num_nodes=1,"
            f" cluster='ray', config=LaunchConfig(compute_device={device!r}),"
            " return_all_ranks=True))",
            timeout=300,
        )
        threads = str(max(1, min(2, _cores()) // 2))
        assert [r["env"] for r in ranks] == [
            {"CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_RANK": str(local), "GROUP_RANK": "0",
             "OMP_NUM_THREADS": threads, "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": None,
             "ACCELERATE_USE_CPU": None}
            for local in (0, 1)
        ], (device, ranks)  # fmt: skip
        assert [r["device"] for r in ranks] == ["gpu", "gpu"], ranks


def test_a_node_with_fewer_gpus_than_its_ranks_is_refused_by_name(connected):
    ids = connected.evaluate_json("node_ids()")
    cell = connected.execute(
        "notebook_launcher(planned, num_processes=1, num_nodes=2, cluster='ray',"
        " config=LaunchConfig(compute_device='gpu'))",
        timeout=300,
    )
    assert cell.error is not None and cell.error.ename == "LaunchError", cell.error
    text = cell.error.evalue
    assert f"node {HEAD_IP} ({ids[HEAD_IP][:8]}): 0 GPU(s) for 1 rank(s)" in text, text
    assert "1 of its 2 live node(s)" in text, text
