"""The free-GPU facts and checks on a real GPU (issue 43): compute capability and
/dev/shm as nbaccel reads them (nvidia-smi, statvfs; CUDA untouched here), the bounded
peer-to-peer copy check run for real, and a launch's decisions on this machine."""

from __future__ import annotations

import os

from gpu_facts import cuda_facts, gpu_count, skip_for_hardware

from nbaccel.launch import _freegpus
from nbaccel.platform import gpufacts


def test_facts_agree_with_torch_and_the_file_system() -> None:
    facts = gpufacts.gpu_facts()
    probe = cuda_facts()
    assert facts.count >= gpu_count() >= 1, (facts, probe)
    assert list(facts.capabilities[0]) == list(probe["capability"][0]), (facts, probe)
    stat = os.statvfs("/dev/shm")
    assert facts.shm_bytes == stat.f_frsize * stat.f_blocks
    assert len(facts.p2p) == len(facts.nvlink) == facts.count, facts


def test_the_p2p_copy_check_runs_bounded_on_one_gpu() -> None:
    # (0, 0): the check's subprocess, device mapping and copy, within one GPU
    assert gpufacts.p2p_works([(0, 0)], timeout=120) is True


def test_the_p2p_copy_check_between_two_gpus_agrees_with_the_topology() -> None:
    facts = gpufacts.gpu_facts()
    if facts.count < 2:
        skip_for_hardware("needs two GPUs for a peer-to-peer copy")
    works = gpufacts.p2p_works([(0, 1)], timeout=120)
    if facts.nvlink[0][1]:
        assert works, facts  # NVLinked GPUs copy over their peer path


def test_this_machines_decisions_for_a_two_process_launch() -> None:
    facts = gpufacts.gpu_facts()
    decisions = _freegpus.decide(facts, nproc=2, gpu_ids=None, mixed_precision="bf16",
                                 compiles=False, environ={}, check=gpufacts.p2p_works)  # fmt: skip
    native_bf16 = facts.capabilities[0] >= (8, 0)
    assert (not any("bf16" in line for line in decisions.lines)) is native_bf16, decisions
    small_shm = (facts.shm_bytes or 0) < _freegpus.shm_needed(2)
    assert ("NCCL_SHM_DISABLE" in decisions.env) is small_shm, decisions
