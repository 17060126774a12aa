"""WorkerPool driven from this process (2 CPU workers over gloo): the decisions that
need precise timing or in-process inspection: hangs, ranks stuck in a collective,
collectives out of step, background calls and stop, the monitor and the panel, and
the %%distributed option parser. Real-kernel behaviour is in test_pool_kernel.py.
"""

from __future__ import annotations

import io
import os
import time

import psutil
import pytest
from waits import HANG_GUARD_S

from nbaccel import WorkerPool, start_workers
from nbaccel.errors import LaunchError, Stopped, WorkerError, WorkerTimeoutError
from nbaccel.launch import magic

pytestmark = pytest.mark.integration


def _rank() -> int:
    return int(os.environ["RANK"])


@pytest.fixture
def pool() -> WorkerPool:
    """Two forked workers without a straggler bound (``timeout=``): a rank that lags its peer
    on a loaded machine is not a stuck one (the slow-machine rehearsal fc19 of 8f56880: after
    a restart, a fresh rank 1 finished a trivial call more than 4 s after rank 0, and the
    pool called it stuck)."""
    with start_workers(num_processes=2, start_method="fork") as p:
        yield p


@pytest.fixture
def stuck_pool() -> WorkerPool:
    """Two forked workers with a 4 s straggler bound, for the tests of that bound: a rank
    asleep for 60 s, a peer stuck in a collective, collectives out of step."""
    with start_workers(num_processes=2, timeout=4, start_method="fork") as p:
        yield p


def slow_rank_one() -> int:
    from nbaccel import Accelerator

    accelerator = Accelerator()
    if accelerator.process_index == 1:
        time.sleep(60)
    return 0


@pytest.mark.timeout(180)
def test_hang_names_the_stuck_rank_with_its_stack_and_restarts(stuck_pool, capsys):
    pool = stuck_pool
    old = pool.pids
    with pytest.raises(WorkerTimeoutError) as info:
        pool.run(slow_rank_one)
    err = info.value
    assert err.stuck_ranks == [1], str(err)
    assert "slow_rank_one" in err.stacks[1], err.stacks[1]
    assert os.path.join("nbaccel", "launch") not in err.stacks[1], err.stacks[1]  # user's frames
    assert "restarted" in capsys.readouterr().err
    assert pool.restarts == 1 and set(pool.pids.values()).isdisjoint(old.values())
    assert pool.call(_rank, return_all_ranks=True) == [0, 1]


def fails_while_peer_waits() -> None:
    import torch
    import torch.distributed as dist

    from nbaccel import Accelerator

    Accelerator()
    if _rank() == 1:
        raise ValueError("rank one gives up")
    dist.all_reduce(torch.ones(1))  # waits for rank 1 forever (in C++)


@pytest.mark.timeout(180)
def test_real_error_first_when_a_peer_is_stuck_in_a_collective(stuck_pool, capsys):
    pool = stuck_pool
    with pytest.raises(ValueError, match="rank one gives up") as info:
        pool.run(fails_while_peer_waits)  # before the peer's collective timed out (timeout=4)
    assert isinstance(info.value, WorkerError) and info.value.rank == 1
    err = capsys.readouterr().err
    # rank 0 either stays stuck in C++ or comes back from the interrupt with one
    # collective more than rank 1: either way the group cannot go on
    assert "restarted" in err and ("did not come back" in err or "out of step" in err), err
    assert pool.restarts == 1
    assert pool.run(_rank) == 0


def extra_collective_then_fail() -> None:
    import torch
    import torch.distributed as dist

    from nbaccel import Accelerator

    Accelerator()
    if _rank() == 0:
        dist.all_reduce(torch.ones(1), async_op=True)  # rank 1 never matches it
    else:
        raise KeyError("rank 1 left early")


@pytest.mark.timeout(180)
def test_collectives_out_of_step_after_a_failure_restart_the_pool(stuck_pool, capsys):
    pool = stuck_pool
    with pytest.raises(KeyError, match="rank 1 left early"):
        pool.run(extra_collective_then_fail)
    assert "out of step" in capsys.readouterr().err
    assert pool.restarts == 1
    assert pool.call(_rank, return_all_ranks=True) == [0, 1]


