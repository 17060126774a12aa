"""GPU facts read without CUDA: nvidia-smi's matrices parsed, /dev/shm measured, nothing
run on a machine without an NVIDIA driver."""

from __future__ import annotations

import os

import pytest

from nbaccel.platform import environment, gpufacts

# `nvidia-smi topo -m` on two T4s without NVLink (Kaggle), and on NVLinked H100s
TOPO_T4 = """\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tPHB\t0-3\t0\t\tN/A
GPU1\tPHB\t X \t0-3\t0\t\tN/A

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""
TOPO_NVLINK = "\tGPU0\tGPU1\nGPU0\t X \tNV18\nGPU1\tNV18\t X \n"
P2P_READ = "\tGPU0\tGPU1\t\n GPU0\tX\tNS\t\n GPU1\tNS\tX\t\n\nLegend:\n  OK: Status Ok\n"


def test_topology_matrices_parse_to_gpu_by_gpu_cells() -> None:
    assert gpufacts.parse_matrix(TOPO_T4) == [["X", "PHB"], ["PHB", "X"]]
    assert gpufacts.parse_matrix(TOPO_NVLINK) == [["X", "NV18"], ["NV18", "X"]]
    # topo -p2p r indents its rows by one space: read as rows too
    assert gpufacts.parse_matrix(P2P_READ) == [["X", "NS"], ["NS", "X"]]
    assert gpufacts.parse_matrix("\tGPU0\tCPU Affinity\nGPU0\t X \t0-3\n") == [["X"]]


def test_dev_shm_size_is_its_file_system_size() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this system")
    stat = os.statvfs("/dev/shm")
    assert gpufacts.shm_size() == stat.f_frsize * stat.f_blocks > 0
    assert gpufacts.shm_size("/no/such/folder") is None


def test_no_driver_means_no_gpus_and_no_subprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(environment, "_NVIDIA_DRIVER_FILES", ("/no/such/driver",))
    monkeypatch.setattr(gpufacts, "_smi", lambda *a: pytest.fail(f"nvidia-smi {a} was run"))
    gpufacts.gpu_facts.cache_clear()
    try:
        facts = gpufacts.gpu_facts()
    finally:
        gpufacts.gpu_facts.cache_clear()
    assert facts.count == 0 and facts.shm_bytes == gpufacts.shm_size()


def test_facts_from_nvidia_smi_output(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {
        "--query-gpu=name,compute_cap": "Tesla T4, 7.5\nTesla T4, 7.5\n",
        "-p2p": P2P_READ.replace("NS", "OK"),
        "-m": TOPO_T4,
    }
    monkeypatch.setattr(environment, "_NVIDIA_DRIVER_FILES", ("/",))  # a driver "exists"
    monkeypatch.setattr(gpufacts, "_smi", lambda *a: answers[a[0] if a[0] != "topo" else a[1]])
    gpufacts.gpu_facts.cache_clear()
    try:
        facts = gpufacts.gpu_facts()
    finally:
        gpufacts.gpu_facts.cache_clear()
    assert facts.names == ("Tesla T4", "Tesla T4") and facts.capabilities == ((7, 5), (7, 5))
    assert facts.nvlink == ((False, False), (False, False))
    assert facts.p2p == ((False, True), (True, False))  # X on the diagonal is not a path


def test_the_p2p_check_with_no_pairs_runs_nothing() -> None:
    assert gpufacts.p2p_works([]) is True
