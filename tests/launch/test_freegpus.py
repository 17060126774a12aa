"""Free GPUs handled before anything starts: each decision a pure function of simulated
GPU facts, then real launches (gloo, two processes) where the facts say T4s: the line in the
cell's stderr, the variable in the workers' environment, the user's own setting winning."""

from __future__ import annotations

import os

import pytest

from nbaccel import notebook_launcher
from nbaccel.errors import ConfigError
from nbaccel.launch.start import _freegpus
from nbaccel.launch.start._freegpus import (
    compiles,
    decide,
    p2p_decision,
    precision_line,
    shm_decision,
)
from nbaccel.platform import gpufacts
from nbaccel.platform.gpufacts import GpuFacts

YES, NO = (True, True), (False, False)
T4X2 = GpuFacts(("Tesla T4", "Tesla T4"), ((7, 5), (7, 5)), (YES, YES), (NO, NO), 64 << 20)
H100X2 = GpuFacts(("H100", "H100"), ((9, 0), (9, 0)), (YES, YES), (YES, YES), 64 << 30)
NEVER = lambda pairs: pytest.fail("the P2P check ran")  # noqa: E731


def test_bf16_before_compute_capability_8_names_fp16_and_gradscaler() -> None:
    line = precision_line(T4X2, [0, 1], "bf16", compiles=False)
    assert line is not None and "Tesla T4 (compute capability 7.5)" in line
    assert "mixed_precision='fp16'" in line and "GradScaler" in line
    assert precision_line(H100X2, [0, 1], "bf16", compiles=True) is None
    assert precision_line(T4X2, [0, 1], "fp16", compiles=True) is None
    with pytest.raises(ConfigError, match=r"pytorch#118122.*mixed_precision='fp16'"):
        precision_line(T4X2, [0], "bf16", compiles=True)


def test_compile_is_read_from_the_function_bytecode() -> None:
    import torch

    def compiled(model):
        return torch.compile(model)

    def nested():
        def inner():
            from nbaccel import Accelerator

            return Accelerator(dynamo_backend="inductor")

        return inner

    def plain(model):
        import re

        return re.compile("x"), model

    assert compiles(compiled) and compiles(nested) and not compiles(plain)


def test_p2p_checked_only_without_nvlink_and_disabled_when_it_fails() -> None:
    assert p2p_decision(H100X2, [0, 1], {}, NEVER) == ({}, None)  # NVLink: nothing to check
    asked = []
    env, line = p2p_decision(T4X2, [0, 1], {}, lambda pairs: asked.append(pairs) or False)
    assert asked == [[(0, 1)]] and env == {"NCCL_P2P_DISABLE": "1"}
    assert line is not None and "GPUs 0,1" in line and "NCCL_P2P_DISABLE=1" in line
    assert p2p_decision(T4X2, [0, 1], {}, lambda pairs: True) == ({}, None)  # a good path
    no_path = GpuFacts(T4X2.names, T4X2.capabilities, (NO, NO), (NO, NO))
    env, line = p2p_decision(no_path, [0, 1], {}, NEVER)  # the driver says: no peer path
    assert env == {"NCCL_P2P_DISABLE": "1"} and "no peer-to-peer path" in (line or "")
    for own in ({"NCCL_P2P_DISABLE": "0"}, {"NCCL_P2P_LEVEL": "NVL"}):  # the user's wins
        assert p2p_decision(T4X2, [0, 1], own, NEVER) == ({}, None)
    assert p2p_decision(T4X2, [1], {}, NEVER) == ({}, None)  # one GPU


def test_small_dev_shm_disables_ncc_shm_unless_the_user_decided() -> None:
    env, line = shm_decision(T4X2, 2, {})
    assert env == {"NCCL_SHM_DISABLE": "1"} and "/dev/shm holds 64 MiB" in (line or "")
    assert shm_decision(H100X2, 8, {}) == ({}, None)
    assert shm_decision(T4X2, 2, {"NCCL_SHM_DISABLE": "0"}) == ({}, None)
    assert shm_decision(T4X2, 1, {}) == ({}, None)  # one process: no NCCL transport


def test_decide_uses_the_gpus_the_launch_uses() -> None:
    mixed = GpuFacts(("H100", "Tesla T4"), ((9, 0), (7, 5)), (YES, YES), (NO, NO), 1 << 40)
    kw = dict(mixed_precision="bf16", compiles=False, check=lambda pairs: True)
    assert decide(mixed, nproc=1, gpu_ids="0", environ={}, **kw).lines == ()
    assert len(decide(mixed, nproc=1, gpu_ids="1", environ={}, **kw).lines) == 1
    one = decide(mixed, nproc=1, gpu_ids=None, environ={"CUDA_VISIBLE_DEVICES": "1"}, **kw)
    assert len(one.lines) == 1
    assert decide(GpuFacts(), nproc=2, gpu_ids=None, environ={}, **kw).lines == ()


def nccl_env() -> list[str | None]:
    import os

    return [os.environ.get("NCCL_P2P_DISABLE"), os.environ.get("NCCL_SHM_DISABLE")]


@pytest.fixture
def kaggle(monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[int, int]]]:
    """This machine as Kaggle's 2xT4 in Docker: facts simulated, the P2P copy failing."""
    checked: list[list[tuple[int, int]]] = []
    monkeypatch.setattr(gpufacts, "gpu_facts", lambda: T4X2)
    monkeypatch.setattr(gpufacts, "p2p_works", lambda pairs, timeout: checked.append(pairs))
    monkeypatch.setattr(_freegpus, "_checked", {})
    for name in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_P2P_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    return checked


@pytest.mark.integration
def test_a_launch_says_each_decision_and_its_workers_get_the_variables(
    kaggle: list[list[tuple[int, int]]], capfd: pytest.CaptureFixture[str]
) -> None:
    got = notebook_launcher(nccl_env, num_processes=2, mixed_precision="bf16",
                            return_all_ranks=True)  # fmt: skip
    err = capfd.readouterr().err
    assert got == [["1", "1"], ["1", "1"]], got
    said = [line for line in err.splitlines() if line.startswith("nbaccel: ")]
    assert [s.split()[1] for s in said] == ["mixed_precision='bf16'", "GPUs", "/dev/shm"], err
    assert kaggle == [[(0, 1)]]
    os.environ["NCCL_P2P_DISABLE"] = "0"  # the user's own setting (restored by the conftest)
    got = notebook_launcher(nccl_env, num_processes=2, return_all_ranks=True)
    err = capfd.readouterr().err
    assert got == [["0", "1"], ["0", "1"]], got
    assert "NCCL_P2P_DISABLE=1" not in err and "NCCL_SHM_DISABLE=1" in err, err
    assert kaggle == [[(0, 1)]]  # checked once per kernel (and not at all here)


def test_bf16_with_torch_compile_on_a_t4_is_refused_before_any_process(
    kaggle: list[list[tuple[int, int]]],
) -> None:
    def train() -> None:
        import torch

        torch.compile(torch.nn.Linear(2, 2))

    with pytest.raises(ConfigError, match="pytorch#118122"):
        notebook_launcher(train, num_processes=2, mixed_precision="bf16")
    assert kaggle == []  # refused first: nothing checked, nothing started
