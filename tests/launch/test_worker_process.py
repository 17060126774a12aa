"""The kernel's side of a worker process: it is always reaped, and never lost to an interrupt.

Real child processes; the conftest fixture fails a test that leaves a child (or a zombie:
an exited child nobody waited for) behind.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from waits import HANG_GUARD_S

from nbaccel import notebook_launcher
from nbaccel.launch.engine._group import WorkerProcess
from nbaccel.launch.start import _local

pytestmark = pytest.mark.integration


def _child_ignoring_sigterm() -> int:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.close(read)
            os.write(write, b"ready")
            while True:
                time.sleep(1)
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 5) == b"ready"
    os.close(read)
    return pid


def _is_our_zombie_or_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).ppid() == os.getpid()
    except psutil.NoSuchProcess:
        return False


def test_a_worker_that_outlives_the_wait_is_reaped_when_it_exits():
    # e.g. SIGKILLed while stuck in uninterruptible I/O on an overloaded machine: the
    # launcher stops waiting after KILL_WAIT seconds, but the kernel must not keep a zombie
    pid = _child_ignoring_sigterm()
    proc = WorkerProcess(rank=0, pid=pid, fds={})
    proc.send_signal(signal.SIGTERM)
    assert proc.reap(0.2) is None  # still running: SIGTERM is ignored
    os.kill(pid, signal.SIGKILL)  # it exits later, with nobody in the launcher waiting
    deadline = time.monotonic() + HANG_GUARD_S
    while _is_our_zombie_or_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _is_our_zombie_or_alive(pid), psutil.Process(pid).status()
    assert proc.returncode == -signal.SIGKILL
    assert proc.poll() == -signal.SIGKILL  # the status is read once and kept


def test_kill_reaps_even_with_no_time_to_wait():
    pid = _child_ignoring_sigterm()
    proc = WorkerProcess(rank=0, pid=pid, fds={})
    proc.kill(timeout=0.0)
    deadline = time.monotonic() + HANG_GUARD_S
    while proc.returncode is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.returncode == -signal.SIGKILL
    assert not _is_our_zombie_or_alive(pid)


def test_a_worker_whose_main_thread_ended_is_not_alive_before_it_can_be_reaped():
    # a kept rank leaving at debug_timeout: its main thread gone, another thread still ending;
    # /proc says zombie, waitpid says "not yet": nbaccel.debug() must not open a session there
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        import ctypes
        import threading

        os.close(write)
        threading.Thread(target=lambda: (os.read(read, 1), os._exit(0))).start()
        ctypes.CDLL(None).pthread_exit(None)  # the main thread ends, the process goes on
    os.close(read)
    proc = WorkerProcess(rank=0, pid=pid, fds={})
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert proc.poll() is None  # not reapable yet: a thread still runs
        assert not proc.alive()
    finally:
        os.close(write)  # the child's thread reads EOF and exits
        assert proc.wait(30) == 0


def _never_runs() -> None:  # pragma: no cover - the launch is interrupted first
    time.sleep(60)


def test_an_interrupt_during_fork_does_not_lose_the_worker(monkeypatch, kernel_sigint):
    # A notebook interrupt that arrives while os.fork() runs is raised the moment the call
    # returns. Here the interrupt arrives just after the first fork: the launch must end
    # with KeyboardInterrupt and with that worker killed and reaped, not running on alone.
    real_fork = _local._fork
    forked: list[int] = []

    def fork_then_interrupt(spec, ends, job):
        pid = real_fork(spec, ends, job)
        forked.append(pid)
        os.kill(os.getpid(), signal.SIGINT)
        return pid

    monkeypatch.setattr(_local, "_fork", fork_then_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            notebook_launcher(_never_runs, num_processes=2, start_method="fork")
        assert len(forked) == 1, "the interrupt was not raised right after the first fork"
        deadline = time.monotonic() + HANG_GUARD_S
        while _is_our_zombie_or_alive(forked[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _is_our_zombie_or_alive(forked[0]), "the forked worker was left behind"
    finally:
        for pid in forked:  # before the fix: do not leak it into the next tests
            if _is_our_zombie_or_alive(pid):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def _nccl_settings() -> str | None:
    return os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")


def test_workers_keep_nccl_from_ending_the_process_unless_the_user_said(monkeypatch):
    # NCCL's watchdog would abort the worker on a collective timeout (no GPU here: the
    # setting is what torch reads when an NCCL group forms); the user's own value wins
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    values = notebook_launcher(
        _nccl_settings, num_processes=2, start_method="fork", return_all_ranks=True
    )
    assert values == ["2", "2"]
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    assert notebook_launcher(_nccl_settings, num_processes=2, start_method="fork") == "1"
