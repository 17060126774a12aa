"""The hang watchdog: ranks that wait on each other without progress are reported, with
the collective each is in and their stacks, and the job goes on (or ends, if asked).

Real workers over gloo, started from this process (notebook_launcher, a pool); a waiting
rank is released by a file flag once the report was seen, so nothing depends on how fast
the machine is. The rules themselves are unit-tested with a scripted probe; the real
kernel is test_kernel_hang.py, ``nbaccel launch`` tests/cli/test_launch_hang.py.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from nbaccel import LaunchConfig, notebook_launcher, start_workers
from nbaccel.config import resolve_launch_config
from nbaccel.errors import ConfigError, LaunchError, WorkerError, WorkerTimeoutError
from nbaccel.launch.debug._watchdog import DEFAULT_HANG_AFTER, HangPolicy, Watchdog
from nbaccel.launch.engine._supervisor import Hook, JobFailed

CPU = LaunchConfig(compute_device="cpu")
REPORTED = "waiting in torch.distributed.all_reduce"


# ---------------------------------------------------------------------------- the rules
class Script:
    """A probe that answers what the test says each rank is doing."""

    def __init__(self) -> None:
        self.answers: dict[int, dict] = {}

    def set(self, rank: int, count: int | None, call: str | None = None, **more: object) -> None:
        waiting = {"call": call, "ranks": None} if call else None
        self.answers[rank] = {
            "stack": f"stack of {rank}", "waiting": waiting, "collectives": count, **more
        }  # fmt: skip

    def __call__(self, ranks: list[int], flight: bool = False) -> dict[int, dict]:
        return {r: self.answers[r] for r in ranks if r in self.answers}


def _watch(after: float = 2.0) -> tuple[Watchdog, Script]:
    script = Script()
    return Watchdog(HangPolicy(after=after), script, now=0.0), script


def test_a_rank_alone_in_a_collective_is_reported_then_backs_off():
    dog, script = _watch()
    script.set(0, 5, "torch.distributed.all_reduce")
    script.set(1, 4)
    looks = [(t, dog.look([0, 1], {}, 7, now=t)) for t in [x * 0.25 for x in range(1, 60)]]
    found = [(t, h) for t, h in looks if h is not None]
    assert [t for t, _ in found] == [2.25, 6.25, 14.25]  # after 2 s, then 2x and 4x more
    hang = found[0][1]
    assert hang.ranks == [0, 1] and hang.calls == {0: "torch.distributed.all_reduce", 1: None}
    text = hang.text()
    assert "rank 0: waiting in torch.distributed.all_reduce" in text
    assert "rank 1: not in a torch.distributed call" in text and "issued 4" in text
    assert "stack of 0" in text and "stack of 1" in text and "again in 4s" in text


def test_progress_of_any_kind_starts_the_clock_over():
    dog, script = _watch()
    script.set(0, 1, "torch.distributed.barrier")
    script.set(1, 0)
    count, activity = 1, 0
    for step in range(1, 80):  # 20 s: a collective every 1.5 s, or an event
        t = step * 0.25
        if step % 6 == 0:
            count += 1
            script.set(0, count, "torch.distributed.barrier")
        if step % 6 == 3:
            activity += 1
        assert dog.look([0, 1], {}, activity, now=t) is None, t
    assert dog.look([0, 1], {}, activity, now=25.0) is not None  # then nothing moved


def test_no_report_without_a_rank_waiting_on_a_peer_and_none_when_off():
    dog, script = _watch()
    script.set(0, 3)
    script.set(1, 3)  # both compute (same count, no collective): a long step
    assert all(dog.look([0, 1], {}, 0, now=t / 4) is None for t in range(1, 100))
    dog, script = _watch()
    script.set(0, None)  # a rank that has no process group, its peer finished
    assert all(dog.look([0], {1: None}, 0, now=t / 4) is None for t in range(1, 100))
    off, script = _watch(after=0)
    script.set(0, 5, "torch.distributed.all_reduce")
    assert all(off.look([0], {1: 4}, 0, now=t) is None for t in range(1, 100))


def test_a_finished_rank_behind_in_collectives_counts_as_waited_for():
    dog, script = _watch()
    script.set(0, 2)  # DDP backward waits in C++: no torch.distributed frame
    hangs = [dog.look([0], {1: 1}, 3, now=t / 4) for t in range(1, 12)]
    hang = next(h for h in hangs if h is not None)
    assert "rank 1: finished its part of the job; issued 1 collectives, others 2" in hang.text()


def test_a_working_rank_is_waited_for_and_never_ended_but_idle_ranks_in_torch_are_stuck():
    script = Script()
    dog = Watchdog(HangPolicy(after=2.0, action="raise"), script, now=0.0)
    found = []
    for step in range(1, 40):  # rank 0 evaluates alone (CPU time advancing), 1 waits
        t = step * 0.25
        script.set(0, 3, cpu=t * 0.9, frame="evaluate (nb.py:12)", in_torch=None)
        script.set(1, 3, "torch.distributed.barrier", cpu=1.0)
        found += [h for h in [dog.look([0, 1], {}, 5, now=t)] if h is not None]
    hang = found[0]
    assert hang.busy == [0] and hang.ranks == [0, 1]  # the supervisor never ends such a job
    assert "rank(s) 1 wait for rank 0, which is busy in evaluate (nb.py:12)" in hang.text()
    assert "stack of 0" in hang.text() and "appear stuck" not in hang.text()
    # both ranks idle inside a C++ call of torch's, the same count: a mismatch, stuck
    dog, script = _watch()
    for rank in (0, 1):
        script.set(rank, 7, cpu=1.0, in_torch="torch.autograd.graph._engine_run_backward")
    hang = next(h for t in range(1, 40) if (h := dog.look([0, 1], {}, 5, now=t / 4)))
    assert not hang.busy and "idle inside torch.autograd.graph._engine_run_backward" in hang.text()
    assert "debug_collectives=True makes torch name the mismatch" in hang.text()
    # the same in the user's own code (sleeping, or reading a file): a long step, no report
    dog, script = _watch()
    for rank in (0, 1):
        script.set(rank, 7, cpu=1.0, in_torch=None)
    assert all(dog.look([0, 1], {}, 5, now=t / 4) is None for t in range(1, 100))


def test_a_working_rank_too_busy_to_answer_the_probe_is_still_working():
    """On a loaded machine a computing rank's channel thread may not answer in time: its CPU
    time, read from the OS, still says it works (a CI run ended such a job as stuck)."""
    script, clock = Script(), {"t": 0.0}
    cpu = lambda ranks: {0: clock["t"] * 0.3, 1: 1.0}  # noqa: E731  (rank 0 gets 30% of a CPU)
    dog = Watchdog(HangPolicy(after=2.0, action="raise"), script, now=0.0, cpu=cpu)
    found = []
    for step in range(1, 40):  # rank 0 never answers; rank 1 waits in a barrier
        clock["t"] = t = step * 0.25
        script.set(1, 0, "torch.distributed.barrier", cpu=1.0)
        found += [h for h in [dog.look([0, 1], {}, 5, now=t)] if h is not None]
    hang = found[0]
    assert hang.busy == [0] and "appear stuck" not in hang.text()
    assert "rank(s) 1 wait for rank 0, which is busy in its code" in hang.text()


def test_a_rank_that_only_polls_is_stuck_whatever_one_looks_noise():
    """Working is judged over the whole still window: a rank polling a file, whose CPU time
    jumped by 20 ms in one look (a loaded machine, the probe's own answer), is not working
    (a CI run reported it as "busy" and the stuck report never came)."""
    dog, script = _watch()
    found = []
    for step in range(1, 40):  # rank 0 waits in all_reduce; rank 1 polls a file
        t = step * 0.25
        script.set(0, 1, "torch.distributed.all_reduce", cpu=1.0)
        script.set(1, 0, cpu=1.0 + (0.02 if t >= 2.25 else 0.0), in_torch=None)
        found += [h for h in [dog.look([0, 1], {}, 5, now=t)] if h is not None]
    text = found[0].text()
    assert not found[0].busy and "rank 1: not in a torch.distributed call" in text, text


def test_a_rank_that_computed_then_stopped_is_stuck_after_hang_after_not_later():
    """Working is judged over the last ``after`` seconds: a rank that computed for a second
    after the last progress (building DeepSpeed's engine), then stopped, was judged working
    until that second was 5% of the whole still time, and ``on_hang="raise"`` came at 3 to 7
    times ``hang_after`` (a DeepSpeed test waited 38 to 182 s for a 12 s hang_after)."""
    dog, script = _watch()
    found = []
    for step in range(1, 80):  # rank 0 waits in all_reduce; rank 1 works 1 s, then sleeps
        t = step * 0.25
        script.set(0, 1, "torch.distributed.all_reduce", cpu=1.0)
        script.set(1, 0, cpu=1.0 + 0.9 * min(t - 0.25, 1.0), in_torch=None)
        found += [h for h in [dog.look([0, 1], {}, 5, now=t)] if h is not None]
    # at 2 s rank 1 worked within the last hang_after: "busy" is right then; stuck comes next
    stuck = next(h for h in found if not h.busy)
    assert stuck.seconds < 4, [(h.seconds, h.busy) for h in found]
    assert "rank 1: not in a torch.distributed call" in stuck.text()


def test_forming_the_process_group_is_not_judged_the_still_time_starts_after():
    """A group that took more than 8 s to form on a loaded machine (a rank in torch's group
    set-up, its peer in the Accelerator's first broadcast) was reported stuck at hang_after=2,
    and on_hang="raise" ended a healthy job: forming is bounded by the launch's timeout."""
    dog, script = _watch()
    looks = []
    for step in range(1, 121):  # 30 s: forming for 20 s, then both stuck in a broadcast
        t = step * 0.25
        forming = t <= 20
        script.set(0, 0, "torch.distributed.broadcast", forming=forming)
        script.set(1, 0, "torch.distributed._new_process_group_helper" if forming else
                   "torch.distributed.broadcast", forming=forming)  # fmt: skip
        looks.append((t, dog.look([0, 1], {}, 3, now=t)))
    found = [t for t, hang in looks if hang is not None]
    assert found and found[0] == 22.25, found  # 2 s after the first look at a formed group


def test_settings_default_environment_cli_and_errors(tmp_path):
    assert LaunchConfig().hang_after == DEFAULT_HANG_AFTER == 300.0
    assert LaunchConfig().on_hang == "report" and LaunchConfig().debug_collectives is False
    env = {
        "NBACCEL_HANG_AFTER": "2.5",
        "NBACCEL_ON_HANG": "raise",
        "NBACCEL_DEBUG_COLLECTIVES": "1",
    }
    cfg = resolve_launch_config(environ=env, config_file=False)
    assert (cfg.hang_after, cfg.on_hang, cfg.debug_collectives) == (2.5, "raise", True)
    assert HangPolicy.of(cfg) == HangPolicy(2.5, "raise")
    for bad in ({"hang_after": -1}, {"hang_after": "5"}, {"on_hang": "kill"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            LaunchConfig(**bad)
    with pytest.raises(ConfigError, match="hang_after"):  # before any process starts
        notebook_launcher(print, num_processes=2, hang_after=-1, config=CPU)
    from nbaccel.cli import build_parser

    args = build_parser().parse_args(
        ["launch", "--hang_after", "7", "--on_hang", "raise", "--debug_collectives", "x.py"]
    )
    assert (args.hang_after, args.on_hang, args.debug_collectives) == (7.0, "raise", True)


# ---------------------------------------------------------------------------- real workers
def alone_in_all_reduce(flag: str) -> float:
    import torch
    import torch.distributed as dist

    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    value = torch.ones(1)
    if accelerator.process_index == 1:  # one line: the same stack at every look
        while not os.path.exists(flag): time.sleep(0.05)  # noqa: E701  # fmt: skip
    dist.all_reduce(value)
    return value.item()


class Lines:
    """``output=`` that keeps every line and says when one contains ``wanted``."""

    def __init__(self, wanted: str) -> None:
        self.lines: list[str] = []
        self.wanted, self.seen = wanted, threading.Event()

    def __call__(self, rank: int, stream: str, line: str) -> None:
        self.lines.append(line)
        if self.wanted in line:
            self.seen.set()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_rank_alone_in_a_collective_is_reported_and_the_job_is_not_killed(tmp_path):
    flag, lines = tmp_path / "go", Lines(REPORTED)
    handle = notebook_launcher(
        alone_in_all_reduce, (str(flag),), num_processes=2, config=CPU, hang_after=2,
        block=False, output=lines, return_all_ranks=True,
    )  # fmt: skip
    try:
        assert lines.seen.wait(120), lines.text
        events = [s["last_event"] for s in handle.status().values()]
        flag.touch()  # rank 1 comes: the all_reduce completes
        assert handle.result(timeout=120) == [2.0, 2.0]  # the report killed nothing
    finally:
        handle.stop(timeout=10)
    text = lines.text
    assert "rank(s) 0, 1 appear stuck" in text and "rank 0: " + REPORTED in text, text
    assert "rank 1: not in a torch.distributed call" in text, text
    assert "in alone_in_all_reduce" in text and "os.path.exists(flag)" in text, text  # stacks
    assert "on_hang='report'" in text and events == ["hang", "hang"], text


def finished_early() -> float:
    import torch
    import torch.distributed as dist

    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    value = torch.ones(1)
    if accelerator.process_index == 0:
        dist.all_reduce(value)  # rank 1 has returned: nobody ever comes
    return value.item()


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_on_hang_raise_ends_the_job_naming_the_rank_and_the_finished_one():
    with pytest.raises(WorkerTimeoutError) as info:
        notebook_launcher(
            finished_early, num_processes=2, config=CPU, hang_after=2, on_hang="raise"
        )
    err = info.value
    assert err.stuck_ranks == [0], str(err)
    assert "rank 0: " + REPORTED in err.reason and "rank 1: finished" in err.reason, str(err)
    assert "dist.all_reduce(value)" in err.stacks[0], err.stacks


def evaluates_alone(flag: str) -> int:
    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    if accelerator.is_main_process:  # evaluating alone: CPU-bound, no collective
        total = 0
        while not os.path.exists(flag):
            total += sum(range(10_000))
    accelerator.wait_for_everyone()
    return accelerator.process_index


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_ranks_waiting_for_a_working_rank_are_reported_and_on_hang_raise_ends_nothing(tmp_path):
    flag, lines = tmp_path / "go", Lines("which is busy in")
    handle = notebook_launcher(
        evaluates_alone, (str(flag),), num_processes=2, config=CPU, hang_after=2,
        on_hang="raise", block=False, output=lines, return_all_ranks=True,
    )  # fmt: skip
    try:
        assert lines.seen.wait(120), lines.text
        flag.touch()  # rank 0 is done evaluating
        assert handle.result(timeout=120) == [0, 1]  # not ended: it was working
    finally:
        handle.stop(timeout=10)
    text = lines.text
    # the frame comes from rank 0's answer to the probe; on a loaded CI machine rank 0 once
    # answered no probe for 60 s (known, open: the report then says "busy in its code")
    assert "rank(s) 1 wait for rank 0, which is busy in " in text, text
    assert "--- where rank 0 is ---" in text, text
    if "which is busy in its code" not in text:
        assert "which is busy in evaluates_alone" in text and "in evaluates_alone\n" in text, text


def late_to_the_group(seconds: float) -> int:
    from nbaccel import Accelerator

    if os.environ["RANK"] == "1":
        time.sleep(seconds)  # a slow start (a loaded machine, a slow import): rank 0 waits
    accelerator = Accelerator(cpu=True)
    accelerator.wait_for_everyone()
    return accelerator.process_index


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_rank_late_to_form_the_group_is_not_a_hang():
    # rank 0 waits in the rendezvous while rank 1 has not come yet: the launch's timeout
    # bounds that, not hang_after (before: on_hang="raise" ended this healthy job at 1-2 s)
    results = notebook_launcher(
        late_to_the_group, (6.0,), num_processes=2, config=CPU, hang_after=1,
        on_hang="raise", return_all_ranks=True,
    )  # fmt: skip
    assert results == [0, 1]


def steady_but_slow(steps: int) -> int:
    import torch
    import torch.distributed as dist

    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    for _ in range(steps):  # rank 0 waits in every all_reduce for 0.5 s: not a hang
        if accelerator.process_index == 1:
            time.sleep(0.5)
        dist.all_reduce(torch.ones(1))
    return steps


def logs_while_peer_waits(steps: int) -> int:
    import torch.distributed as dist

    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    if accelerator.process_index == 1:  # rank 0 waits in the barrier, rank 1 logs
        for step in range(steps):
            time.sleep(0.5)
            accelerator.log({"step_done": float(step)}, step=step)
    dist.barrier()
    return steps


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_slow_job_that_progresses_is_not_reported():
    lines = Lines(REPORTED)
    assert notebook_launcher(steady_but_slow, (10,), num_processes=2, config=CPU, hang_after=2,
                             output=lines) == 10  # fmt: skip
    pool = start_workers(num_processes=2, config=CPU, start_method="fork")
    try:  # progress by events alone, and the option of one pool call
        assert pool.call(logs_while_peer_waits, (10,), hang_after=2, output=lines) == 10
    finally:
        pool.close()
    assert "appear stuck" not in lines.text, lines.text


class Ender(Hook):
    """A hook of the test's own: it sees every message and ends the job once told to."""

    def __init__(self, flag: str) -> None:
        self.flag, self.seen = flag, set()

    def message(self, sup, rank, message):
        self.seen.add(type(message).__name__)

    def look(self, sup, busy, done):
        if busy and os.path.exists(self.flag):
            return JobFailed(LaunchError("ended by the test's hook"), None)
        return None


def waits_for(flag: str) -> None:
    while not os.path.exists(flag):
        time.sleep(0.05)


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_pool_call_is_reported_and_goes_on(tmp_path):
    flag, lines = tmp_path / "go", Lines(REPORTED)
    with start_workers(num_processes=2, config=CPU, start_method="fork", hang_after=2) as pool:
        handle = pool.call(alone_in_all_reduce, (str(flag),), block=False, output=lines)
        assert lines.seen.wait(120), lines.text
        flag.touch()
        assert handle.result(timeout=120) == 2.0 and pool.restarts == 0
        # the watchdog, the subset check and post-mortem plug into the supervisor as hooks,
        # and so can anything else: this one sees the messages and ends a job
        group = pool._group
        kinds = [type(hook).__name__ for hook in group.hooks]
        assert kinds == ["SubsetCheck", "HangWatch", "KeepFailed"], kinds
        ender = Ender(str(tmp_path / "end"))
        group.hooks.append(ender)
        handle = pool.call(waits_for, (str(tmp_path / "never"),), block=False)
        (tmp_path / "end").touch()
        with pytest.raises(LaunchError, match="ended by the test's hook"):
            handle.result(timeout=120)
        assert "Done" in ender.seen, ender.seen  # the interrupted ranks answered
        assert pool.restarts == 0  # the ranks came back from the interrupt


def mismatched() -> None:
    import torch
    import torch.distributed as dist

    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    value = torch.ones(2)
    if accelerator.process_index == 0:
        dist.all_reduce(value)
    else:
        dist.broadcast(value, src=0)


def different_calls() -> None:
    import torch
    import torch.distributed as dist

    from nbaccel import Accelerator

    Accelerator(cpu=True)
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(3))
    else:
        dist.broadcast(torch.ones(5), src=0)


def prepares_a_model() -> str:
    from nbaccel import Accelerator

    return type(Accelerator(cpu=True).prepare(torch.nn.Linear(2, 2))).__name__


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_collective_called_differently_is_named_from_torchs_flight_recorder():
    with pytest.raises(WorkerTimeoutError) as info:
        notebook_launcher(different_calls, num_processes=2, config=CPU, start_method="fork",
                          hang_after=2, on_hang="raise")  # fmt: skip
    text = str(info.value)
    assert "rank 1: waiting in torch.distributed.broadcast" in text, text
    if torch.__version__ < "2.13":  # TorchVersion: compared as a version, not as a string
        # older torches record nothing on gloo by default: the report then says nothing of
        # a record, invents no mismatch (what holds there, asserted, rather than a return)
        assert "last collective" not in text and "called differently" not in text, text
    else:
        assert "last collective #1: gloo:all_reduce of [[3]]" in text, text
        assert "last collective #1: gloo:broadcast of [[5]]" in text, text
        assert "collective #1 of default_pg is called differently on different ranks" in text


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_debug_collectives_turns_a_mismatch_into_torchs_error():
    with pytest.raises(WorkerError, match="Detected mismatch between collectives") as info:
        notebook_launcher(
            mismatched, num_processes=2, config=CPU, start_method="fork", debug_collectives=True
        )
    assert "ALLREDUCE" in str(info.value) and "BROADCAST" in str(info.value)
    # torch's DDP would crash (SIGSEGV) under its gloo checking wrapper: an error instead
    with pytest.raises(ConfigError, match="debug_collectives=True") as info:
        notebook_launcher(prepares_a_model, num_processes=2, config=CPU, debug_collectives=True)
    assert "failed with ConfigError" in str(info.value), str(info.value)  # not by a signal
    assert (
        notebook_launcher(prepares_a_model, num_processes=2, config=CPU)
        == "DistributedDataParallel"
    )
