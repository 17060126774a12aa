"""RankStatus: the per-rank table behind LaunchHandle.status() and WorkerPool.status()."""

from __future__ import annotations

import threading

from nbaccel.launch.handle import RankStatus


def test_events_update_state_pid_step_and_scalars():
    board = RankStatus([0, 1], "starting")
    board.publish(0, "state", {"state": "running", "pid": 42})
    board.publish(0, "log", {"step": 7, "values": {"loss": 0.5, "note": "text"}})
    board.publish(0, "log", {"step": True, "values": {"acc": 1}})  # a bool is not a step
    table = board.snapshot()
    assert table[0] == {
        "state": "running",
        "step": 7,
        "scalars": {"loss": 0.5, "acc": 1},
        "pid": 42,
        "last_event": "log",
    }
    assert table[1]["state"] == "starting" and board.pids() == {0: 42, 1: None}
    table[0]["scalars"]["loss"] = 9.0  # a snapshot is a copy
    assert board.snapshot()[0]["scalars"]["loss"] == 0.5


def test_renamed_states_and_keep_only():
    board = RankStatus([0, 1, 2], "starting", renamed={"finished": "idle"})
    board.publish(1, "state", {"state": "finished"})
    board.publish(2, "state", {"state": "failed"})
    board.keep_only([1, 2])
    assert {r: s["state"] for r, s in board.snapshot().items()} == {1: "idle", 2: "failed"}


def test_listeners_get_every_event_and_a_broken_one_stops_nothing():
    board = RankStatus([0], "starting")
    seen: list[tuple[int, str]] = []

    def broken(rank, kind, data):
        raise RuntimeError("a broken live view")

    board.add_listener(broken)
    listener = board.add_listener(lambda rank, kind, data: seen.append((rank, kind)))
    board.publish(0, "state", {"state": "running"})
    board.remove_listener(listener)
    board.remove_listener(listener)  # twice: no error
    board.publish(0, "log", {"step": 1})
    assert seen == [(0, "state")]


def test_a_listener_may_read_the_status_it_is_told_about():
    board = RankStatus([0], "starting")
    states: list[str] = []
    board.add_listener(lambda rank, kind, data: states.append(board.snapshot()[rank]["state"]))
    thread = threading.Thread(target=board.publish, args=(0, "state", {"state": "running"}))
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "a listener reading the status deadlocked"
    assert states == ["running"]
