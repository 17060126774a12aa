"""Post-mortem debugging driven from this process with real workers (2 CPU workers, gloo):
pdb served by a worker over its channel (scripted with ``commands=``), a debug=True launch's
failed rank leaving after ``debug_timeout``, a worker that exits during a session, the
messages when no session is possible, and bad arguments. The real-kernel flow (the
kernel's own input requests answered) is in test_kernel_debug.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
from waits import HANG_GUARD_S

import nbaccel
from nbaccel import notebook_launcher, start_workers
from nbaccel.errors import ConfigError, LaunchError
from nbaccel.launch.debug import _kept

pytestmark = pytest.mark.integration


def _rank() -> int:
    return int(os.environ["RANK"])


def nested(depth: int) -> None:
    secret = depth * 10
    if depth == 0:
        raise KeyError(f"missing {secret}")
    nested(depth - 1)


def fails_on_one() -> int:
    if _rank() == 1:
        nested(2)
    return 0


def fails_everywhere() -> None:
    local = f"rank {_rank()}"
    raise ValueError(local)


@pytest.fixture(autouse=True)
def _fresh_record():
    _kept._last.clear()
    yield
    _kept._last.clear()


def test_pdb_runs_in_the_worker_over_its_channel(capsys):
    with start_workers(num_processes=2, start_method="fork") as pool:
        with pytest.raises(KeyError):
            pool.run(fails_on_one)
        worker_pid = pool.pids[1]
        commands = ["p secret, os.getpid()", "up", "p secret", "up", "up", "up", "down", "p depth"]
        nbaccel.debug(commands=[*commands, "!print('printed', depth)", "where"])
        out = capsys.readouterr().out
        assert f"(0, {worker_pid})" in out  # evaluated in the worker, not in this process
        assert "(Pdb) p secret\n10\n" in out  # `up` reached the caller's frame
        assert "*** Oldest frame" in out  # the user's outermost frame is the top: no nbaccel
        assert "(Pdb) p depth\n2\n" in out
        assert "printed 2\n" in out  # the session's own stdout comes back too
        where = out[out.rindex("(Pdb) where") :]  # then the commands ran out: end of input
        assert "fails_on_one()" in where and "nbaccel" not in where, out
        assert where.rstrip().endswith('-> raise KeyError(f"missing {secret}")'), out
        # a second session on the same kept traceback, then the pool goes on
        nbaccel.debug(1, commands=["p depth", "q"])
        assert "(Pdb) p depth\n0\n" in capsys.readouterr().out
        assert pool.call(_rank, return_all_ranks=True) == [0, 1]
        assert pool.restarts == 0 and pool.pids[1] == worker_pid


def test_every_failed_rank_can_be_debugged_and_the_first_is_the_default(capsys):
    with start_workers(num_processes=2, start_method="spawn") as pool:
        with pytest.raises(ValueError):
            pool.run(fails_everywhere)
        first = _kept.last()
        assert first is not None and set(first.holding()) == {0, 1}
        for rank in (first.first, 1 - first.first):
            nbaccel.debug(rank, commands=["p local"])
            assert f"'rank {rank}'" in capsys.readouterr().out
        pool.restart()  # the failed job's workers go: said so, not "the worker is gone"
        with pytest.raises(LaunchError, match=r"no post-mortem session .*restarted its workers"):
            nbaccel.debug()


def test_a_worker_that_exits_during_the_session_is_reported_and_replaced():
    with start_workers(num_processes=2, start_method="fork") as pool:
        with pytest.raises(KeyError):
            pool.run(fails_on_one)
        with pytest.raises(LaunchError, match=r"exited \(code 3\) during the debugging session"):
            nbaccel.debug(commands=["!os._exit(3)"])
        assert pool.call(_rank, return_all_ranks=True) == [0, 1]  # the pool restarted
        assert pool.restarts == 1


@pytest.mark.timeout(120)
def test_launch_rank_leaves_after_debug_timeout():
    import threading

    me = psutil.Process()
    before = set(threading.enumerate())  # an earlier module's threads are not this launch's
    with pytest.raises(KeyError):
        notebook_launcher(fails_on_one, num_processes=2, debug=True, debug_timeout=2)
    # the kept rank is owned like a pool's workers: no thread of nbaccel's watches it (a
    # reaper waits only for a SIGKILLed process that is slow to vanish, on a loaded machine)
    new = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("nbaccel")]
    assert [n for n in new if not n.startswith("nbaccel-reap-")] == [], new
    assert _kept.holding_any()
    deadline = time.monotonic() + HANG_GUARD_S
    while not all(_gone(p.pid) for p in me.children()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in me.children() if not _gone(p.pid)]
    assert not left, _where(left)  # it left by itself at debug_timeout
    with pytest.raises(LaunchError, match=r"has left.*debug_timeout"):
        nbaccel.debug()
    assert me.children() == [] and not _kept.holding_any()  # that look reaped it


def test_launch_without_debug_says_how_to_keep_the_rank():
    with pytest.raises(KeyError):
        notebook_launcher(fails_on_one, num_processes=2)
    with pytest.raises(LaunchError, match=r"run it with debug=True"):
        nbaccel.debug()


def test_nothing_failed_is_a_clear_message_in_a_fresh_process():
    code = "import nbaccel\ntry:\n    nbaccel.debug()\nexcept Exception as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("nothing to debug: no job has failed"), out


def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(TypeError, match="rank='1' must be a rank number"):
        nbaccel.debug("1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="commands='q' must be a list"):
        nbaccel.debug(commands="q")
    with pytest.raises(ConfigError, match="debug_timeout=0 must be seconds > 0"):
        notebook_launcher(fails_on_one, num_processes=2, debug=True, debug_timeout=0)
    with pytest.raises(TypeError, match="debug='yes' must be True or False"):
        notebook_launcher(fails_on_one, num_processes=2, debug="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="start_workers\\(\\) takes no debug_timeout"):
        start_workers(num_processes=2, debug_timeout=5)
    assert psutil.Process().children() == []


def fails_while_peer_waits_in_a_collective() -> None:
    import torch
    import torch.distributed as dist

    from nbaccel import Accelerator

    Accelerator()
    if dist.get_rank() == 1:
        grads = torch.ones(3)
        raise RuntimeError(f"NaN in {grads.shape}")
    dist.all_reduce(torch.ones(3))  # rank 0 waits here for ever: the pool must restart


@pytest.mark.timeout(180)
def test_failed_rank_stays_when_the_pool_restarts_its_workers(capsys):
    with start_workers(num_processes=2, start_method="fork", timeout=5) as pool:
        old = pool.pids
        with pytest.raises(RuntimeError, match="NaN in"):
            pool.run(fails_while_peer_waits_in_a_collective)
        assert pool.restarts == 1 and "Failed rank(s) [1] stay" in capsys.readouterr().err
        kept = psutil.Process(old[1])
        assert kept.is_running() and _gone(old[0])  # only the failed rank stayed
        nbaccel.debug(commands=["p grads", "q"])
        out = capsys.readouterr().out
        assert "tensor([1., 1., 1.])" in out, out
        assert "(waiting in torch.distributed.all_reduce)" in out, out  # rank 0 at the failure
        assert psutil.wait_procs([kept], timeout=10)[1] == []  # let go after its session
        with pytest.raises(LaunchError, match="was let go"):
            nbaccel.debug()
        assert pool.call(_rank, return_all_ranks=True) == [0, 1]  # the new workers


@pytest.mark.timeout(180)
def test_closing_the_pool_ends_a_rank_kept_for_debugging():
    pool = start_workers(num_processes=2, start_method="fork", timeout=5)
    with pytest.raises(RuntimeError):
        pool.run(fails_while_peer_waits_in_a_collective)
    kept = psutil.Process(_kept.last().group.procs[1].pid)  # type: ignore[union-attr]
    pool.close()
    assert psutil.wait_procs([kept], timeout=10)[1] == []
    with pytest.raises(LaunchError, match="the pool was closed"):
        nbaccel.debug()


def _where(procs: list[psutil.Process]) -> str:
    """What each process still running does (py-spy's dump of its Python stacks): a CI run
    once found a kept rank still there 30 s after its debug_timeout, and nothing said where."""
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    out = []
    for proc in procs:
        try:
            cmd = " ".join(proc.cmdline()[:6])
            dump = subprocess.run(
                [spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=30
            )
            out.append(f"pid {proc.pid} ({cmd}):\n{dump.stdout}{dump.stderr}")
        except (OSError, psutil.Error, subprocess.SubprocessError) as err:
            out.append(f"pid {proc.pid}: {err!r}")
    return "still running:\n" + "\n".join(out)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(120)
def test_interrupt_stops_a_long_evaluation_and_the_session_goes_on(capsys, kernel_sigint):
    import signal
    import threading

    with start_workers(num_processes=2, start_method="fork") as pool:
        with pytest.raises(KeyError):
            pool.run(fails_on_one)
        worker = psutil.Process(pool.pids[1])

        def press_interrupt_once_the_worker_spins() -> None:
            start = worker.cpu_times().user
            while worker.cpu_times().user - start < 1.0:  # the endless loop runs
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)  # the interrupt button, in this "kernel"

        threading.Thread(target=press_interrupt_once_the_worker_spins, daemon=True).start()
        nbaccel.debug(commands=["!while True: pass", "p secret + 1", "q"])
        out = capsys.readouterr().out
        assert "(interrupting rank 1; press again to leave the session)" in out
        assert "*** KeyboardInterrupt" in out and "(Pdb) p secret + 1\n1\n" in out, out
        assert pool.call(_rank, return_all_ranks=True) == [0, 1]
        assert pool.restarts == 0


def exits_on_one() -> None:
    if _rank() == 1:
        os._exit(3)


def test_a_rank_that_exited_says_why_no_session_is_possible():
    with start_workers(num_processes=2, start_method="fork") as pool:
        with pytest.raises(nbaccel.WorkerError):
            pool.run(exits_on_one)
        with pytest.raises(LaunchError, match=r"rank 1 exited with code 3 .*the process is gone"):
            nbaccel.debug()
        assert pool.call(_rank, return_all_ranks=True) == [0, 1]
