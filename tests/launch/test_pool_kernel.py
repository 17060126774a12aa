"""Warm workers (start_workers, %%distributed) driven from cells of a REAL IPython kernel.

One kernel with one pool of 2 CPU workers (gloo) is shared by the module, as a user's
notebook would keep it across cells; after every test the kernel's only children must
be that pool's two workers. Kernel shutdown and a killed kernel get their own kernels.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator

import psutil
import pytest
from kernel_harness import KernelSession, describe_processes, isolated_env, wait_gone
from waits import HANG_GUARD_S

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

SETUP = """
import os, signal, subprocess, sys, time, traceback
import torch
from nbaccel import Accelerator, start_workers
from nbaccel.errors import CUDAInitializedError, WorkerError
%load_ext nbaccel
pool = start_workers(num_processes=2, timeout=30)
"""


def _start(session: KernelSession) -> None:
    session.run(SETUP, timeout=180)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelSession]:
    workdir = tmp_path_factory.mktemp("kernel-pool")
    session = KernelSession(cwd=workdir, env=isolated_env(workdir))
    session.start()
    _start(session)
    yield session
    session.stop()


def pool_pids(kernel: KernelSession) -> dict[str, int]:
    return kernel.evaluate_json("pool.pids")


@pytest.fixture(autouse=True)
def _only_the_pool_is_left(kernel: KernelSession) -> Iterator[None]:
    yield
    if kernel.busy or not kernel.is_alive():
        kernel.restart()
        _start(kernel)
    expected = set(pool_pids(kernel).values())
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        extra = [p for p in kernel.descendants() if p.pid not in expected]
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not extra, f"processes besides the pool's workers:\n{describe_processes(extra)}"
    zombies = [p for p in psutil.Process(kernel.pid).children() if p.status() == "zombie"]
    assert not zombies, f"{describe_processes(zombies)}\n{_zombie_owners(kernel, zombies)}"


def _zombie_owners(kernel: KernelSession, zombies: list[psutil.Process]) -> str:
    """Which of nbaccel's worker records in the kernel knew each zombie, for the message."""
    pids = sorted(p.pid for p in zombies)
    started = {p.pid: time.strftime("%H:%M:%S", time.localtime(p.create_time())) for p in zombies}
    try:
        owners = kernel.evaluate_json(
            "[{k: getattr(o, k) for k in ('pid', 'rank', 'returncode', 'killed_by_us')} "
            "for o in __import__('gc').get_objects() "
            f"if type(o).__name__ == 'WorkerProcess' and o.pid in {pids}]"
        )
    except Exception as err:  # the message must not hide the assertion
        owners = f"<could not ask the kernel: {err}>"
    return f"started at {started}; nbaccel's records of them in the kernel: {owners}"


# ---------------------------------------------------------------------------- run, push, pull
RUN_CELL = """
def rank_and_sum(scale):
    acc = Accelerator()
    t = torch.ones(1) * (acc.process_index + 1)
    torch.distributed.all_reduce(t)
    acc.wait_for_everyone()
    print(f"hello-from-{acc.process_index}")
    return [acc.process_index, t.item() * scale, os.getpid()]

t0 = time.perf_counter()
first = pool.call(rank_and_sum, (2,), return_all_ranks=True)
t1 = time.perf_counter()
second = pool.call(rank_and_sum, (3,), return_all_ranks=True)
t2 = time.perf_counter()
rank0_only = pool.run(rank_and_sum, 1)
timings = [t1 - t0, t2 - t1]
pool.push(lr=1e-3, data=torch.arange(4.0))
pulled = [pool.pull("lr", rank=None), pool.pull("data").sum().item()]
"""


@pytest.mark.timeout(180)
def test_run_twice_reuses_workers_and_push_pull(kernel):
    pids = pool_pids(kernel)
    with kernel.watch_descendants() as seen:
        cell = kernel.run(RUN_CELL, timeout=120)
    assert set(seen) == set(pids.values()), "a call started new processes"
    first, second = kernel.evaluate_json("first"), kernel.evaluate_json("second")
    assert first == [[0, 6.0, pids["0"]], [1, 6.0, pids["1"]]], first
    assert second == [[0, 9.0, pids["0"]], [1, 9.0, pids["1"]]], second
    assert kernel.evaluate_json("rank0_only") == [0, 3.0, pids["0"]]
    for rank in (0, 1):
        lines = [ln for ln in cell.stdout.splitlines() if f"hello-from-{rank}" in ln]
        assert len(lines) == 3 and all(f"[rank{rank}]" in ln for ln in lines), cell.stdout
    assert kernel.evaluate_json("pulled") == [[0.001, 0.001], 6.0]
    assert pool_pids(kernel) == pids


