"""The free-GPU facts and checks on a real GPU (issue 43): compute capability and
/dev/shm as nbaccel reads them (nvidia-smi, statvfs; CUDA untouched here), the bounded
peer-to-peer copy check run for real, and a launch's decisions on this machine."""

from __future__ import annotations

import os

from gpu_facts import cuda_facts, gpu_count, skip_for_hardware

from nbaccel.launch.start import _freegpus
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
    """The launch's peer-to-peer decision on this machine's first two GPUs, the copy run
    for real. Without NVLink (the 2xT4 case the check is for) the copy decides:
    ``NCCL_P2P_DISABLE=1`` exactly when it fails; with no peer path reported, disabled
    without a copy; with NVLink, nothing set and the copy works."""
    facts = gpufacts.gpu_facts()
    if facts.count < 2:
        skip_for_hardware("needs two GPUs for a peer-to-peer copy")
    copies: list[bool] = []

    def check(pairs: list[tuple[int, int]]) -> bool:
        copies.append(gpufacts.p2p_works(pairs, timeout=120))
        return copies[-1]

    env, line = _freegpus.p2p_decision(facts, [0, 1], {}, check)
    if facts.nvlink[0][1]:
        assert env == {} and line is None and not copies, (facts, env, line)
        assert gpufacts.p2p_works([(0, 1)], timeout=120), facts  # NVLinked GPUs copy
    elif facts.p2p[0][1] is False or facts.p2p[1][0] is False:
        assert env == {"NCCL_P2P_DISABLE": "1"} and not copies, (facts, env)
        assert line is not None and "no peer-to-peer path" in line, line
    else:
        assert len(copies) == 1, (facts, copies)  # no NVLink, a peer path: the copy decides
        assert (env == {"NCCL_P2P_DISABLE": "1"}) is (not copies[0]), (facts, copies, env)
        assert (line is not None and "a copy between them" in line) is (not copies[0]), line


def test_this_machines_decisions_for_a_two_process_launch() -> None:
    facts = gpufacts.gpu_facts()
    decisions = _freegpus.decide(facts, nproc=2, gpu_ids=None, mixed_precision="bf16",
                                 compiles=False, environ={}, check=gpufacts.p2p_works)  # fmt: skip
    native_bf16 = facts.capabilities[0] >= (8, 0)
    assert (not any("bf16" in line for line in decisions.lines)) is native_bf16, decisions
    small_shm = (facts.shm_bytes or 0) < _freegpus.shm_needed(2)
    assert ("NCCL_SHM_DISABLE" in decisions.env) is small_shm, decisions
