"""The CUDA decisions of the process state, tested on the CPU by monkeypatching torch.cuda.

Which device and backend a rank picks, when it refuses (more NCCL ranks than GPUs), what
``init_process_group`` and NCCL barriers are given. The same paths run for real on a GPU
in tests/gpu (scripts/gpu_check.sh).
"""

from __future__ import annotations

import pytest
import torch

from nbaccel import ConfigError
from nbaccel.platform.process_env import EnvironmentSnapshot
from nbaccel.runtime.process import state
from nbaccel.runtime.process.state import DistributedType


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """Pretend this machine has ``n`` CUDA GPUs (only the queries the state makes)."""

    def install(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return install


def _env(local_rank: int, local_world_size: int) -> EnvironmentSnapshot:
    return EnvironmentSnapshot(
        rank=local_rank,
        world_size=local_world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
    )


def test_one_process_per_gpu_picks_its_own_gpu_and_nccl(gpus):
    gpus(2)
    for rank in (0, 1):
        device, backend, kind = state._select_device_and_backend(_env(rank, 2), cpu=False)
        assert (device, backend, kind) == (
            torch.device("cuda", rank),
            "nccl",
            DistributedType.MULTI_GPU,
        )


@pytest.mark.parametrize(("processes", "visible"), [(2, 1), (3, 2)])
def test_more_nccl_ranks_than_gpus_is_a_clear_error(gpus, processes, visible):
    # Before: with one GPU both ranks took cuda:0 and NCCL failed later with
    # "Duplicate GPU detected"; now the rank refuses with the fix in the message.
    gpus(visible)
    with pytest.raises(ConfigError) as err:
        state._select_device_and_backend(_env(processes - 1, processes), cpu=False)
    message = str(err.value)
    assert f"num_processes={processes}" in message and f"{visible} visible GPU" in message
    assert "compute_device='cpu'" in message and "gloo" in message and "cpu=True" in message


def test_explicit_or_adopted_gloo_keeps_the_gpu(gpus):
    # Before: backend="gloo" silently moved training to the CPU. The backend chooses the
    # collective library, not the device; cpu=True is how to ask for the CPU.
    gpus(2)
    device, backend, kind = state._select_device_and_backend(_env(1, 2), cpu=False, backend="gloo")
    assert (device, backend, kind) == (torch.device("cuda", 1), "gloo", DistributedType.MULTI_GPU)
    device, backend, kind = state._select_device_and_backend(_env(1, 2), cpu=True, backend="gloo")
    assert (device, backend, kind) == (torch.device("cpu"), "gloo", DistributedType.MULTI_CPU)


def test_gloo_ranks_may_share_a_gpu(gpus):
    gpus(1)
    devices = [
        state._select_device_and_backend(_env(rank, 2), cpu=False, backend="gloo")[0]
        for rank in (0, 1)
    ]
    assert devices == [torch.device("cuda", 0)] * 2


def test_nccl_without_a_gpu_is_refused(gpus):
    gpus(0)
    with pytest.raises(ConfigError, match="backend='nccl' needs a CUDA GPU"):
        state._select_device_and_backend(_env(0, 2), cpu=False, backend="nccl")


def test_init_process_group_gets_the_device_on_cuda_with_nccl():
    kwargs = state._init_kwargs("nccl", torch.device("cuda", 1), None, {"timeout": None})
    assert kwargs == {"init_method": "env://", "device_id": torch.device("cuda", 1)}
    mixed = state._init_kwargs("cpu:gloo,cuda:nccl", torch.device("cuda", 0), None, {})
    assert mixed["device_id"] == torch.device("cuda", 0)
    # gloo (also on a GPU) and the CPU: no device binding
    assert "device_id" not in state._init_kwargs("gloo", torch.device("cuda", 0), None, {})
    assert "device_id" not in state._init_kwargs("gloo", torch.device("cpu"), None, {})


def test_nccl_barriers_name_this_process_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert state.barrier_kwargs("nccl") == {"device_ids": [3]}
    assert state.barrier_kwargs("gloo") == {}
