"""Multi-node launches: two separate IPython kernels on one machine act as two "nodes".

Each kernel runs the same cell with ``num_nodes=2``, its own ``node_rank``,
``master_addr="127.0.0.1"`` and the same explicit ``use_port``, exactly as a
user would on two machines. A node whose peer never comes must get a clear error
naming the address and port within its ``timeout``, never hang.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kernel_harness import KernelSession, describe_processes, isolated_env

from nbaccel.launch.testing import find_free_port

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

SETUP = """
import os, time
import torch
from nbaccel import Accelerator, notebook_launcher
"""

NODE_CELL = """
def all_reduce_ranks():
    import torch.distributed as dist
    accelerator = Accelerator()
    value = torch.tensor([float(accelerator.process_index + 1)])
    dist.all_reduce(value)
    return [accelerator.process_index, accelerator.num_processes,
            os.environ.get("GROUP_RANK"), value.item()]

node_results = notebook_launcher(all_reduce_ranks, num_processes={nproc}, num_nodes=2,
                                 node_rank={node_rank}, master_addr="127.0.0.1",
                                 use_port={port}, return_all_ranks=True)
# Even with one process per node the work ran in a worker, not in the kernel itself.
import nbaccel.runtime.process.state
kernel_untouched = [not torch.distributed.is_initialized(), nbaccel.runtime.process.state.current_state() is None]
"""

LONELY_CELL = """
def never_meets():
    return Accelerator().num_processes

lonely = {{"type": "no error", "message": ""}}
started = time.monotonic()
try:
    notebook_launcher(never_meets, num_processes=1, num_nodes=2, node_rank={node_rank},
                      master_addr="127.0.0.1", use_port={port}, timeout=5)
except Exception as err:
    lonely = {{"type": type(err).__name__, "message": str(err)}}
lonely["elapsed"] = time.monotonic() - started
"""


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[KernelSession]]:
    sessions = []
    try:
        for node_rank in range(2):
            workdir = tmp_path_factory.mktemp(f"node{node_rank}")
            sessions.append(KernelSession(cwd=workdir, env=isolated_env(workdir)).start())
        setup_ids = [session.submit(SETUP) for session in sessions]
        for session, msg_id in zip(sessions, setup_ids, strict=True):
            session.collect(msg_id, timeout=120).raise_for_error()
        yield sessions
    finally:
        for session in sessions:
            session.stop()


@pytest.fixture(autouse=True)
def _nodes_left_clean(nodes: list[KernelSession]) -> Iterator[None]:
    yield
    for session in nodes:
        if session.busy or not session.is_alive():
            session.restart()
            session.run(SETUP, timeout=120)
    for session in nodes:
        alive = session.wait_for_no_descendants(timeout=5)
        assert not alive, f"kernel {session.pid} kept children:\n{describe_processes(alive)}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nproc", [2, 1], ids=["2-per-node", "1-per-node"])
def test_two_kernels_form_one_world(nodes, nproc):
    port = find_free_port()
    msg_ids = [
        node.submit(NODE_CELL.format(nproc=nproc, node_rank=rank, port=port))
        for rank, node in enumerate(nodes)
    ]
    for node, msg_id in zip(nodes, msg_ids, strict=True):
        node.collect(msg_id, timeout=120).raise_for_error()

    world = 2 * nproc
    expected_sum = float(sum(range(1, world + 1)))
    ranks_seen = []
    for node_rank, node in enumerate(nodes):
        results = node.evaluate_json("node_results")
        assert isinstance(results, list) and len(results) == nproc, results
        assert node.evaluate_json("kernel_untouched") == [True, True], "the kernel joined the group"
        for rank, world_size, group_rank, total in results:
            assert world_size == world, results
            assert total == expected_sum, f"all_reduce over {world} ranks gave {total}: {results}"
            assert group_rank == str(node_rank), f"GROUP_RANK on node {node_rank}: {results}"
            assert rank // nproc == node_rank, f"rank {rank} ran on node {node_rank}"
            ranks_seen.append(rank)
    assert sorted(ranks_seen) == list(range(world))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("node_rank", [0, 1], ids=["master-waits", "worker-cannot-reach"])
def test_node_whose_peer_never_comes_gets_a_clear_error(nodes, node_rank):
    port = find_free_port()
    node = nodes[node_rank]
    node.run(LONELY_CELL.format(node_rank=node_rank, port=port), timeout=90)
    lonely = node.evaluate_json("lonely")
    assert lonely["type"] != "no error", "a node without its peer returned normally"
    message = lonely["message"]
    assert "127.0.0.1" in message and str(port) in message, (
        f"the error does not name the address and port 127.0.0.1:{port}: {message}"
    )
    # Not a hang: the launch's own timeout=5 ended the wait, not torch's 300 s default
    assert "within 5s" in message, message


DISAGREE_CELL = """
def never_trains():
    open("trained", "w").close()

disagreement = {{"type": "no error", "message": ""}}
try:
    notebook_launcher(never_trains, num_processes={nproc}, num_nodes=2, node_rank={node_rank},
                      master_addr="127.0.0.1", use_port={port}, timeout=60)
except Exception as err:
    disagreement = {{"type": type(err).__name__, "message": str(err)}}
"""


@pytest.mark.timeout(180)
def test_nodes_that_disagree_on_the_world_size_fail_on_every_node(nodes, tmp_path):
    """Node 0 has 2 processes, node 1 has 1 (as with num_processes=None on nodes with
    different GPU counts): each computes another world size. Before, this hung."""
    port = find_free_port()
    msg_ids = [
        node.submit(DISAGREE_CELL.format(nproc=2 - rank, node_rank=rank, port=port))
        for rank, node in enumerate(nodes)
    ]
    for node, msg_id in zip(nodes, msg_ids, strict=True):
        node.collect(msg_id, timeout=150).raise_for_error()
    for node in nodes:
        error = node.evaluate_json("disagreement")
        assert error["type"] != "no error", "the nodes trained although they disagree"
        assert "world_size: node 0 has 4, node 1 has 2" in error["message"], error
        assert "num_processes" in error["message"], error  # the fix is named
        assert not node.evaluate_json("__import__('os').path.exists('trained')")


SAVE_CELL = """
def save_and_resume():
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    expected = [p.detach().clone() for p in model.parameters()]
    accelerator.save_state("ckpt")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state("ckpt")
    same = all(torch.equal(a, b) for a, b in zip(expected, model.parameters()))
    return [accelerator.process_index, same, sorted(os.listdir("ckpt"))]

saved = notebook_launcher(save_and_resume, num_processes=1, num_nodes=2,
                          node_rank={node_rank}, master_addr="127.0.0.1", use_port={port})
"""


@pytest.mark.timeout(180)
def test_save_and_load_state_on_two_nodes_without_a_shared_filesystem(nodes):
    """Each kernel works in its own directory: like two machines with their own disks."""
    port = find_free_port()
    msg_ids = [
        node.submit(SAVE_CELL.format(node_rank=rank, port=port)) for rank, node in enumerate(nodes)
    ]
    for node, msg_id in zip(nodes, msg_ids, strict=True):
        node.collect(msg_id, timeout=150).raise_for_error()
    for rank, node in enumerate(nodes):
        process_index, same, files = node.evaluate_json("saved")
        assert process_index == rank and same, (rank, files)
        assert f"rank_{rank}.pt" in files and "nbaccel_checkpoint.json" in files, files
