"""Differences between the torch versions nbaccel claims (run on every matrix torch too)."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from nbaccel.launch.testing import run_on_workers
from nbaccel.platform import torchcompat


def test_torch_at_least_reads_the_installed_version(monkeypatch):
    assert torchcompat.torch_at_least(2, 4)
    monkeypatch.setattr(torch, "__version__", "2.7.1+cu126")
    assert torchcompat.torch_at_least(2, 7) and not torchcompat.torch_at_least(2, 8)
    assert not torchcompat.libuv_store_adopts_socket()
    monkeypatch.setattr(torch, "__version__", "2.10.0a0+git1234")
    assert torchcompat.torch_at_least(2, 8) and torchcompat.libuv_store_adopts_socket()


def _all_reduce_then_leave() -> float:
    # The last collective is followed at once by the teardown: the window in which
    # torch < 2.8 deadlocked (gloo's thread frees the tensor and needs the GIL that the
    # group's destructor holds while joining that thread).
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    torchcompat.destroy_process_group()  # the teardown, right after the collective
    return total.item()


@pytest.mark.integration
def test_teardown_right_after_a_collective_never_hangs():
    # One run in a few hung on torch 2.4 before the fix; 30 runs take a few seconds.
    for _ in range(30):
        assert run_on_workers(_all_reduce_then_leave, num_processes=2) == [3.0, 3.0]


def _destroy_as_old_torch() -> tuple[bool, int, bool]:
    torchcompat.torch_at_least = lambda major, minor: False  # this worker plays torch 2.7
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    group = dist.group.WORLD
    dist.barrier()
    torchcompat.destroy_process_group()
    kept = any(g is group for g in torchcompat._KEPT_ALIVE)
    return dist.is_initialized(), int(os.environ["RANK"]), kept


@pytest.mark.integration
def test_old_torch_unregisters_the_group_but_keeps_it_alive():
    results = run_on_workers(_destroy_as_old_torch, num_processes=2)
    assert results == [(False, 0, True), (False, 1, True)]


def test_destroy_without_a_group_is_a_no_op():
    assert not dist.is_initialized()
    torchcompat.destroy_process_group()
    assert not dist.is_initialized()


def test_fsdp_on_a_torch_below_its_floor_is_a_clear_error(monkeypatch):
    from nbaccel.errors import ConfigError
    from nbaccel.runtime.process.state import get_state, reset_state
    from nbaccel.runtime.strategy.fsdp.fsdp import FSDP

    reset_state()
    monkeypatch.setattr(torch, "__version__", "2.8.0+cu128")
    assert not torchcompat.fsdp_supported()
    major, minor = torchcompat.FSDP_MIN_TORCH
    with pytest.raises(ConfigError, match=rf"torch>={major}\.{minor}.*strategy='ddp'"):
        FSDP(get_state(cpu=True))
    reset_state()
