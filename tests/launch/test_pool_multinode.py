"""A warm pool over two "nodes": two IPython kernels on one machine run the same cells
with ``num_nodes=2``, their own ``node_rank`` and the same ``use_port``, as a user would
on two machines; ``pool.run`` and ``%%distributed`` then run across both.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kernel_harness import KernelSession, describe_processes, isolated_env

from nbaccel.launch.testing import find_free_port

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

START = """
import os
import torch
from nbaccel import Accelerator, start_workers
%load_ext nbaccel
pool = start_workers(num_processes={nproc}, num_nodes=2, node_rank={node_rank},
                     master_addr="127.0.0.1", use_port={port}, timeout=60)
"""

RUN = """
def all_reduce_ranks():
    import torch.distributed as dist
    accelerator = Accelerator()
    value = torch.tensor([float(accelerator.process_index + 1)])
    dist.all_reduce(value)
    return [accelerator.process_index, accelerator.num_processes, value.item(), os.getpid()]

results = [pool.call(all_reduce_ranks, return_all_ranks=True) for _ in range(2)]
"""

CELL = """%%distributed
import torch, torch.distributed as dist
t = torch.tensor([10.0 * (accelerator.process_index + 1)])
dist.all_reduce(t)
[accelerator.process_index, t.item()]
"""


def _all(nodes: list[KernelSession], codes: list[str], timeout: float = 180) -> list:
    ids = [node.submit(code) for node, code in zip(nodes, codes, strict=True)]
    return [
        node.collect(msg_id, timeout=timeout).raise_for_error()
        for node, msg_id in zip(nodes, ids, strict=True)
    ]


@pytest.fixture
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[KernelSession]]:
    sessions = []
    try:
        for node_rank in range(2):
            workdir = tmp_path_factory.mktemp(f"pool-node{node_rank}")
            sessions.append(KernelSession(cwd=workdir, env=isolated_env(workdir)).start())
        yield sessions
    finally:
        for session in sessions:
            session.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", [1, 2], ids=["1-per-node", "2-per-node"])
def test_two_kernels_share_one_warm_pool(nodes, nproc):
    port = find_free_port()
    _all(nodes, [START.format(nproc=nproc, node_rank=k, port=port) for k in range(2)])
    _all(nodes, [RUN, RUN])
    world = 2 * nproc
    total = float(sum(range(1, world + 1)))
    for node_rank, node in enumerate(nodes):
        first, second = node.evaluate_json("results")
        assert first == second, "the second call did not run on the same workers"
        assert [r[:3] for r in first] == [
            [node_rank * nproc + i, world, total] for i in range(nproc)
        ], first
    cells = _all(nodes, [CELL, CELL])
    cell_total = 10.0 * total
    assert [c.text for c in cells] == [f"[0, {cell_total}]", f"[{nproc}, {cell_total}]"]
    _all(nodes, ["pool.close()", "pool.close()"], timeout=60)
    for node in nodes:
        alive = node.wait_for_no_descendants(timeout=10)
        assert not alive, describe_processes(alive)