def one_sided_sends() -> int:
    import torch
    import torch.distributed as dist

    from nbaccel import Accelerator

    accelerator = Accelerator()
    if accelerator.process_index == 0:  # rank 0 sends twice, the others receive once
        for peer in (1, 2):
            dist.send(torch.ones(1), peer)
    else:
        dist.recv(torch.zeros(1), 0)
    accelerator.wait_for_everyone()
    return accelerator.process_index


@pytest.mark.timeout(180)
def test_uneven_point_to_point_counts_after_a_normal_call_keep_the_pool():
    with start_workers(num_processes=3, timeout=30) as pool3:
        pids = pool3.pids
        assert pool3.call(one_sided_sends, return_all_ranks=True) == [0, 1, 2]
        assert pool3.run(one_sided_sends) == 0
        assert pool3.restarts == 0 and pool3.pids == pids


def group_sum() -> float:
    import torch
    import torch.distributed as dist

    from nbaccel import Accelerator

    value = torch.tensor([Accelerator().process_index + 1.0])
    dist.all_reduce(value)
    return value.item()


def echo_options(output: str, block: str, return_all_ranks: str = "unset") -> list[str]:
    return [output, block, return_all_ranks]


def sleepy(seconds: float) -> str:
    time.sleep(seconds)
    return f"slept-{_rank()}"


@pytest.mark.timeout(180)
def test_background_call_busy_error_stop_and_closed_pool(pool):
    pids = pool.pids
    handle = pool.call(sleepy, (0.5,), block=False, return_all_ranks=True)
    with pytest.raises(LaunchError, match="busy"):
        pool.run(_rank)
    assert handle.result(timeout=60) == ["slept-0", "slept-1"]
    assert {s["state"] for s in handle.status().values()} == {"finished"}
    handle = pool.call(sleepy, (60,), block=False)
    time.sleep(0.5)
    handle.stop(timeout=30)
    assert isinstance(handle.exception(), Stopped)
    assert pool.pids == pids and pool.restarts == 0
    assert pool.run(_rank) == 0
    # every argument of run() is the function's, also those named like call()'s options
    assert pool.run(echo_options, "o", block="b", return_all_ranks="r") == ["o", "b", "r"]
    pool.push(kept=1)
    pool.restart()  # fresh workers: new pids, empty namespaces, a working group
    assert pool.restarts == 1 and set(pool.pids.values()).isdisjoint(pids.values())
    with pytest.raises(NameError, match="kept"):
        pool.pull("kept")
    assert pool.run(group_sum) == 3.0
    with pytest.raises(SyntaxError, match="plain Python"):
        pool.exec_cell("!ls\nx = 1")
    assert pool.exec_cell("y = 2\ny * 21") == 42  # ... and the pool is still usable
    # a cell result that cannot travel (or is big) is shown by the worker's repr
    gen = pool.exec_cell("(i for i in range(3))")
    assert type(gen).__name__ == "RemoteRepr" and "generator object" in repr(gen)
    big = pool.exec_cell("import torch\ntorch.zeros(3_000_000)")
    assert type(big).__name__ == "RemoteRepr" and repr(big).startswith("tensor(")
    pool.close()
    with pytest.raises(LaunchError, match="start_workers"):
        pool.run(_rank)


def logs_steps(steps: int) -> int:
    from nbaccel import Accelerator

    accelerator = Accelerator()
    for step in range(steps):
        accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
    print(f"logged-{accelerator.process_index}")
    return steps


