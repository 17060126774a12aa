"""notebook_launcher from the pytest process itself: real forked/spawned CPU workers.

Worker functions live at module level (fork copies them; spawn pickles them by
reference). Notebook-style functions (defined in ``__main__``) are covered by a
script run in a subprocess. The conftest fixtures fail any test that leaks a
child process and restore the environment afterwards.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types
import warnings

import psutil
import pytest
import torch
from waits import HANG_GUARD_S

import nbaccel
from nbaccel import LaunchHandle, debug_launcher, notebook_launcher
from nbaccel.errors import CUDAInitializedError, LaunchError, WorkerError, WorkerTimeoutError
from nbaccel.launch.engine._tidy import Failure, pick_failure, remote_exception
from nbaccel.launch.start import _local, _preflight
from nbaccel.launch.testing import plan_for
from nbaccel.platform import cudatrace as _cudatrace
from nbaccel.platform import forksafe

pytestmark = pytest.mark.integration
ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


# ---------------------------------------------------------------- worker functions
def rank_tensor(offset):
    return torch.full((2,), float(os.environ["RANK"])) + offset


def env_of_worker():
    from nbaccel.config import launch_config

    settings = {"precision": launch_config().mixed_precision, "timeout": launch_config().timeout}
    return {k: os.environ.get(k) for k in ENV_KEYS} | {"pid": os.getpid()} | settings


def threads_of_worker():
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


class CustomError(Exception):
    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def fail_on_rank_1(kind="value"):
    if os.environ["RANK"] == "1":
        if kind == "custom":
            raise CustomError("custom failure", code=7)
        raise ValueError("rank one is broken")
    return "ok"


def secondary_first():
    # rank 0 reports a peer-lost style error first; rank 1's real error comes later
    if os.environ["RANK"] == "0":
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")
    time.sleep(0.3)
    raise KeyError("the real cause")


def join_group(seconds):
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=seconds))


def killed_rank_1():
    join_group(30)
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    import torch.distributed as dist

    dist.barrier()


def stuck_rank_1():
    from nbaccel.config import launch_config

    join_group(launch_config().timeout)  # the launch's timeout=, as the Accelerator uses it
    if os.environ["RANK"] == "1":
        time.sleep(600)  # the stuck rank
    import torch.distributed as dist

    dist.barrier()


def all_reduce_and_wait_for(path):
    join_group(600)
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    open(f"{path}.rank{os.environ['RANK']}", "w").close()  # the group is up: look now
    # held until the test has looked (an event, not a sleep a slow machine outlasts)
    deadline = time.monotonic() + 600
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.barrier()
    return t


def own_init_method(port):
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def returns_generator():
    return (i for i in range(3))


def publish_steps(steps, delay):
    from nbaccel.tracking.events import publish

    for step in range(steps):
        publish("log", step=step, values={"loss": 1.0 / (step + 1)})
        time.sleep(delay)
    return os.environ["RANK"]


def print_long_lines(n, width):
    char = "ab"[int(os.environ["RANK"])]
    for _ in range(n):
        print(char * width)
    sys.stdout.write("no newline at the end")


def getpid_and_env():
    from nbaccel.config import launch_config

    return os.getpid(), launch_config().mixed_precision, os.environ.get("RANK")


def fails_first_time(marker):
    if not os.path.exists(marker):
        if os.environ["RANK"] == "0":
            open(marker, "w").close()
        raise RuntimeError("first attempt fails")
    return "second attempt"


def resumes_after_failing_once(project_dir):
    from nbaccel import Accelerator, ProjectConfiguration

    acc = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=project_dir, automatic_checkpoint_naming=True
        ),
    )
    acc.prepare(torch.nn.Linear(2, 2))
    try:
        return acc.load_state(), acc.step  # the second attempt
    except FileNotFoundError:
        acc.save_state()
        acc.wait_for_everyone()
        raise RuntimeError("first attempt fails after its checkpoint") from None


def world_size_from_state():
    from nbaccel.config import launch_config
    from nbaccel.runtime.process.state import get_state

    state = get_state()
    return state.world_size, state.device.type, launch_config().compute_device


def accelerator_precision():
    from nbaccel import Accelerator

    return Accelerator(cpu=True).mixed_precision


# ---------------------------------------------------------------- helpers
def _child_pids():
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != "zombie"}


@pytest.fixture
def no_workers(monkeypatch):
    """Fail if anything tries to start a worker process."""

    def refuse(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(_local, "start_processes", refuse)
    monkeypatch.setattr("nbaccel.launch.start._start.start_processes", refuse)
    before = _child_pids()
    yield
    assert _child_pids() == before


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- results
def test_returns_rank0_value_including_tensor():
    value = notebook_launcher(rank_tensor, args=(1.0,), num_processes=2)
    assert torch.equal(value, torch.tensor([1.0, 1.0]))


def test_return_all_ranks_and_env_contract():
    values = notebook_launcher(
        env_of_worker, num_processes=2, mixed_precision="bf16", timeout=30, return_all_ranks=True
    )
    assert [v["RANK"] for v in values] == ["0", "1"]
    for local, v in enumerate(values):
        assert v["WORLD_SIZE"] == "2" and v["LOCAL_RANK"] == str(local)
        assert v["LOCAL_WORLD_SIZE"] == "2" and v["GROUP_RANK"] == "0"
        assert v["MASTER_ADDR"] == "127.0.0.1" and int(v["MASTER_PORT"]) > 0
        assert v["precision"] == "bf16"  # the typed configuration, not environment text
        assert v["timeout"] == 30.0
        assert not any(k.startswith("NBACCEL_") and os.environ.get(k) != v for k, v in v.items())
        assert v["pid"] != os.getpid()
    assert values[0]["pid"] != values[1]["pid"]


def test_mixed_precision_reaches_the_accelerator():
    assert (
        notebook_launcher(accelerator_precision, num_processes=2, mixed_precision="bf16") == "bf16"
    )


def test_one_process_runs_in_the_kernel_and_restores_env():
    before = dict(os.environ)
    pid, precision, rank = notebook_launcher(
        getpid_and_env, num_processes=1, mixed_precision="bf16"
    )
    assert pid == os.getpid() and precision == "bf16" and rank == "0"
    assert dict(os.environ) == before


def _note_group_at_exit(folder: str) -> None:
    import atexit

    import torch.distributed as dist

    from nbaccel import Accelerator

    Accelerator(cpu=True).wait_for_everyone()
    path = os.path.join(folder, os.environ["RANK"])

    def note() -> None:  # runs after the launcher's exit barrier, before os._exit
        with open(path, "w") as f:
            f.write(str(dist.is_initialized()))

    atexit.register(note)


def test_workers_exit_without_tearing_down_a_group_nobody_needs(tmp_path):
    # Destroying a gloo group costs ~20 ms of every launch; once every rank has passed
    # the exit barrier, a forked worker exits with its group intact (os._exit closes it).
    notebook_launcher(_note_group_at_exit, args=(str(tmp_path),), num_processes=2)
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"0": "True", "1": "True"}


def test_debug_launcher_is_cpu_multi_process():
    world, device, use_cpu = debug_launcher(world_size_from_state)
    assert (world, device, use_cpu) == (2, "cpu", "cpu")


def test_use_port_is_used():
    port = _free_port()
    env = notebook_launcher(env_of_worker, num_processes=2, use_port=port)
    assert env["MASTER_PORT"] == str(port)


# ---------------------------------------------------------------- failures
def test_worker_exception_type_rank_traceback_and_relaunch():
    with pytest.raises(ValueError, match="rank one is broken") as info:
        notebook_launcher(fail_on_rank_1, num_processes=2)
    err = info.value
    assert isinstance(err, WorkerError) and err.rank == 1
    assert "rank 1" in str(err) and "fail_on_rank_1" in err.remote_traceback
    assert 'raise ValueError("rank one is broken")' in str(err)
    # the next launch works at once
    assert notebook_launcher(fail_on_rank_1, args=("none",), num_processes=1) == "ok"
    assert notebook_launcher(env_of_worker, num_processes=2)["RANK"] == "0"


def test_custom_exception_keeps_type_and_attributes():
    with pytest.raises(CustomError) as info:
        notebook_launcher(fail_on_rank_1, args=("custom",), num_processes=2)
    assert info.value.code == 7 and info.value.rank == 1


def test_first_real_failure_wins_over_secondary():
    with pytest.raises(KeyError) as info:
        notebook_launcher(secondary_first, num_processes=2)
    assert info.value.rank == 1
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "Connection closed by peer" in notes


def _failure(rank, t, qualname, message, module="builtins"):
    info = {"type_module": module, "type_qualname": qualname, "message": message}
    return Failure(rank, 100 + rank, t, "exception", info)


def test_failure_classification_and_choice():
    peer_lost = _failure(0, 1.0, "RuntimeError", "Connection closed by peer [127.0.0.1]:5")
    dist_error = _failure(1, 1.1, "DistBackendError", "NCCL error", "torch.distributed")
    user_timeout = _failure(2, 2.0, "ValueError", "request timed out")
    assert peer_lost.secondary and dist_error.secondary and not user_timeout.secondary
    assert pick_failure([peer_lost, dist_error, user_timeout]) is user_timeout
    assert pick_failure([dist_error, peer_lost]) is peer_lost  # all secondary: the earliest
    missing = _failure(4, 3.0, "FileNotFoundError", "no checkpoint", "builtins")
    err = remote_exception(missing)  # OSError subclasses have a __new__ of their own
    assert isinstance(err, FileNotFoundError) and isinstance(err, WorkerError) and err.rank == 4
    abort = Failure(3, 103, 0.5, "signal", code=signal.SIGABRT, stack="distributed_c10d.py")
    segv = Failure(3, 103, 0.5, "signal", code=signal.SIGSEGV)
    assert abort.secondary and not segv.secondary


def test_unpicklable_return_value_is_explained():
    with pytest.raises(TypeError, match="cannot be sent back to the kernel") as info:
        notebook_launcher(returns_generator, num_processes=2)
    assert info.value.rank == 0 and "generator" in str(info.value)


def test_death_by_signal_names_rank_and_signal():
    with pytest.raises(WorkerError, match="SIGKILL") as info:
        notebook_launcher(killed_rank_1, num_processes=2)
    assert info.value.rank == 1 and "rank 1" in str(info.value)


def test_hang_names_stuck_rank_and_shows_stacks():
    with pytest.raises(WorkerTimeoutError) as info:
        notebook_launcher(stuck_rank_1, num_processes=2, timeout=2)
    err = info.value
    assert err.stuck_ranks == [1]
    assert "stuck_rank_1" in err.stacks[1] and "test_launcher.py" in err.stacks[1]
    assert os.path.join("nbaccel", "launch") not in err.stacks[1]  # the user's frames only
    assert "time.sleep(600)" in err.stacks[1]  # where the stuck rank was
    assert "rank(s) 1 appear stuck" in str(err)
    assert notebook_launcher(rank_tensor, args=(0.0,), num_processes=2) is not None


def test_max_restarts_starts_the_group_again(tmp_path):
    err = io.StringIO()
    value = notebook_launcher(
        fails_first_time, args=(str(tmp_path / "m"),), num_processes=2, max_restarts=1, output=err
    )
    assert value == "second attempt"
    assert "restarting, attempt 1 of 1" in err.getvalue()


def test_a_restart_says_when_it_started_and_which_checkpoint_it_resumed_from(tmp_path):
    err = io.StringIO()
    where, _ = notebook_launcher(
        resumes_after_failing_once, (f"file://{tmp_path}",), num_processes=2, max_restarts=1,
        output=err,
    )  # fmt: skip
    assert where == str(tmp_path / "checkpoints" / "checkpoint_0")
    said = err.getvalue()
    assert "attempt 1 started, " in said and "s after the failure" in said, said
    assert f"attempt 1 resumed from {where} (step 0), " in said, said


# ---------------------------------------------------------------- pre-flight
@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"num_processes": 0}, ValueError, "num_processes=0"),
        ({"num_processes": -2}, ValueError, "num_processes=-2"),
        ({"num_processes": 1.5}, TypeError, "num_processes=1.5"),
        ({"num_processes": "2"}, TypeError, "num_processes='2'"),
        ({"num_processes": 2, "node_rank": 1}, ValueError, "node_rank=1 must be < num_nodes=1"),
        ({"num_processes": 2, "mixed_precision": "fp12"}, ValueError, "mixed_precision='fp12'"),
        ({"num_processes": 2, "start_method": "forkserver"}, ValueError, "start_method"),
        ({"num_processes": 2, "args": 5}, TypeError, "args=5"),
        ({"num_processes": 2, "use_port": 70000}, ValueError, "use_port=70000"),
    ],
)
def test_bad_arguments_raise_before_any_process(no_workers, kwargs, error, needle):
    with pytest.raises(error, match=needle.replace("(", r"\(").replace(".", r"\.")):
        notebook_launcher(rank_tensor, **kwargs)


@pytest.mark.parametrize("function", [None, 42, "train"])
def test_a_call_result_is_not_a_function(no_workers, function):
    with pytest.raises(TypeError, match="not its result"):
        notebook_launcher(function, num_processes=2)


def test_accelerator_already_in_kernel_is_refused(no_workers):
    from nbaccel.runtime.process import state

    state.reset_state()
    state.get_state(cpu=True)
    try:
        with pytest.raises(ValueError, match="Accelerator was already created"):
            notebook_launcher(rank_tensor, args=(0,), num_processes=2)
    finally:
        state.reset_state()


def test_busy_port_is_named(no_workers):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"use_port={port} is already in use"):
            notebook_launcher(rank_tensor, args=(0,), num_processes=2, use_port=port)


def test_unreachable_master_names_address_and_port(no_workers):
    port = _free_port()
    with pytest.raises(LaunchError, match=f"127.0.0.1:{port}"):
        notebook_launcher(
            rank_tensor,
            args=(0,),
            num_processes=1,
            num_nodes=2,
            node_rank=1,
            use_port=port,
            timeout=1,
        )


def test_fork_guard_uses_the_real_cuda_check(no_workers, monkeypatch):
    calls = []
    real = torch.cuda.is_initialized

    def spy():
        calls.append(1)
        return real()

    monkeypatch.setattr(torch.cuda, "is_initialized", spy)
    monkeypatch.setattr(torch.cuda, "_initialized", True)  # simulate an initialised CUDA
    with pytest.raises(CUDAInitializedError) as info:
        notebook_launcher(rank_tensor, args=(0,), num_processes=2, start_method="fork")
    assert calls, "the guard must call torch.cuda.is_initialized()"
    message = str(info.value)
    assert "restart the kernel" in message and "start_method='spawn'" in message
    # "auto" switches to spawn instead of refusing
    plan = plan_for(rank_tensor, (0,), num_processes=2)
    assert plan.method == "spawn" and plan.payload


def test_first_cuda_init_is_recorded(monkeypatch):
    monkeypatch.setattr(_cudatrace, "_first_init", None)
    fake = types.ModuleType("fake_cuda")
    fake._initialized = False

    def _lazy_init():
        fake._initialized = True

    fake._lazy_init = _lazy_init
    _cudatrace._wrap(fake)

    def touch_cuda_in_a_cell():
        fake._lazy_init()

    touch_cuda_in_a_cell()
    where = _cudatrace.describe_first_init()
    assert "touch_cuda_in_a_cell" in where and "fake._lazy_init()" in where
    assert "touch_cuda_in_a_cell" in str(_preflight.cuda_fork_error())


# ---------------------------------------------------------------- while it runs
def test_threads_per_worker(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    expected = max(1, nbaccel.platform.environment.cpu_count() // 2)
    if forksafe.unreleasable_openmp_runtimes():  # torch 2.4: 1 thread per forked worker
        expected = 1
    results = notebook_launcher(threads_of_worker, num_processes=2, return_all_ranks=True)
    assert results == [(expected, str(expected))] * 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice wins where fork allows it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # torch 2.4: see the test below
        results = notebook_launcher(threads_of_worker, num_processes=2, return_all_ranks=True)
    allowed = "1" if forksafe.unreleasable_openmp_runtimes() else "3"
    assert [r[1] for r in results] == [allowed, allowed]


def two_thread_matmul() -> int:
    torch.set_num_threads(2)  # a parallel region in the child, as real training has
    a = torch.randn(256, 256)
    return int((a @ a).shape[0])


def test_fork_after_the_kernel_used_openmp_does_not_hang():
    a = torch.randn(256, 256)
    (a @ a).sum()  # the kernel's OpenMP pool is running, as after any notebook cell
    assert notebook_launcher(two_thread_matmul, num_processes=2, timeout=60) == 256


UNRELEASABLE_POOL = textwrap.dedent(
    """
    import io, json, os, warnings, torch
    from nbaccel import notebook_launcher
    from nbaccel.platform import environment, forksafe

    environment.cpu_count = lambda: 4  # a 4-core machine: 2 compute threads per worker

    def default_threads_matmul():
        a = torch.randn(512, 512)  # big enough for a parallel region
        return int((a @ a).shape[0]), torch.get_num_threads()

    def own_threads_matmul():
        torch.set_num_threads(2)  # as many training scripts do first
        return default_threads_matmul()

    if __name__ == "__main__":
        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        (a @ a).sum()  # the kernel's OpenMP pool now has 2 threads
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            size, threads = notebook_launcher(default_threads_matmul, num_processes=2, timeout=60)
        out = io.StringIO()  # the workers' stderr, as the cell would show it
        own_size, own_threads = notebook_launcher(
            own_threads_matmul, num_processes=2, timeout=60, output=out
        )
        print(json.dumps({
            "size": size, "threads": threads,
            "warned": any("OpenMP" in str(w.message) for w in caught),
            "stuck": bool(forksafe.unreleasable_openmp_runtimes()),
            "own": [own_size, own_threads], "worker_output": out.getvalue(),
        }))
    """
)


def test_forked_workers_never_wait_on_an_unreleasable_openmp_pool(tmp_path):
    # torch 2.4's libgomp cannot release the kernel's pool before fork, and a worker's first
    # multi-threaded op then waited for ever (on both ranks: no finished rank, so no hang
    # report either), also when the function raised the thread count itself. In a fresh
    # interpreter: such a pool, once started, stays in the process.
    script = tmp_path / "kernel.py"
    script.write_text(UNRELEASABLE_POOL)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=900, env=env
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["size"] == 512
    assert out["threads"] == (1 if out["stuck"] else 2)
    assert out["warned"] == out["stuck"]
    # the function's own torch.set_num_threads(2): kept at 1, with the reason, where it
    # would hang; honoured elsewhere
    assert out["own"] == [512, 1 if out["stuck"] else 2], out
    kept = "torch.set_num_threads(2) in a forked worker" in out["worker_output"]
    assert kept == out["stuck"], out["worker_output"]


def test_output_is_forwarded_whole_lines_with_prefix():
    out = io.StringIO()
    notebook_launcher(
        print_long_lines,
        args=(100, 3000),
        num_processes=2,
        output=out,
        log_line_prefix_template="[r{rank}] ",
    )
    lines = out.getvalue().splitlines()
    assert len(lines) == 202
    for line in lines:
        prefix, _, text = line.partition(" ")
        assert prefix in ("[r0]", "[r1]")
        expected_char = "ab"[int(prefix[2])]
        assert text == "no newline at the end" or text == expected_char * 3000


def test_default_prefix_on_every_line_of_the_cell_streams(capsys):
    notebook_launcher(print_long_lines, args=(2, 3), num_processes=2)
    out = capsys.readouterr().out.splitlines()
    assert sorted(out) == [
        "[rank0] aaa",
        "[rank0] aaa",
        "[rank0] no newline at the end",
        "[rank1] bbb",
        "[rank1] bbb",
        "[rank1] no newline at the end",
    ]


def log_a_line():
    import logging

    logging.getLogger("nbaccel_test_kernel_logger").warning("from rank %s", os.environ["RANK"])


def test_kernel_logging_handlers_on_the_cell_stream_reach_the_output(capsys):
    # the kernel finds such handlers once before forking; each worker repoints them
    import logging

    logger = logging.getLogger("nbaccel_test_kernel_logger")
    handler = logging.StreamHandler(sys.stdout)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        notebook_launcher(log_a_line, num_processes=2)
    finally:
        logger.removeHandler(handler)
    out = capsys.readouterr().out.splitlines()
    assert sorted(out) == ["[rank0] from rank 0", "[rank1] from rank 1"]


def test_rendezvous_listens_on_loopback_only(tmp_path):
    looked = tmp_path / "looked"
    handle = notebook_launcher(
        all_reduce_and_wait_for, args=(str(looked),), num_processes=2, block=False
    )
    try:
        # the event is both ranks past their first all-reduce (each says so with a file and
        # then waits for `looked`); the bound only guards against a hang
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not all(
            (tmp_path / f"looked.rank{rank}").exists() for rank in (0, 1)
        ):
            assert not handle.done(), handle.exception()  # ended before its ranks were up
            time.sleep(0.05)
        me = psutil.Process()
        listening = []
        for p in [me, *me.children(recursive=True)]:
            try:
                connections = p.net_connections()
            except psutil.NoSuchProcess:
                continue  # a short-lived helper process (not a worker) ended meanwhile
            listening += [c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN]
        assert listening, "expected the rendezvous store to be listening"
        assert all(ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for ip in listening), listening
    finally:
        looked.touch()
        assert torch.equal(handle.result(timeout=600), torch.tensor([2.0]))
    mine = [c for c in psutil.Process().net_connections() if c.status == psutil.CONN_LISTEN]
    assert mine == []


def test_user_code_may_choose_its_own_rendezvous():
    assert notebook_launcher(own_init_method, args=(_free_port(),), num_processes=2) == 2.0


def test_kernel_state_restored_after_success_and_failure():
    handlers = {
        s: signal.getsignal(s)
        for s in signal.valid_signals()
        if s not in (signal.SIGKILL, signal.SIGSTOP)
    }
    env, cwd = dict(os.environ), os.getcwd()
    fds = len(os.listdir("/proc/self/fd"))
    notebook_launcher(rank_tensor, args=(0,), num_processes=2)
    with pytest.raises(ValueError):
        notebook_launcher(fail_on_rank_1, num_processes=2)
    assert dict(os.environ) == env and os.getcwd() == cwd
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert len(os.listdir("/proc/self/fd")) == fds
    assert [c for c in psutil.Process().net_connections() if c.status == "LISTEN"] == []


# ---------------------------------------------------------------- block=False
def test_block_false_handle_status_listeners_result():
    handle = notebook_launcher(publish_steps, args=(20, 0.05), num_processes=2, block=False)
    assert isinstance(handle, LaunchHandle)
    events = []
    handle.add_listener(lambda rank, kind, data: events.append((rank, kind)))
    assert not handle.done()
    assert handle.result(timeout=600) == "0"
    assert handle.done() and handle.wait(0)
    status = handle.status()
    assert sorted(status) == [0, 1]
    assert all(s["state"] == "finished" and s["step"] == 19 for s in status.values())
    assert status[0]["scalars"]["loss"] == pytest.approx(1 / 20)
    assert (0, "log") in events and (1, "state") in events


def test_block_false_stop_terminates_every_worker():
    handle = notebook_launcher(publish_steps, args=(10_000, 0.01), num_processes=2, block=False)
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline and None in handle.pids.values():
        time.sleep(0.05)
    pids = [p for p in handle.pids.values() if p]
    assert len(pids) == 2
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.1)
    handle.stop()
    assert handle.done()  # stop() returns once every worker is gone
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    assert {s["state"] for s in handle.status().values()} == {"stopped"}
    with pytest.raises(LaunchError, match="stopped"):
        handle.result()


def env_after_rendezvous():
    join_group(30)
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return env_of_worker() | {"sum": t.item()}


def test_two_nodes_in_one_process():
    port = _free_port()
    node0 = notebook_launcher(
        env_after_rendezvous, num_processes=1, num_nodes=2, node_rank=0, use_port=port, block=False
    )
    node1 = notebook_launcher(
        env_after_rendezvous, num_processes=1, num_nodes=2, node_rank=1, use_port=port
    )
    assert node1["sum"] == 2.0
    rank0 = node0.result(timeout=600)
    assert (rank0["RANK"], rank0["WORLD_SIZE"], rank0["GROUP_RANK"]) == ("0", "2", "0")
    assert (node1["RANK"], node1["WORLD_SIZE"], node1["GROUP_RANK"]) == ("1", "2", "1")


# ---------------------------------------------------------------- spawn and interrupts
def _spawned_rank(offset: float) -> tuple[torch.Tensor, list[str]]:
    return rank_tensor(offset), os.environ.get("PYTHONPATH", "").split(os.pathsep)


def test_spawn_mode_returns_values_and_never_puts_the_package_folder_on_the_path():
    values = notebook_launcher(
        _spawned_rank, args=(0.5,), num_processes=2, start_method="spawn", return_all_ranks=True
    )
    assert [v.tolist() for v, _ in values] == [[0.5, 0.5], [1.5, 1.5]]
    # On the path, nbaccel/ would shadow the standard library (nbaccel/logging.py is
    # found for `import logging`) in the fresh interpreter until the job's sys.path is in.
    package = os.path.dirname(os.path.abspath(nbaccel.__file__))
    for _, path in values:
        assert package not in path and os.path.dirname(package) in path


NOTEBOOK_STYLE = textwrap.dedent(
    """
    import os, sys, torch
    from nbaccel import notebook_launcher
    SCALE = 3                      # a global from an "earlier cell"
    square = lambda v: v * v       # a lambda

    class Net(torch.nn.Module):    # a class defined in the notebook
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

    def train():
        model = Net()
        print("params", sum(p.numel() for p in model.parameters()), flush=True)
        return square(SCALE) + int(os.environ["RANK"])

    print("result", notebook_launcher(train, num_processes=2, start_method="spawn"))
    """
)


def test_spawn_ships_main_module_functions_lambdas_and_classes(tmp_path):
    script = tmp_path / "notebook_like.py"
    script.write_text(NOTEBOOK_STYLE)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert "result 9" in out.stdout
    assert out.stdout.count("params 3") == 2


INTERRUPTIBLE = textwrap.dedent(
    """
    import signal, time, psutil
    from nbaccel import notebook_launcher

    # as a kernel does for each cell: the interrupt raises KeyboardInterrupt even when
    # this process inherited SIGINT ignored (pytest started as a background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def train():
        import torch.distributed as dist
        dist.init_process_group("gloo")
        print("training", flush=True)
        while True:
            dist.barrier()
            time.sleep(0.01)

    try:
        notebook_launcher(train, num_processes=2)
    except KeyboardInterrupt:
        print("KeyboardInterrupt; children:", psutil.Process().children(recursive=True))
    """
)


def test_interrupt_kills_every_worker(tmp_path):
    script = tmp_path / "interruptible.py"
    script.write_text(INTERRUPTIBLE)
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, like a kernel
    )
    try:
        assert "training" in proc.stdout.readline()
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) == 2
        os.killpg(proc.pid, signal.SIGINT)  # what the notebook's interrupt button does
        out = proc.communicate(timeout=600)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "KeyboardInterrupt; children: []" in out
    assert not any(w.is_running() and w.status() != "zombie" for w in workers)
