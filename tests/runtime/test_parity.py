"""Training parity: 1 process vs 2 gloo processes end with the same weights.

The same regression model is trained 3 epochs (shuffled) with the same global batch:
1 process with batch 8; 2 processes with batch 4 each (or batch 8 sliced, with
``split_batches``); 2 processes with batch 2 and 2 accumulation micro-steps.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from nbaccel.launch.testing import run_on_workers
from nbaccel.runtime.process.state import reset_state


def _train(batch_size, split_batches=False, accumulation=1):
    from nbaccel import Accelerator, set_seed

    reset_state()
    acc = Accelerator(split_batches=split_batches, gradient_accumulation_steps=accumulation)
    set_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, generator=g)
    y = x @ torch.tensor([[1.0], [2.0], [-1.0]]) + 0.5 + 0.1 * torch.randn(64, 1, generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # the loader's own generator: the 1-process order on 2 processes too (a generator-less
    # sampler is seeded from the global stream: per epoch on 1 process, once on 2, as Accelerate)
    order = torch.Generator().manual_seed(2)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=order)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    for _epoch in range(3):
        for xb, yb in loader:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    weights = torch.cat([p.detach().flatten() for p in acc.unwrap_model(model).parameters()])
    return weights, acc.step


@pytest.fixture(scope="module")
def reference():
    weights, steps = run_on_workers(_train, num_processes=1, args=(8,))[0]
    assert steps == 3 * 64 // 8
    return weights


@pytest.mark.parametrize(
    ("batch_size", "split_batches", "accumulation"),
    [(4, False, 1), (8, True, 1), (2, False, 2)],
    ids=["whole-batches", "split-batches", "accumulation"],
)
def test_two_processes_match_one(reference, batch_size, split_batches, accumulation):
    results = run_on_workers(
        _train, num_processes=2, args=(batch_size, split_batches, accumulation)
    )
    (w0, steps0), (w1, steps1) = results
    assert steps0 == steps1 == 3 * 64 // 8
    assert torch.equal(w0, w1)  # DDP keeps the replicas identical
    assert torch.allclose(w0, reference, atol=1e-5), (w0 - reference).abs().max()
    assert not torch.allclose(reference, torch.zeros_like(reference))
