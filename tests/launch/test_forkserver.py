"""The fork server in one process (no kernel): who takes it, how a worker's death comes
back through it, and a driver touched before nbaccel's first use said in one line."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from waits import HANG_GUARD_S

from nbaccel.errors import WorkerError
from nbaccel.launch.channel._jobs import dill_for_workers
from nbaccel.launch.launcher import launch
from nbaccel.launch.start import _forkserver
from nbaccel.launch.start._local import take_fork_server
from nbaccel.launch.testing import plan_for

ROOT = Path(__file__).resolve().parents[2]


def test_the_setting_decides_and_unset_means_no_server_outside_a_gpu_kernel() -> None:
    assert _forkserver.wanted({"NBACCEL_FORK_SERVER": "1"}) is True
    assert _forkserver.wanted({"NBACCEL_FORK_SERVER": "off"}) is False
    assert _forkserver.wanted({}) is False  # pytest is no interactive kernel


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setenv("NBACCEL_FORK_SERVER", "1")
    _forkserver._reset()
    done = threading.Event()
    threading.Thread(target=lambda: (take_fork_server(), done.set()), daemon=True).start()
    assert done.wait(60) and _forkserver.server_pid() is None  # never from another thread
    take_fork_server()
    pid = _forkserver.server_pid()
    assert pid is not None and psutil.Process(pid).ppid() == os.getpid()
    try:
        yield pid
    finally:
        assert _forkserver._server is not None
        _forkserver._server.stop()
        _forkserver._reset()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


def rank_or_die(code: int) -> list[int]:
    import os

    if os.environ["RANK"] == "1":
        if code < 0:  # killed by a signal, as the OOM killer does
            os.kill(os.getpid(), -code)
        os._exit(code)
    return [os.getppid()]


def from_server(function, *args):  # type: ignore[no-untyped-def]
    plan = plan_for(function, args, num_processes=2)
    payload = dill_for_workers((function, args, {}), "the function")
    return dataclasses.replace(plan, method="forkserver", payload=payload)


@pytest.mark.integration
def test_a_worker_exit_comes_back_through_the_server_as_from_a_fork(server: int) -> None:
    assert launch(from_server(os.getppid)) == server
    # the exit status the server reaped, as the kernel reads its own children's
    for code, said in ((7, "the worker exited with code 7"), (-signal.SIGKILL, "SIGKILL")):
        with pytest.raises(WorkerError) as caught:
            launch(from_server(rank_or_die, code))
        first = str(caught.value).split("\n")[0]
        assert first.startswith("rank 1 (pid ") and said in first, first


@pytest.mark.integration
def test_a_server_that_dies_at_the_request_means_this_launch_spawns(
    server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Killed between the look before the launch and the request for a worker (its end of
    # file not read yet): CI on a loaded machine got a LaunchError instead of a spawned
    # launch. A stopped server answers nothing either, which makes the window certain.
    monkeypatch.setattr(_forkserver, "_ANSWER_TIMEOUT", 1.0)
    os.kill(server, signal.SIGSTOP)
    try:
        assert launch(from_server(os.getppid)) == os.getpid()  # spawned: this process's child
        assert _forkserver.usable() is False
        assert "did not answer" in str(_forkserver.why_not())
        # the server that did not answer was ended and reaped: no zombie left
        assert not psutil.pid_exists(server) or _wait_gone(server)
    finally:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            with contextlib.suppress(ProcessLookupError):
                os.kill(server, sig)


def _wait_gone(pid: int) -> bool:
    """Gone from the process table (a zombie is still there: it must be reaped by
    nbaccel's side, which this only watches)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not psutil.pid_exists(pid)


DRIVER_FIRST = """
import ctypes, os, sys
sys.path.insert(0, {platform!r})
from fake_cuda import build_fake_driver
from pathlib import Path
os.environ["NBACCEL_FORK_SERVER"] = "1"
ctypes.CDLL(str(build_fake_driver(Path({folder!r})))).cuInit(0)  # before nbaccel is used
from nbaccel.launch.start import _forkserver
from nbaccel.launch.testing import plan_for

# planned, not run: the decision and its line (spawned launches are tested elsewhere)
print(plan_for(print, num_processes=2).method, plan_for(print, num_processes=2).method,
      _forkserver.server_pid())
"""


@pytest.mark.integration
def test_a_driver_touched_before_the_first_use_means_spawn_said_once(tmp_path: Path) -> None:
    code = DRIVER_FIRST.format(platform=str(ROOT / "tests" / "platform"), folder=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["spawn", "spawn", "None"], done.stdout
    said = [line for line in done.stderr.splitlines() if "fork server" in line]
    assert len(said) == 1 and "since before nbaccel was first used" in said[0], done.stderr
    assert "%load_ext nbaccel" in said[0]
