"""What a notebook user sees in the cell when nbaccel forks its workers, in a REAL kernel.

Python >= 3.12 warns on every ``os.fork()`` in a multi-threaded process ("This process
is multi-threaded, use of fork() may lead to deadlocks in the child"), and a kernel
always is. nbaccel decides instead (``nbaccel.platform.forksafe.check_fork``): a fork
with only the kernel's own and nbaccel's threads running shows nothing; one with a
thread nbaccel does not know shows nbaccel's warning naming it and the fix. The cells
turn every warning on (``simplefilter("always")``), so a suppressed warning would show.

Runs on the dev venv's Python 3.11 and, in the Colab-like stack, on Python 3.13
(scripts/stacks.env), where the control cell proves that Python's own warning reaches
the cell's stderr when nbaccel is not the one forking.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest
from fake_cuda import build_fake_driver
from kernel_harness import KernelSession, describe_processes, module_kernel
from waits import HANG_GUARD_S

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

SETUP = """
import os, threading, warnings
warnings.simplefilter("always")          # every warning shows, DeprecationWarning included
import torch
torch.ones(64, 64) @ torch.ones(64, 64)   # the kernel's OpenMP pool is running, as usual
from tqdm.auto import tqdm
for _ in tqdm(range(2)):                  # and tqdm's monitor thread
    pass
from nbaccel import notebook_launcher, start_workers

def rank():
    import os
    return int(os.environ["RANK"])
"""
PYTHON_WARNING = "is multi-threaded, use of fork() may lead to deadlocks"


def assert_no_workers_left(kernel: KernelSession) -> None:
    """No worker of nbaccel's is left. Python 3.14's default start method (forkserver) gives
    tqdm's multiprocessing lock a resource tracker process: the kernel's own, kept."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        left = [p for p in kernel.descendants() if "resource_tracker" not in " ".join(p.cmdline())]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, describe_processes(left)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelSession]:
    yield from module_kernel(tmp_path_factory, SETUP)


def test_a_fork_checked_safe_shows_nothing_in_the_cell(kernel: KernelSession) -> None:
    cell = kernel.run("print(notebook_launcher(rank, num_processes=2, return_all_ranks=True))")
    assert cell.stdout.strip() == "[0, 1]"
    assert PYTHON_WARNING not in cell.stderr and "nbaccel forks" not in cell.stderr, cell.stderr
    cell = kernel.run(
        "pool = start_workers(num_processes=2)\nprint(pool.call(rank, return_all_ranks=True))\n"
        "pool.close()"
    )
    assert cell.stdout.strip() == "[0, 1]"
    assert PYTHON_WARNING not in cell.stderr and "nbaccel forks" not in cell.stderr, cell.stderr
    assert_no_workers_left(kernel)


def test_a_thread_nbaccel_does_not_know_is_named_with_the_fix(kernel: KernelSession) -> None:
    kernel.run(
        "stop = threading.Event()\n"
        "poller = threading.Thread(target=stop.wait, name='my-poller', daemon=True)\n"
        "poller.start()"
    )
    try:
        cell = kernel.run("print(notebook_launcher(rank, num_processes=2, return_all_ranks=True))")
    finally:
        kernel.run("stop.set(); poller.join()")
    assert cell.stdout.strip() == "[0, 1]"  # a warning, not a refusal: the launch ran
    assert "RuntimeWarning" in cell.stderr and "'my-poller'" in cell.stderr, cell.stderr
    assert "start_method='spawn'" in cell.stderr
    assert PYTHON_WARNING not in cell.stderr  # once, in nbaccel's words
    assert_no_workers_left(kernel)


def test_control_python_itself_on_a_raw_fork(kernel: KernelSession) -> None:
    # A raw fork from the cell: on 3.12+ Python's warning reaches the cell's stderr, so the
    # tests above would see it if nbaccel let it through; before 3.12 Python says nothing.
    cell = kernel.run("pid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)")
    assert (PYTHON_WARNING in cell.stderr) is (sys.version_info >= (3, 12)), cell.stderr


def test_a_driver_initialised_by_anyone_refuses_fork_and_auto_spawns(
    kernel: KernelSession, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # Issue 32: torch.cuda.is_available(), `import torchao`, CuPy... initialise the CUDA
    # driver without torch.cuda.is_initialized() saying so, and every forked worker then
    # fails ("Cannot re-initialize CUDA in forked subprocess"). A stand-in driver with the
    # real one's rule (calls fail with 3 until cuInit) plays it here; runs last: it stays.
    library = build_fake_driver(tmp_path_factory.mktemp("fake-cuda"))
    kernel.run("%load_ext nbaccel")  # nbaccel watches from here on (as a first launch does)
    kernel.run(
        "import ctypes\nfrom nbaccel.platform import cudafork\n"
        f"drv = ctypes.CDLL({str(library)!r})\n"
        "mapped_only = [cudafork.mapped_driver(), cudafork.driver_initialized()]"
    )
    kernel.run("drv.cuInit(0)  # a library initialises the driver in this cell")
    kernel.run(
        "from nbaccel.launch.testing import plan_for\n"
        "FORKS = [0]\nos.register_at_fork(before=lambda: FORKS.__setitem__(0, FORKS[0] + 1))\n"
        "try:\n"
        "    notebook_launcher(rank, num_processes=2, start_method='fork')\n"
        "    refused = None\n"
        "except Exception as err:\n"
        "    refused = [type(err).__name__, str(err)]\n"
        "with warnings.catch_warnings(record=True) as said:\n"
        "    warnings.simplefilter('always')\n"
        "    methods = [plan_for(rank, num_processes=2).method for _ in range(2)]\n"
        "state = {'mapped_only': mapped_only, 'calls': drv.stub_init_calls(), 'refused': refused,\n"
        "         'forks': FORKS[0], 'methods': methods,\n"
        # not the kernel's own deprecations (jupyter_client's utcnow on Python 3.12+, sent
        # when the kernel happens to publish during the block)
        "         'said': [str(w.message) for w in said if w.category is not DeprecationWarning]}"
    )
    got = kernel.evaluate_json("state")
    assert got["mapped_only"] == [str(library), False], got  # mapped is not initialised
    assert got["calls"] == 1, got  # nbaccel's checks never called cuInit themselves
    kind, message = got["refused"]
    assert kind == "CUDAInitializedError" and got["forks"] == 0, got
    assert "CUDA driver is already initialised" in message, message
    assert "during this cell" in message and "drv.cuInit(0)" in message, message  # the cause
    assert "start_method='spawn'" in message, message
    assert got["methods"] == ["spawn", "spawn"], got  # "auto" spawns...
    assert len(got["said"]) == 1 and "with spawn, not fork" in got["said"][0], (
        got
    )  # ...says why once
    assert "drv.cuInit(0)" in got["said"][0], got
    assert_no_workers_left(kernel)
