"""The three resume patterns of Accelerate's checkpointing guide, on 2 real processes.

A run is interrupted mid-epoch (the checkpoint is named after the step, as in the guide)
and resumed in a new Accelerator with other initial weights and RNG streams:

* ``continue``: iterate the epoch from its start and ``continue`` over the steps seen;
* ``skip_first_batches``: ``accelerator.skip_first_batches(loader, resume_step)``;
* stateful: ``DataLoaderConfiguration(use_stateful_dataloader=True)``, no skipping.

Each must see every batch of the interrupted epoch exactly once, in the uninterrupted
run's order, and end with the uninterrupted run's weights. Before nbaccel followed
Accelerate's default (the position inside the epoch restored only for stateful loaders)
the first two skipped the seen batches twice.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~3 s): once here, not in every forked worker
from torch.utils.data import DataLoader, TensorDataset

from nbaccel.launch.testing import run_on_workers

pytestmark = pytest.mark.integration

EPOCHS = 2
INTERRUPT_AT = 8  # 48 samples, batch 4, 2 ranks: 6 steps per epoch; step 8 is mid-epoch 1


def _build(seed, stateful):
    from nbaccel import Accelerator, DataLoaderConfiguration
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    acc = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful)
    )
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = torch.arange(48, dtype=torch.float32).unsqueeze(1)
    loader = DataLoader(TensorDataset(ids), batch_size=4, shuffle=True)
    return (acc, *acc.prepare(model, optimizer, loader))


def _step(acc, model, optimizer, batch, seen):
    (ids,) = batch
    seen.append(ids[:, 0].long().tolist())
    x = ids.repeat(1, 4) / 48.0
    acc.backward(torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)))
    optimizer.step()
    optimizer.zero_grad()


def _uninterrupted(stateful):
    acc, model, optimizer, loader = _build(0, stateful)
    seen = {e: [] for e in range(EPOCHS)}
    for epoch in range(EPOCHS):
        for batch in loader:
            _step(acc, model, optimizer, batch, seen[epoch])
    return seen, [p.detach().clone() for p in acc.unwrap_model(model).parameters()]


def _resume_worker(root, pattern):
    stateful = pattern == "stateful"
    expected_seen, expected_weights = _uninterrupted(stateful)

    acc, model, optimizer, loader = _build(0, stateful)
    seen = {e: [] for e in range(EPOCHS)}
    overall_step = 0
    for epoch in range(EPOCHS):
        for batch in loader:
            _step(acc, model, optimizer, batch, seen[epoch])
            overall_step += 1
            if overall_step == INTERRUPT_AT:
                break
        if overall_step == INTERRUPT_AT:
            break
    path = os.path.join(root, f"step_{overall_step}")
    acc.save_state(path)

    # a new run: other weights, other RNG streams; the guide's resume arithmetic
    acc, model, optimizer, loader = _build(1234, stateful)
    torch.manual_seed(99 + acc.process_index)
    acc.load_state(path)
    resume_from = int(os.path.basename(path).split("_")[1])
    starting_epoch, resume_step = divmod(resume_from, len(loader))
    for epoch in range(starting_epoch, EPOCHS):
        if pattern == "continue":
            for step, batch in enumerate(loader):
                if epoch == starting_epoch and step < resume_step:
                    continue  # seen before the interruption
                _step(acc, model, optimizer, batch, seen[epoch])
        elif pattern == "skip_first_batches":
            active = loader
            if epoch == starting_epoch:
                active = acc.skip_first_batches(loader, resume_step)
            for batch in active:
                _step(acc, model, optimizer, batch, seen[epoch])
        else:  # stateful: the loader resumes where it stopped
            for batch in loader:
                _step(acc, model, optimizer, batch, seen[epoch])
    weights = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
    return {
        "same_batches": seen == expected_seen,
        "seen": seen,
        "expected": expected_seen,
        "diff": max(
            (a - b).abs().max().item() for a, b in zip(weights, expected_weights, strict=True)
        ),
    }


@pytest.mark.parametrize("pattern", ["continue", "skip_first_batches", "stateful"])
def test_each_resume_pattern_sees_every_batch_once_and_ends_with_the_same_weights(
    tmp_path, pattern
):
    for rank, result in enumerate(run_on_workers(_resume_worker, 2, args=(str(tmp_path), pattern))):
        assert result["same_batches"], (rank, result["seen"], result["expected"])
        flat = [i for batch in result["seen"][1] for i in batch]
        assert len(flat) == len(set(flat)) == 24  # this rank's half of epoch 1, once each
        assert result["diff"] == 0.0, (rank, result["diff"])