# ---------------------------------------------------------------------------- %%distributed
MAGIC_SET = """%%distributed
import torch
w = torch.full((2,), float(accelerator.process_index))
print(f"cell-rank-{accelerator.process_index} lr={lr}")
w.sum().item() + 0.5
"""
MAGIC_SUBSET = """%%distributed --ranks 1
w = w + 10
print(f"subset-rank-{accelerator.process_index}")
"""


@pytest.mark.timeout(180)
def test_distributed_cells_keep_names_per_rank_and_run_on_a_subset(kernel):
    kernel.run("pool.push(lr=0.25)")
    cell = kernel.run(MAGIC_SET, timeout=60)
    assert cell.text == "0.5", cell.describe()  # rank 0's last expression is the result
    assert re.search(r"^\[rank0\] cell-rank-0 lr=0.25$", cell.stdout, re.M), cell.stdout
    assert re.search(r"^\[rank1\] cell-rank-1 lr=0.25$", cell.stdout, re.M), cell.stdout
    subset = kernel.run(MAGIC_SUBSET, timeout=60)
    assert "subset-rank-1" in subset.stdout and "subset-rank-0" not in subset.stdout
    assert kernel.evaluate_json("[v.tolist() for v in pool.pull('w', rank=None)]") == [
        [0.0, 0.0],
        [11.0, 11.0],
    ]
    names = kernel.evaluate_json("pool.names(rank=1)")
    assert {"w", "lr", "accelerator"} <= set(names), names


# ---------------------------------------------------------------------------- failures
FAILING_CELL = """%%distributed
x_before = 1
if accelerator.process_index == 1:
    raise KeyError("missing-key-on-1")
"""
RUN_FAILURE = """
def fails_on_rank1():
    if int(os.environ["RANK"]) == 1:
        raise ValueError("bad batch 17")
    return "fine"

run_failure = {}
try:
    pool.run(fails_on_rank1)
except ValueError as err:
    run_failure = {"rank": err.rank, "is_worker_error": isinstance(err, WorkerError),
                   "remote": err.remote_traceback}
"""


@pytest.mark.timeout(180)
def test_failing_cell_and_run_raise_with_rank_then_the_pool_works(kernel):
    pids = pool_pids(kernel)
    cell = kernel.execute(FAILING_CELL, timeout=60)
    assert cell.error is not None and cell.error.ename == "KeyError", cell.describe()
    text = cell.error.text
    assert re.search(r"rank 1\b", text) and "missing-key-on-1" in text, text
    assert 'raise KeyError("missing-key-on-1")' in text, text  # the cell's line, remotely
    ok = kernel.run("%%distributed\naccelerator.process_index + 100 + x_before", timeout=60)
    assert ok.text == "101", ok.describe()
    kernel.run(RUN_FAILURE, timeout=60)
    failure = kernel.evaluate_json("run_failure")
    assert failure["rank"] == 1 and failure["is_worker_error"], failure
    assert 'raise ValueError("bad batch 17")' in failure["remote"], failure
    assert kernel.evaluate("pool.run(lambda: 7)") == "7"
    assert pool_pids(kernel) == pids and kernel.evaluate_json("pool.restarts") == 0


