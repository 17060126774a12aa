"""A warm worker pool started with ``LaunchConfig(strategy="fsdp")``: the workers'
plain ``Accelerator()`` shards with FSDP2, cell after cell, in one process group."""

from __future__ import annotations

import pytest

from nbaccel import LaunchConfig, start_workers

pytestmark = pytest.mark.integration


def _shard_in_a_pool_call():
    import torch

    from nbaccel import Accelerator

    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
    local = sum(p.to_local().numel() for p in model.parameters())
    return accelerator.distributed_type.value, local


@pytest.mark.timeout(180)
def test_a_pool_started_with_strategy_fsdp_shards_in_every_call():
    config = LaunchConfig(strategy="fsdp", num_processes=2, compute_device="cpu")
    with start_workers(config=config, start_method="fork") as pool:
        for _call in range(2):  # the group lives on; each call's Accelerator shards again
            results = pool.call(_shard_in_a_pool_call, return_all_ranks=True)
            assert [kind for kind, _ in results] == ["FSDP", "FSDP"]
            assert sum(local for _, local in results) == 8 * 8 + 8 + 8 * 2 + 2