@pytest.mark.timeout(180)
def test_monitor_watch_and_panel_drive_a_pool(pool, tmp_path, monkeypatch):
    from nbaccel.monitor import watch

    out = io.StringIO()
    monitor = watch(pool, widget=False, stream=out, interval=0)
    assert pool.run(logs_steps, 4) == 4
    rows = monitor.rows()
    assert [r[:3] for r in rows[1:]] == [["0", "idle", "3"], ["1", "idle", "3"]], rows
    assert rows[1][rows[0].index("loss")] == "0.25"
    monitor.detach()

    pytest.importorskip("ipywidgets")
    from nbaccel.widgets import LaunchPanel

    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(tmp_path / "cfg.yaml"))
    pids = pool.pids
    panel = LaunchPanel(logs_steps, args=(3,), pool=pool)
    assert panel.launch() == 3
    assert "[rank1] logged-1" in panel.sink.getvalue()
    assert [r[1] for r in panel.monitor.rows()[1:]] == ["finished", "finished"]
    assert pool.pids == pids


def dataloader_in_namespace() -> list[int]:
    import psutil
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(torch.arange(8), num_workers=2, persistent_workers=True)
    next(iter(loader))
    globals()["keep"] = loader  # stays alive in the worker after the call
    return [c.pid for c in psutil.Process().children()]


@pytest.mark.timeout(180)
def test_close_ends_dataloader_workers_too():
    pool = start_workers(num_processes=2)
    children = pool.call(dataloader_in_namespace, return_all_ranks=True)
    procs = [psutil.Process(pid) for pids in children for pid in pids]
    assert len(procs) >= 4
    workers = [psutil.Process(pid) for pid in pool.pids.values()]
    pool.close()
    _, alive = psutil.wait_procs(procs + workers, timeout=10)
    assert not alive, alive


def test_magic_options_and_errors(monkeypatch):
    assert magic._parse("") == (None, None)
    assert magic._parse("--ranks 0,1") == ([0, 1], None)
    assert magic._parse("--ranks 1 0 --pool p") == ([1, 0], "p")
    for bad in ("--ranks", "--ranks x", "--pool", "--nope"):
        with pytest.raises(ValueError, match=r"ranks|pool|option"):
            magic._parse(bad)
    monkeypatch.setattr("nbaccel.launch.pool._current", [])
    with pytest.raises(RuntimeError, match=r"start_workers\(num_processes=2\)"):
        magic.distributed("", "print(1)")
    with pytest.raises(RuntimeError, match="no WorkerPool named 'p'"):
        magic.distributed("--pool p", "print(1)", {"p": 3})


@pytest.mark.timeout(120)
def test_a_pool_nobody_references_is_closed():
    pool = start_workers(num_processes=2)
    workers = [psutil.Process(pid) for pid in pool.pids.values()]
    del pool  # e.g. `pool = start_workers(...)` run again in the notebook
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, alive


def _spawned() -> bool:
    import psutil

    # `python -c "...spawn_main(fd)"`: a forked worker keeps its parent's command line, which
    # is `python -c ...` itself in a pytest-xdist worker (scripts/test.sh)
    return "spawn_main" in " ".join(psutil.Process().cmdline())


@pytest.mark.timeout(180)
def test_restart_after_cuda_appeared_in_the_kernel_spawns(monkeypatch, capsys):
    import signal

    import torch

    with start_workers(num_processes=2) as pool:
        assert pool.call(_spawned, return_all_ranks=True) == [False, False]
        monkeypatch.setattr(torch.cuda, "_initialized", True)  # simulate CUDA in the kernel
        os.kill(pool.pids[1], signal.SIGKILL)
        time.sleep(0.2)
        assert pool.call(_spawned, return_all_ranks=True) == [True, True]
        err = capsys.readouterr().err
        assert "SIGKILL" in err and "start_method='spawn'" in err, err


def double(x: int) -> int:
    return 2 * x


@pytest.mark.timeout(180)
def test_distributed_cells_get_the_kernels_names_as_run_gets_a_functions_globals(pool):
    ns = {"p": pool, "double": double, "lr": 3}
    assert magic.distributed("--pool p", "y = double(lr)\ny", ns) == 6
    pool.exec_cell("w = 5")  # the workers' own name
    assert magic.distributed("--pool p", "w + lr", {**ns, "w": 99}) == 8  # kept, not the kernel's
    assert magic.distributed("--pool p", "lr", {**ns, "lr": 4}) == 4  # the kernel's, refreshed
    with pytest.raises(TypeError, match="'gen'"):  # a generator cannot be copied
        magic.distributed("--pool p", "next(gen)", {**ns, "gen": (i for i in range(3))})
    with pytest.raises(NameError, match="nowhere"):
        magic.distributed("--pool p", "nowhere + 1", ns)


