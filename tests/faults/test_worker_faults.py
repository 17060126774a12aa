"""Fault injection on launched workers (notebook_launcher from the pytest process).

A worker SIGKILLed inside a collective, a worker that exits with status 0 before
its peers are done, a result that cannot be pickled: each must end promptly with
an error that names the rank and the cause, and leave no process (conftest).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from nbaccel import notebook_launcher
from nbaccel.errors import WorkerError

pytestmark = pytest.mark.faults


def killed_in_all_reduce():
    import torch.distributed as dist

    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    value = torch.ones(4)
    dist.all_reduce(value)  # both ranks meet once
    if accelerator.process_index == 1:
        time.sleep(0.5)  # rank 0 is now blocked in the next all_reduce
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(value)
    return value


@pytest.mark.timeout(120)  # far below the collective's timeout: no waiting for it
def test_sigkill_of_a_worker_in_the_middle_of_a_collective():
    with pytest.raises(WorkerError) as info:
        notebook_launcher(killed_in_all_reduce, num_processes=2, timeout=600)
    message = str(info.value)
    assert "rank 1" in message and ("SIGKILL" in message or "signal 9" in message), message
    assert "timed out" not in message.lower(), message  # the peer was not left to time out


def exits_zero_early():
    import torch.distributed as dist

    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    if accelerator.process_index == 1:
        os._exit(0)  # e.g. a stray sys.exit(0) in a library, or exit() in a cell
    value = torch.ones(1)
    dist.all_reduce(value)
    return value.item()


@pytest.mark.timeout(120)  # far below the collective's timeout: no waiting for it
def test_a_worker_that_exits_with_status_0_early():
    with pytest.raises(WorkerError) as info:
        notebook_launcher(exits_zero_early, num_processes=2, timeout=600)
    message = str(info.value)
    assert "rank 1" in message and "exit" in message and "0" in message, message


def unpicklable_result():
    batches = (torch.ones(2) * i for i in range(3))  # neither pickle nor dill can ship this
    return {"model": torch.nn.Linear(2, 2), "batches": batches}


def test_a_result_that_cannot_be_pickled():
    with pytest.raises(WorkerError) as info:
        notebook_launcher(unpicklable_result, num_processes=2)
    message = str(info.value)
    assert "cannot be sent back to the kernel" in message, message
    assert "generator" in message.lower(), message
    assert "model.state_dict()" in message, message  # the fix is named
