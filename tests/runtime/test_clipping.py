"""clip_grad_norm_ / clip_grad_value_ through the Accelerator (fp32 and fp16, 1 and 2 processes)."""

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


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 8, generator=g)
    return x, x @ torch.randn(8, 2, generator=g)


def _reference_grads():
    """Gradients of the full 16-sample batch on a plain, unprepared model."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    x, y = _data()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _prepared(acc, steps=1):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    per_step = 16 // (acc.num_processes * steps)
    loader = DataLoader(TensorDataset(*_data()), batch_size=per_step)
    return acc.prepare(model, optimizer, loader)


def _norm(grads):
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def _clip_worker(mixed_precision):
    from nbaccel.runtime.facade.options import GradScalerKwargs

    # a modest loss scale: 65536 would overflow fp16 gradients of this size (norm ~4.6)
    acc = _accelerator(
        mixed_precision=mixed_precision, kwargs_handlers=[GradScalerKwargs(init_scale=256.0)]
    )
    model, optimizer, loader = _prepared(acc)
    x, y = next(iter(loader))
    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    before = [p.detach().clone() for p in model.parameters()]
    norm = acc.clip_grad_norm_(model.parameters(), max_norm=0.05)
    clipped = [p.grad.clone() for p in model.parameters()]
    optimizer.step()  # must not unscale a second time
    delta = [(b - p.detach()) for b, p in zip(before, model.parameters(), strict=True)]
    optimizer.zero_grad()
    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    acc.clip_grad_value_(model.parameters(), clip_value=1e-3)
    largest = max(p.grad.abs().max().item() for p in model.parameters())
    return {"norm": norm, "clipped": clipped, "delta": delta, "largest": largest}


@pytest.mark.parametrize("num_processes", [1, 2])
@pytest.mark.parametrize("mixed_precision", ["no", "fp16"])
def test_clip_grad_norm_returns_the_true_norm_and_clips(num_processes, mixed_precision):
    reference = _reference_grads()
    ref_norm = _norm(reference)
    tol = dict(rtol=1e-4, atol=1e-6) if mixed_precision == "no" else dict(rtol=2e-2, atol=1e-4)
    for result in run_on_workers(_clip_worker, num_processes, args=(mixed_precision,)):
        # the norm of the full-batch (all-reduced, unscaled) gradients, before clipping
        torch.testing.assert_close(result["norm"], ref_norm, **tol)
        assert ref_norm > 0.05
        torch.testing.assert_close(_norm(result["clipped"]), torch.tensor(0.05), **tol)
        for got, ref in zip(result["clipped"], reference, strict=True):
            torch.testing.assert_close(got, ref * (0.05 / ref_norm), **tol)
        for delta, clipped in zip(result["delta"], result["clipped"], strict=True):
            torch.testing.assert_close(delta, clipped, **tol)  # lr=1: the step used them once
        assert result["largest"] <= 1e-3 + 1e-9


def _micro_step_worker(clip_every_micro_step):
    from nbaccel.runtime.facade.options import GradScalerKwargs

    acc = _accelerator(
        mixed_precision="fp16",
        gradient_accumulation_steps=2,
        kwargs_handlers=[GradScalerKwargs(init_scale=256.0)],
    )
    model, optimizer, loader = _prepared(acc, steps=2)
    norms = []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            if clip_every_micro_step or acc.sync_gradients:
                norms.append((acc.sync_gradients, acc.clip_grad_norm_(model.parameters(), 0.05)))
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms, acc.step


def test_clipping_on_a_micro_step_does_no_harm():
    for num_processes in (1, 2):
        every = run_on_workers(_micro_step_worker, num_processes, args=(True,))
        sync_only = run_on_workers(_micro_step_worker, num_processes, args=(False,))
        for (w_every, norms, steps), (w_sync, _, _) in zip(every, sync_only, strict=True):
            assert steps == 1
            assert [sync for sync, _ in norms] == [False, True]
            for a, b in zip(w_every, w_sync, strict=True):
                assert torch.equal(a, b)  # nothing was unscaled or clipped mid-accumulation
