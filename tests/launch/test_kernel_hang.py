"""The hang watchdog in a REAL kernel: the report appears in the launching cell's stderr
while the cell is still running, and the launch then completes; with
``debug_collectives=True`` mismatched collectives fail the cell with torch's error.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kernel_harness import WAITS_FOR_FLAG, KernelSession, isolated_env

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

SETUP = """
import os, time
import torch, torch.distributed as dist
from nbaccel import Accelerator, LaunchConfig, notebook_launcher
"""

HANG_CELL = (
    WAITS_FOR_FLAG
    + """
print("result", notebook_launcher(waits, (FLAG,), num_processes=2, hang_after=2))
"""
)

MISMATCH_CELL = """
def mismatched():
    accelerator = Accelerator(cpu=True)
    value = torch.ones(2)
    if accelerator.process_index == 0:
        dist.all_reduce(value)
    else:
        dist.broadcast(value, src=0)

notebook_launcher(mismatched, num_processes=2, debug_collectives=True)
"""


@pytest.fixture
def kernel(tmp_path) -> Iterator[KernelSession]:
    session = KernelSession(cwd=tmp_path, env=isolated_env(tmp_path))
    session.start()
    session.run(SETUP, timeout=120)
    yield session
    session.stop()


@pytest.mark.timeout(300)
def test_the_report_appears_in_the_launching_cell_and_the_launch_completes(kernel, tmp_path):
    flag = tmp_path / "go"
    kernel.run(f"FLAG = {str(flag)!r}")
    cell = kernel.submit(HANG_CELL)
    partial = kernel.wait_for_output(cell, "waiting in torch.distributed.all_reduce", timeout=120)
    flag.touch()  # rank 1 comes; the cell was still running: nothing was killed
    result = kernel.collect(cell, timeout=120).raise_for_error()
    assert "result 2.0" in result.stdout, result.describe()
    report = result.stderr
    assert "rank 0: waiting in torch.distributed.all_reduce" in report, partial.describe()
    assert "rank 1: not in a torch.distributed call" in report, report
    assert "os.path.exists(flag)" in report, report  # rank 1's Python stack
    kernel.assert_no_descendants(timeout=5)

    failed = kernel.execute(MISMATCH_CELL, timeout=120)
    assert failed.status == "error", failed.describe()
    assert "Detected mismatch between collectives" in failed.describe(), failed.describe()
    kernel.assert_no_descendants(timeout=5)
