"""Gradient accumulation through the Accelerator on 1 and 2 real CPU processes."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~3 s): once here, not in every forked worker
from torch.utils.data import DataLoader, TensorDataset

from nbaccel.launch.testing import run_on_workers

pytestmark = pytest.mark.integration


def _accelerator(**kwargs):
    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    return Accelerator(cpu=True, **kwargs)


def _data(n):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x @ torch.randn(4, 1, generator=g) + 0.1)


def _fit(batch_size, steps, n=32, epochs=2, check_sync=False):
    """Train a linear regression; return final weights and per-micro-step facts."""
    acc = _accelerator(gradient_accumulation_steps=steps)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # constant LR: schedulers advance num_processes times per update, which would make
    # the 1- and 2-process runs differ on purpose; here we only count the steps
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=1.0)
    model, optimizer, scheduler, loader = acc.prepare(
        model, optimizer, scheduler, DataLoader(_data(n), batch_size=batch_size)
    )
    flags, grads_agree = [], []
    for _ in range(epochs):
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(torch.nn.functional.mse_loss(model(x), y))
                flags.append(acc.sync_gradients)
                if check_sync:  # are this micro-step's gradients identical on all ranks?
                    grads = acc.gather(model.module.weight.grad.detach().clone()[None])
                    grads_agree.append(bool(torch.allclose(grads[0], grads[1])))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    weights = torch.cat([p.detach().flatten() for p in acc.unwrap_model(model).parameters()])
    return {
        "weights": weights,
        "flags": flags,
        "agree": grads_agree,
        "updates": acc.step,
        "scheduler_steps": scheduler.scheduler.last_epoch,
    }


def _one_process_runs():
    return {
        "B4xN2": _fit(4, 2),
        "B8": _fit(8, 1),
        "B16": _fit(16, 1),
        "uneven": _fit(4, 2, n=20),  # 5 batches per epoch, N=2
    }


def _two_process_runs():
    return {
        "B4xN2": _fit(4, 2, check_sync=True),
        "B8": _fit(8, 1),
        "uneven": _fit(2, 2, n=20),  # 5 batches per rank per epoch, N=2
    }


@pytest.fixture(scope="module")
def runs():
    """Every configuration, trained once: (1-process results, [rank results of 2 processes])."""
    (one,) = run_on_workers(_one_process_runs, 1)
    return one, run_on_workers(_two_process_runs, 2)


def test_accumulation_parity_on_one_and_two_processes(runs):
    one, two = runs
    close = dict(rtol=1e-5, atol=1e-6)
    # 1 process: batch 4 with 2 accumulation steps == batch 8 without
    torch.testing.assert_close(one["B4xN2"]["weights"], one["B8"]["weights"], **close)
    assert one["B4xN2"]["flags"][:4] == [False, True, False, True]
    assert one["B4xN2"]["updates"] == one["B8"]["updates"] == 8
    assert one["B4xN2"]["scheduler_steps"] == 8  # only on the updating micro-steps
    for rank in two:
        # 2 processes x batch 4 x 2 steps == 2 x batch 8 == 1 process x batch 16
        torch.testing.assert_close(rank["B4xN2"]["weights"], rank["B8"]["weights"], **close)
        torch.testing.assert_close(rank["B4xN2"]["weights"], one["B16"]["weights"], **close)
        # DDP no_sync: gradients differ across ranks until the synchronising micro-step
        assert rank["B4xN2"]["agree"] == rank["B4xN2"]["flags"]
        assert rank["B4xN2"]["flags"] == [False, True] * 4


def test_last_batch_of_an_uneven_epoch_always_syncs(runs):
    one, two = runs
    expected = [False, True, False, True, True] * 2
    for result in [one["uneven"]] + [rank["uneven"] for rank in two]:
        assert result["flags"] == expected
        assert result["updates"] == 6
