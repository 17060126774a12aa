"""Collectives entered by some ranks only end with an error naming the operation.

``gather``/``reduce``/... carry no check before they run (they run on every step); a gloo
timeout, which is what such a call ends in, is raised as ``RanksMissingError`` naming the
operation and the fix instead of gloo's "Timed out waiting ... for recv".
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nbaccel.errors import WorkerError
from nbaccel.launch.testing import run_on_workers

pytestmark = pytest.mark.integration


def _busy_until(flag, limit=600.0):  # a hang guard: the flag is the event
    """A rank doing something else (as a training step would) until rank 0 is done."""
    import time

    deadline = time.monotonic() + limit
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)


def _gather_main_only_worker(root):
    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    accelerator = Accelerator(cpu=True)
    if accelerator.is_main_process:
        try:
            accelerator.gather_for_metrics(torch.ones(2))  # evaluation on the main process only
        finally:
            Path(root, "done").touch()
    else:
        _busy_until(os.path.join(root, "done"))
    return "passed"


def test_gather_on_the_main_process_alone_is_named(tmp_path):
    with pytest.raises(WorkerError) as caught:
        run_on_workers(
            _gather_main_only_worker, 2, args=(str(tmp_path),), env={"NBACCEL_TIMEOUT": "3"}
        )
    error = caught.value
    assert error.rank == 0 and error.exc_type == "RanksMissingError", error
    assert "gather on rank 0 timed out" in error.message and "every rank" in error.message
    # named although a gather has no barrier that could tell: rank 1 ran fewer collectives
    notes = "\n".join(getattr(error, "__notes__", []))
    assert error.missing == [1] and "Rank(s) [1] did not come" in notes, notes
    assert "--- rank 1: finished the job" in notes, notes  # and where it is
