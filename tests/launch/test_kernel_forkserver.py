"""The fork server in a REAL kernel: workers still fork after the notebook touched CUDA.

The CUDA driver is the stand-in of ``tests/platform/fake_cuda.py`` (every call fails with 3
until ``cuInit``), loaded in the setup cell as torch's CUDA build maps the real one: mapped,
untouched. ``%load_ext nbaccel`` then takes the fork server (``NBACCEL_FORK_SERVER=1``: a
CPU machine has no NVIDIA driver, where it is taken on its own); a later ``drv.cuInit(0)``
is the notebook's ``torch.cuda.is_available()``. Workers forked by the server see an
untouched driver; their parent is the server; results equal fork's and spawn's; nothing is
left behind, after a clean shutdown nor after ``kill -9`` of the kernel; a dead server
means spawn, said in one line.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from kernel_harness import KernelSession, describe_processes, isolated_env, wait_gone
from waits import HANG_GUARD_S

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

SETUP = """
import ctypes, os, signal
from nbaccel import notebook_launcher, start_workers
from nbaccel.launch.start import _forkserver
from nbaccel.platform import cudafork
drv = ctypes.CDLL({library!r})  # mapped, untouched: the notebook has not used CUDA yet

def where(x):
    import os
    from nbaccel.platform import cudafork
    return [os.getppid(), cudafork.driver_initialized(), x * (int(os.environ["RANK"]) + 1)]
"""
LAUNCH = "notebook_launcher(where, args=(3,), num_processes=2, return_all_ranks=True{})"
RESULTS = [3, 6]  # x * (rank + 1) on ranks 0 and 1


def _kernel(folder: Path) -> KernelSession:
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "platform"))
    from fake_cuda import build_fake_driver

    library = build_fake_driver(folder)
    env = isolated_env(folder) | {"NBACCEL_FORK_SERVER": "1"}
    session = KernelSession(cwd=folder, env=env).start()
    session.run(SETUP.format(library=str(library)), timeout=120)
    session.run("%load_ext nbaccel")
    return session


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelSession]:
    session = _kernel(tmp_path_factory.mktemp("forkserver"))
    try:
        yield session
    finally:
        leftovers = session.stop()
    assert leftovers == [], leftovers  # the server ends with the kernel's own shutdown


def server_of(kernel: KernelSession) -> int:
    pid = kernel.evaluate_json("_forkserver.server_pid()")
    assert pid is not None and psutil.Process(pid).ppid() == kernel.pid
    return int(pid)


def assert_only_server_left(kernel: KernelSession, server: int | None) -> None:
    spared = frozenset({server} if server is not None else ())  # the server stays: it is kept
    left = kernel.wait_for_no_descendants(timeout=10, sparing=spared)
    assert not left, describe_processes(left)
    zombies = [p for p in psutil.Process(kernel.pid).children() if p.status() == "zombie"]
    assert not zombies, describe_processes(zombies)


def test_after_cuda_workers_fork_from_the_server_with_the_same_results(
    kernel: KernelSession,
) -> None:
    server = server_of(kernel)  # taken by %load_ext, before any launch
    kernel.run(f"before = {LAUNCH.format('')}")
    kernel.run("pool = start_workers(num_processes=2)\npool_before = pool.start_method")
    kernel.run("drv.cuInit(0)  # the notebook touches CUDA")
    cell = kernel.run(f"after = {LAUNCH.format('')}")
    assert "spawn" not in cell.stderr, cell.stderr  # no fallback said
    kernel.run("spawned = " + LAUNCH.format(", start_method='spawn'"))
    kernel.run("pool.restart()\npool_after = [pool.start_method, pool.call(where, (3,), "
               "return_all_ranks=True)]\npool.close()")  # fmt: skip
    got = kernel.evaluate_json(
        "dict(before=before, after=after, spawned=spawned, pool_before=pool_before, "
        "pool_after=pool_after, kernel_driver=cudafork.driver_initialized())"
    )
    assert got["kernel_driver"] is True, got  # the kernel's driver is touched...
    assert got["before"] == [[kernel.pid, False, r] for r in RESULTS], got  # forked from it
    # ...the server's workers see it untouched, the server their parent, the same results
    assert got["after"] == [[server, False, r] for r in RESULTS], got
    assert got["spawned"] == [[kernel.pid, False, r] for r in RESULTS], got
    assert got["pool_before"] == "fork", got  # the pool restarted after CUDA: the server's
    assert got["pool_after"] == ["forkserver", [[server, False, r] for r in RESULTS]], got
    assert_only_server_left(kernel, server)


def test_a_dead_server_means_spawn_said_in_one_line(kernel: KernelSession) -> None:
    server = server_of(kernel)
    os.kill(server, signal.SIGKILL)
    cell = kernel.run(f"print({LAUNCH.format('')})")
    said = [line for line in cell.stderr.splitlines() if "fork server" in line]
    assert len(said) == 1 and said[0].startswith("nbaccel: workers are spawned"), cell.stderr
    assert "has died" in said[0], said
    assert cell.stdout.strip() == str([[kernel.pid, False, r] for r in RESULTS]), cell.stdout
    cell = kernel.run(f"print({LAUNCH.format('')})")
    assert "fork server" not in cell.stderr, cell.stderr  # said once
    assert_only_server_left(kernel, None)  # the dead server reaped: no zombie


def test_killing_the_kernel_ends_the_server_and_its_workers(tmp_path: Path) -> None:
    session = _kernel(tmp_path)
    try:
        server = server_of(session)
        session.run("drv.cuInit(0)\npool = start_workers(num_processes=2)")
        workers = session.evaluate_json("list(pool.pids.values())")
        assert {psutil.Process(pid).ppid() for pid in workers} == {server}
        procs = [psutil.Process(pid) for pid in (server, *workers)]
        os.kill(session.pid, signal.SIGKILL)
        left = wait_gone(procs, timeout=HANG_GUARD_S)
        assert not left, describe_processes(left)
    finally:
        session.stop()