@pytest.mark.timeout(180)
def test_a_cell_on_some_ranks_that_enters_a_collective_fails_naming_it(capsys):
    # before: rank 0 waited in all_reduce for rank 1, which never runs the cell: a deadlock
    with start_workers(num_processes=2) as pool:  # no timeout=: only the detection can end it
        pool.exec_cell("import torch, torch.distributed as dist\nrank = accelerator.process_index")
        with pytest.raises(LaunchError, match=r"torch\.distributed\.all_reduce") as info:
            pool.exec_cell("dist.all_reduce(torch.ones(1))", ranks=[0])
        assert "rank(s) [1]" in str(info.value) and "--ranks" in str(info.value)
        assert "dist.all_reduce(torch.ones(1))" in str(info.value)  # where rank 0 was
        assert "restarted" in capsys.readouterr().err  # rank 0 could not leave the collective
        assert pool.exec_cell("1 + 1", ranks=[0]) == 2  # no collective: fine on a subset
        assert pool.call(_rank, return_all_ranks=True) == [0, 1]


def nap_on_rank_one(seconds: float) -> int:
    if _rank() == 1:
        time.sleep(seconds)
    return _rank()


@pytest.mark.timeout(120)
def test_stacks_of_a_background_call_from_another_thread(pool):
    """pool.stacks() (the live monitor's "where are the ranks?") asks the workers over their
    channels while the call's own thread reads them; idle workers have no call to show."""
    assert pool.stacks() == {0: "(idle)", 1: "(idle)"}
    handle = pool.call(nap_on_rank_one, (30.0,), block=False)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        stacks: dict[int, str] = {}
        while "time.sleep(seconds)" not in stacks.get(1, "") and time.monotonic() < deadline:
            stacks = pool.stacks()
            time.sleep(0.2)
        assert "in nap_on_rank_one" in stacks[1] and "time.sleep(seconds)" in stacks[1], stacks
        assert os.path.join("nbaccel", "launch") not in stacks[1], stacks  # the user's frames
    finally:
        handle.stop()
    assert pool.run(_rank) == 0  # the pool goes on
    assert pool.stacks([1]) == {1: "(idle)"}


ONE_EXIT_HOOK = """
import atexit
seen = []
register = atexit.register


def spy(function, *args, **kwargs):
    seen.append(f"{function.__module__}.{function.__qualname__}")
    return register(function, *args, **kwargs)


import psutil


def after_the_hooks():
    # registered before nbaccel's hook, so it runs after it (LIFO): the hook itself must
    # have ended every worker by now -- not PR_SET_PDEATHSIG or the closed channel later
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    print("alive after the exit hooks:", alive, flush=True)


register(after_the_hooks)
atexit.register = spy
from nbaccel import notebook_launcher, start_workers


def ok():
    return 1


def fail():
    raise ValueError("kept for nbaccel.debug()")


if __name__ == "__main__":
    pool = start_workers(num_processes=2, start_method="fork")  # a warm pool
    notebook_launcher(ok, num_processes=2, block=False).result(timeout=120)  # a background run
    try:  # a failed rank kept for nbaccel.debug()
        notebook_launcher(fail, num_processes=2, start_method="fork", debug=True)
    except ValueError:
        pass
    print("hooks:", [name for name in seen if name.startswith("nbaccel")], flush=True)
    # the interpreter exits with all three alive: the one hook must end them
"""


@pytest.mark.timeout(180)
def test_one_exit_hook_ends_pools_background_runs_and_kept_ranks(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "kernel_exits.py"
    script.write_text(ONE_EXIT_HOOK)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=150, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hooks: ['nbaccel.launch.engine._lifetimes._at_exit']" in proc.stdout, proc.stdout
    assert "alive after the exit hooks: []" in proc.stdout, proc.stdout  # ended by the hook
    # and no worker outlived the "kernel" (the autouse fixture fails on any left behind)
