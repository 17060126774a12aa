"""Post-mortem debugging of a failed rank from cells of a REAL IPython kernel.

A job fails on rank 1; the next cell runs ``nbaccel.debug()`` (or ``%nbaccel_debug 1``),
and this test answers the kernel's input requests (the pdb prompts, read with the
kernel's own ``input()``) as a person typing would, then checks what pdb printed in the
cell: the failing frame's local, ``up``, ``where``. After ``q`` the pool runs its next
call and a debug=True launch leaves nothing behind. One kernel for the module; every
test ends with no child process of the kernel left.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import psutil
import pytest
from kernel_harness import KernelSession, describe_processes, module_kernel

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

SETUP = """
import os, signal, time
import nbaccel
from nbaccel import notebook_launcher, start_workers
%load_ext nbaccel

def check(batch):
    x = 41
    raise ValueError(f"bad batch {batch}")

def train():
    steps = 3
    if int(os.environ["RANK"]) == 1:
        check(steps + 4)
    return steps
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelSession]:
    yield from module_kernel(tmp_path_factory, SETUP)


@pytest.fixture(autouse=True)
def _kernel_left_clean(kernel: KernelSession) -> Iterator[None]:
    yield
    if kernel.busy or not kernel.is_alive():
        kernel.restart()
        kernel.run(SETUP, timeout=120)
    kernel.execute("for p in list(nbaccel.launch.pool._LIVE): p.close()", timeout=30)
    kernel.assert_no_descendants(timeout=10)
    zombies = [p for p in psutil.Process(kernel.pid).children() if p.status() == "zombie"]
    assert not zombies, f"the kernel left zombie children:\n{describe_processes(zombies)}"


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines()]


def test_pool_failure_is_debugged_with_the_kernels_own_input(kernel: KernelSession) -> None:
    kernel.run("pool = start_workers(num_processes=2, timeout=60)", timeout=180)
    failed = kernel.execute("pool.run(train)", timeout=60)
    assert failed.error is not None and failed.error.ename == "ValueError", failed.describe()

    cell, prompts = kernel.execute_answering(
        "nbaccel.debug()", ["p x", "p batch", "up", "p steps", "where", "q"], timeout=60
    )
    cell.raise_for_error()
    assert prompts == ["(Pdb) "] * 6  # each prompt was the kernel's own input request
    out = _lines(cell.stdout)
    assert "nbaccel: post-mortem of rank 1: ValueError: bad batch 7" in cell.stdout
    assert "--- rank 0: had finished the job" in out
    assert out.count("41") == 1 and out.count("7") == 1 and out.count("3") == 1, cell.stdout
    # where: both user frames, the current one (train, after `up`) marked, no nbaccel frames
    where = cell.stdout[cell.stdout.rindex("-> check(steps + 4)") :]
    assert re.search(r"> .*\(\d+\)train\(\)", cell.stdout), cell.stdout
    assert "check()" in where and "nbaccel" not in where, cell.stdout

    # the pool goes on: next call on every rank, and the traceback is gone with it
    assert kernel.evaluate("pool.run(lambda: 5)") == "5"
    again = kernel.execute("nbaccel.debug()", timeout=30)
    assert again.error is not None and "the pool ran another call since" in again.error.evalue
    pids = set(kernel.evaluate_json("list(pool.pids.values())"))
    assert {p.pid for p in kernel.descendants()} == pids  # nothing but the two workers
    kernel.run("pool.close()", timeout=30)


def test_magic_debugs_the_rank_it_names(kernel: KernelSession) -> None:
    kernel.run("pool = start_workers(num_processes=2, timeout=60)", timeout=180)
    kernel.execute("pool.run(train)", timeout=60)
    cell, prompts = kernel.execute_answering("%nbaccel_debug 1", ["pp x * 2", "l", "c"])
    cell.raise_for_error()
    assert len(prompts) == 3 and "82" in _lines(cell.stdout)
    assert 'raise ValueError(f"bad batch {batch}")' in cell.stdout  # `l` listed the source
    # rank 0 did not fail: a message saying so and which rank did
    zero = kernel.execute("%nbaccel_debug 0", timeout=30)
    assert "rank 0 did not fail (it had finished the job)" in zero.stderr, zero.describe()
    assert "nbaccel.debug(1)" in zero.stderr and "Traceback" not in zero.stderr
    usage = kernel.execute("%nbaccel_debug one", timeout=30)
    assert "usage: %nbaccel_debug [rank]" in usage.stderr + usage.stdout, usage.describe()
    assert kernel.evaluate("pool.run(lambda: 6)") == "6"
    kernel.run("pool.close()", timeout=30)


LAUNCH_SPAWN = """
def train_dist():
    import torch.distributed as dist
    from nbaccel import Accelerator
    accelerator = Accelerator()
    if accelerator.process_index == 1:
        check(11)
    dist.barrier()

try:
    notebook_launcher(train_dist, num_processes=2, start_method="spawn", debug=True,
                      debug_timeout=120)
except ValueError as err:
    print("launch failed on rank", err.rank)
"""


def test_launch_with_debug_keeps_the_failed_spawned_rank(kernel: KernelSession) -> None:
    failed = kernel.run(LAUNCH_SPAWN, timeout=120)
    assert "launch failed on rank 1" in failed.stdout
    assert len(kernel.descendants()) == 1  # only rank 1 stays; rank 0 ended as before

    cell, prompts = kernel.execute_answering("nbaccel.debug()", ["p x", "up", "q"], timeout=60)
    cell.raise_for_error()
    assert prompts == ["(Pdb) "] * 3 and "41" in _lines(cell.stdout)
    # rank 0's stack when rank 1 failed: waiting for it in the barrier
    assert "(waiting in torch.distributed.barrier)" in cell.stdout, cell.stdout
    assert "-> check(11)" in cell.stdout  # `up` reached train_dist
    kernel.assert_no_descendants(timeout=10)  # after q the rank left and was reaped
    gone = kernel.execute("nbaccel.debug()", timeout=30)
    assert gone.error is not None and "has left" in gone.error.evalue


def test_front_end_without_input_gets_a_message_and_the_rank_is_released(
    kernel: KernelSession,
) -> None:
    kernel.run(LAUNCH_SPAWN.replace('"spawn"', '"fork"'), timeout=120)
    cell = kernel.collect(kernel.submit("nbaccel.debug()", allow_stdin=False), timeout=60)
    assert cell.error is not None and "cannot answer input requests" in cell.error.evalue
    assert "commands=" in cell.error.evalue
    # rank 0's stack starts at the job's function: not the kernel's frames a fork inherits
    header = cell.stdout
    assert "in train_dist" in header and "dist.barrier()" in header, header
    assert "site-packages/ipykernel" not in header and "IPython" not in header, header
    kernel.assert_no_descendants(timeout=10)


def test_killed_rank_says_why_no_session_is_possible(kernel: KernelSession) -> None:
    code = """
def die():
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
try:
    notebook_launcher(die, num_processes=2, debug=True)
except Exception as err:
    print("failed:", type(err).__name__)
"""
    kernel.run(code, timeout=120)
    cell = kernel.execute("nbaccel.debug()", timeout=30)
    assert cell.error is not None, cell.describe()
    assert "rank 1 was killed by SIGKILL (9)" in cell.error.evalue
    assert "no traceback to debug" in cell.error.evalue
    magic = kernel.execute("%nbaccel_debug", timeout=30)  # the same, as a message
    assert "killed by SIGKILL" in magic.stderr + magic.stdout, magic.describe()
