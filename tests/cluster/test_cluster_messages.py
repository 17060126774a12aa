"""How messages name a cluster's ranks, and what the lost-node error says happens next (no
cluster: the formatting and the hooks' texts, from stand-ins for the remote workers)."""

from __future__ import annotations

import pytest

from nbaccel.errors import WorkerTimeoutError, named_rank, named_ranks
from nbaccel.launch.debug._watchdog import HangPolicy, Watchdog
from nbaccel.launch.start.cluster._cluster import NodeWatch, Placement, RemoteWorker

pytestmark = [pytest.mark.cluster]

A, B = "node 10.0.0.2 (aaaaaaaa)", "node 10.0.0.3 (bbbbbbbb)"


def test_one_helper_names_a_rank_here_and_on_a_cluster():
    assert named_rank(1, 42) == "rank 1"  # this machine: as before
    assert named_rank(1, 42, with_pid=True) == "rank 1 (pid 42)"  # an error's headline
    assert named_rank(1, 42, B) == f"rank 1 (pid 42 on {B})"
    assert named_ranks([0, 1], {0: 7, 1: 8}) == "rank(s) 0, 1"
    assert named_ranks([0, 1], {0: 7, 1: 8}, {0: A, 1: B}) == (
        f"rank(s) 0 (pid 7 on {A}), 1 (pid 8 on {B})"
    )


def test_a_hang_error_names_each_stuck_rank_and_stack_with_its_node():
    err = WorkerTimeoutError([0, 1], {1: "stack"}, "no progress", 7, {0: A, 1: B}, {0: 7, 1: 8})
    text = str(err)
    assert text.startswith(f"rank(s) 0 (pid 7 on {A}), 1 (pid 8 on {B}) appear stuck"), text
    assert f"--- where rank 1 (pid 8 on {B}) was ---" in text, text


class _Script:
    def __init__(self, answers: dict[int, dict]) -> None:
        self.answers = answers

    def __call__(self, ranks: list[int], flight: bool = False) -> dict[int, dict]:
        return {r: self.answers[r] for r in ranks if r in self.answers}


def test_the_watchdogs_report_names_every_cluster_rank_with_its_node():
    script = _Script({
        0: {"stack": "s0", "waiting": {"call": "torch.distributed.all_reduce", "ranks": None},
            "collectives": 5},
        1: {"stack": "s1", "waiting": None, "collectives": 4},
    })  # fmt: skip
    dog = Watchdog(HangPolicy(after=2.0), script, now=0.0, pids={0: 7, 1: 8}, nodes={0: A, 1: B})
    hangs = [dog.look([0, 1], {}, 0, now=t / 4) for t in range(1, 20)]
    text = next(h for h in hangs if h is not None).text()
    assert f"rank(s) 0 (pid 7 on {A}), 1 (pid 8 on {B}) appear stuck" in text, text
    assert f"  rank 0 (pid 7 on {A}): waiting in torch.distributed.all_reduce" in text, text
    assert f"  rank 1 (pid 8 on {B}): not in a torch.distributed call" in text, text
    assert f"--- where rank 1 (pid 8 on {B}) was ---" in text, text


def _lost() -> list[RemoteWorker]:
    placement = Placement(None, None)
    placement.nodes = {2: B, 3: B}
    procs = []
    for rank in (2, 3):
        proc = RemoteWorker(rank, 40 + rank, {})
        proc.placement, proc.node, proc.lost = placement, B, "ActorDiedError: gone"
        procs.append(proc)
    return procs


def test_the_lost_node_error_says_what_the_launch_does_next():
    # the first line is what a restart's announcement shows
    for watch in (NodeWatch(), NodeWatch(2, 1), NodeWatch(2, 0), NodeWatch(2, None)):
        first = str(watch.error(_lost())).splitlines()[0]
        assert first == f"the Ray cluster lost {B} with rank(s) [2, 3]", first
    # no restart asked for: it ends; what max_restarts would do is what the launcher does
    # (the whole group re-placed, waiting up to replace_timeout for a node that joins)
    text = str(NodeWatch().error(_lost()))
    assert "The launch ends here (max_restarts=0). With max_restarts=N a launch" in text, text
    assert "replace_timeout" in text and "checkpoint" in text, text
    assert "Without restarts left" not in text, text
    # restarts used up / left
    assert "The launch ends here (its max_restarts=2 restarts are used)" in str(
        NodeWatch(2, 0).error(_lost())
    )
    text = str(NodeWatch(2, 1).error(_lost()))
    assert "The launch restarts (max_restarts=2, 1 left)" in text, text
    assert "ends here" not in text, text
    # a pool's call: replaced at once, no waiting for nodes, no max_restarts in it
    text = str(NodeWatch(2, None).error(_lost()))
    assert "The pool ended every rank of this call and started new workers at once" in text
    assert "without waiting for a node to join" in text and "max_restarts" not in text, text
    assert "replace_timeout" not in text, text