LONG_CALL = """
def long_call():
    rank = int(os.environ["RANK"])
    try:
        for i in range(100000):
            if i == 3:
                print(f"long-started-{rank}", flush=True)
            time.sleep(0.01)
    except KeyboardInterrupt:
        print(f"worker-interrupted-{rank}", flush=True)
        raise

pool.run(long_call)
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_interrupt_stops_the_call_on_every_rank_and_the_pool_stays(kernel, start_method):
    name = "pool"
    if start_method == "spawn":  # its own pool, closed at the end
        name = "pspawn"
        kernel.run(f"{name} = start_workers(num_processes=2, start_method='spawn')", timeout=120)
    pids = kernel.evaluate_json(f"{name}.pids")
    msg_id = kernel.submit(LONG_CALL.replace("pool.run", f"{name}.run"))
    kernel.wait_for_output(msg_id, r"long-started-\d", count=2, timeout=60)
    kernel.interrupt()
    cell = kernel.collect(msg_id, timeout=30)
    assert cell.error is not None and cell.error.ename == "KeyboardInterrupt", cell.describe()
    for rank in (0, 1):
        assert f"worker-interrupted-{rank}" in cell.stdout, cell.describe()
    after = kernel.evaluate(f"{name}.run(lambda: 'after-interrupt')")
    assert after == "'after-interrupt'"
    assert kernel.evaluate_json(f"{name}.pids") == pids
    assert kernel.evaluate_json(f"{name}.restarts") == 0
    if start_method == "spawn":
        kernel.run(f"{name}.close()", timeout=60)


@pytest.mark.timeout(240)
def test_rank_killed_with_sigkill_restarts_the_pool_and_says_so(kernel):
    # its own pool: the restarts create workers that must be gone when the test ends
    kernel.run("pk = start_workers(num_processes=2, timeout=30)", timeout=120)
    pids = kernel.evaluate_json("pk.pids")
    kernel.run(f"os.kill({pids['1']}, signal.SIGKILL); time.sleep(0.2)")
    cell = kernel.run(
        "after_kill = pk.call(lambda: int(os.environ['RANK']), return_all_ranks=True)"
    )
    assert kernel.evaluate_json("after_kill") == [0, 1]
    assert "SIGKILL" in cell.stderr and "restarted" in cell.stderr, cell.describe()
    new = kernel.evaluate_json("pk.pids")
    assert new["1"] != pids["1"] and new["0"] != pids["0"], (pids, new)
    assert psutil.pid_exists(new["0"]) and psutil.pid_exists(new["1"])
    # killed during a call: the call fails naming SIGKILL, the pool restarts, the next call works
    during = kernel.execute(
        "%%distributed --pool pk\nimport os, time\nif accelerator.process_index == 1:\n    os.kill(os.getpid(), 9)\n"
        "time.sleep(20)",
        timeout=60,
    )
    assert during.error is not None and "SIGKILL" in during.error.text, during.describe()
    assert "restarted" in during.stderr, during.describe()
    assert kernel.evaluate("pk.run(lambda: 'alive')") == "'alive'"
    assert kernel.evaluate_json("pk.restarts") == 2
    with kernel.watch_descendants() as seen:
        kernel.run("pk.close()", timeout=60)
    assert not wait_gone(
        [p for pid, p in seen.items() if pid not in pool_pids(kernel).values()], HANG_GUARD_S
    )


REDEFINE_1 = """
FACTOR = 2
def version():
    return ["v1", FACTOR]
first_version = pool.run(version)
"""
REDEFINE_2 = """
FACTOR = 5
class Box:                               # a class defined after the pool started
    def __init__(self, v):
        self.v = v
def version():
    return ["v2", Box(FACTOR).v]
second_version = pool.call(version, return_all_ranks=True)
"""


@pytest.mark.timeout(120)
def test_redefined_function_and_new_class_are_picked_up(kernel):
    kernel.run(REDEFINE_1, timeout=60)
    kernel.run(REDEFINE_2, timeout=60)
    assert kernel.evaluate_json("first_version") == ["v1", 2]
    assert kernel.evaluate_json("second_version") == [["v2", 5], ["v2", 5]]


# ---------------------------------------------------------------------------- nothing left
CLOSE_CELL = """
def start_grandchild():
    return subprocess.Popen(["sleep", "300"]).pid      # e.g. a DataLoader worker

p2 = start_workers(num_processes=2)
grandchildren = p2.call(start_grandchild, return_all_ranks=True)
workers = list(p2.pids.values())
p2.close()
with start_workers(num_processes=2) as p3:
    grandchildren += p3.call(start_grandchild, return_all_ranks=True)
    workers += list(p3.pids.values())
closed = [p2.closed, p3.closed, pool is nbaccel_current()]
"""


@pytest.mark.timeout(240)
def test_close_and_with_block_leave_no_process(kernel):
    kernel.run("from nbaccel.launch.pool import current_pool as nbaccel_current")
    pool_workers = set(pool_pids(kernel).values())
    with kernel.watch_descendants() as seen:
        kernel.run(CLOSE_CELL, timeout=180)
    started = [p for pid, p in seen.items() if pid not in pool_workers]
    grandchildren = kernel.evaluate_json("grandchildren")
    workers = kernel.evaluate_json("workers")
    assert len(grandchildren) == 4 and len(set(workers)) == 4, (grandchildren, workers)
    alive = wait_gone(started, timeout=HANG_GUARD_S)  # everything seen while the cell ran
    assert not alive, f"left behind:\n{describe_processes(alive)}"
    for pid in grandchildren + workers:  # also those the 50 ms polling may have missed
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid
    assert kernel.evaluate_json("closed") == [True, True, True]


# ---------------------------------------------------------------------------- bad input
BAD_INPUT = """
bad = {}
def attempt(label, call):
    try:
        call()
        bad[label] = ["no error", ""]
    except BaseException as err:
        bad[label] = [type(err).__name__, str(err)]

