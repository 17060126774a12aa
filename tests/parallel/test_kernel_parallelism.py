"""``ParallelismConfig`` from a notebook: a function defined in a real kernel's cell, run by
``notebook_launcher`` on 4 processes (TP x FSDP2), then twice on a warm pool of 4 (HSDP,
then TP x FSDP2 again in the same workers: a new mesh per Accelerator)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from kernel_harness import KernelSession, isolated_env

from nbaccel.platform import torchcompat

pytestmark = [
    pytest.mark.kernel,
    pytest.mark.integration,
    pytest.mark.skipif(not torchcompat.fsdp_supported(), reason="FSDP2 needs a newer torch"),
]

CELL = """
import json, torch
from nbaccel import notebook_launcher, start_workers

def train(sizes):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from nbaccel import Accelerator, ParallelismConfig
    from nbaccel.utils import TorchTensorParallelConfig
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    acc = Accelerator(parallelism_config=ParallelismConfig(
        **sizes, tp_handler=TorchTensorParallelConfig(plan=plan)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    x = torch.ones(2, 4)
    for _ in range(2):
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return {"dims": list(acc.torch_device_mesh.mesh_dim_names), "loss": float(loss.detach()),
            "type": acc.distributed_type.value}

tp = {"dp_shard_size": 2, "tp_size": 2}
once = notebook_launcher(train, args=(tp,), num_processes=4, return_all_ranks=True)
with start_workers(num_processes=4) as pool:
    hsdp = pool.call(train, ({"dp_replicate_size": 2, "dp_shard_size": 2},), return_all_ranks=True)
    again = pool.call(train, (tp,), return_all_ranks=True)
print("RESULTS " + json.dumps({"once": once, "hsdp": hsdp, "again": again}))
"""


@pytest.fixture
def kernel(tmp_path) -> Iterator[KernelSession]:
    with KernelSession(cwd=tmp_path, env=isolated_env(tmp_path)) as session:
        yield session


def test_notebook_launcher_and_the_warm_pool_run_parallelism_configs(kernel):
    cell = kernel.execute(CELL, timeout=300)
    cell.raise_for_error()
    line = next(x for x in cell.stdout.splitlines() if x.startswith("RESULTS "))
    runs = json.loads(line.removeprefix("RESULTS "))
    for name in ("once", "again"):
        assert [r["dims"] for r in runs[name]] == [["dp_shard", "tp"]] * 4
        assert {r["type"] for r in runs[name]} == {"FSDP"}
    assert [r["dims"] for r in runs["hsdp"]] == [["dp_replicate", "dp_shard"]] * 4
    # every rank trained the same replicated function: one loss, equal across layouts
    losses = {round(r["loss"], 6) for run in runs.values() for r in run}
    assert len(losses) == 1