attempt("num_processes=0", lambda: start_workers(num_processes=0))
attempt("run(42)", lambda: pool.run(42))
attempt("pull missing", lambda: pool.pull("does_not_exist"))
attempt("pull bad rank", lambda: pool.pull("lr", rank=7))
bad["still works"] = pool.run(lambda: "yes")
"""


@pytest.mark.timeout(120)
def test_bad_input_gets_a_clear_error_and_the_pool_stays_usable(kernel):
    pids = pool_pids(kernel)
    with kernel.watch_descendants(interval=0.01) as seen:
        kernel.run(BAD_INPUT, timeout=60)
    assert set(seen) <= set(pids.values()), describe_processes(list(seen.values()))
    bad = kernel.evaluate_json("bad")
    kind, message = bad["num_processes=0"]
    assert kind in ("ConfigError", "ValueError") and "num_processes" in message, bad
    kind, message = bad["run(42)"]
    assert kind == "TypeError" and "pool.run(train, lr)" in message, bad
    kind, message = bad["pull missing"]
    assert kind == "NameError" and "does_not_exist" in message and "push" in message, bad
    kind, message = bad["pull bad rank"]
    assert kind == "ValueError" and "[0, 1]" in message, bad
    assert bad["still works"] == "yes"
    assert pool_pids(kernel) == pids


# ---------------------------------------------------------------------------- CUDA -> spawn
SPAWN_CELL = """
class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

def where():
    import psutil
    acc = Accelerator()
    net = acc.prepare(TinyNet())
    forked = "ipykernel_launcher" in " ".join(psutil.Process().cmdline())
    return [acc.process_index, acc.num_processes, type(acc.unwrap_model(net)).__name__, forked]

saved_flag = torch.cuda._initialized
torch.cuda._initialized = True                # simulate CUDA initialised in the kernel
spawn_check = {}
try:
    try:
        start_workers(num_processes=2, start_method="fork")
        spawn_check["fork"] = "no error"
    except CUDAInitializedError as err:
        spawn_check["fork"] = type(err).__name__
    with start_workers(num_processes=2) as sp:
        spawn_check["method"] = sp.start_method
        spawn_check["runs"] = [sp.call(where, return_all_ranks=True), sp.run(where)]
finally:
    torch.cuda._initialized = saved_flag
"""


@pytest.mark.timeout(300)
def test_spawn_when_cuda_is_marked_initialised(kernel):
    kernel.run(SPAWN_CELL, timeout=240)
    check = kernel.evaluate_json("spawn_check")
    assert check["fork"] == "CUDAInitializedError", check
    assert check["method"] == "spawn", check
    assert check["runs"] == [
        [[0, 2, "TinyNet", False], [1, 2, "TinyNet", False]],
        [0, 2, "TinyNet", False],
    ]


# ---------------------------------------------------------------------------- kernel end
GRANDCHILDREN = """
pool.call(lambda: subprocess.Popen(["sleep", "300"]).pid, return_all_ranks=True)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["shutdown", "restart", "sigkill"])
def test_kernel_end_leaves_no_process(tmp_path, how):
    with KernelSession(cwd=tmp_path, env=isolated_env(tmp_path)) as session:
        if how == "shutdown":  # %%distributed before any pool: a clear error
            session.run("%load_ext nbaccel")
            cell = session.execute("%%distributed\nprint(1)")
            # IPython shows a UsageError as one line on stderr, no traceback
            assert cell.status == "error" and "start_workers(" in cell.stderr, cell.describe()
        _start(session)
        session.run(GRANDCHILDREN, timeout=60)
        procs = session.descendants()
        assert len(procs) >= 4, describe_processes(procs)
        if how == "shutdown":
            leftovers = session.stop()
            assert not leftovers, leftovers  # nothing had to be killed by the harness
        elif how == "restart":
            leftovers = session.restart()
            assert not leftovers, leftovers
        else:
            psutil.Process(session.pid).send_signal(signal.SIGKILL)
        alive = wait_gone(procs, timeout=HANG_GUARD_S)
        assert not alive, f"{how}: left behind\n{describe_processes(alive)}"
