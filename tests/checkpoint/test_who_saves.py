"""Who calls save_state/load_state/save_model: the main process alone, every rank, or some.

Replicated training (DDP over gloo, 2 real processes): the main process alone may save
(the diffusers pattern, ``if accelerator.is_main_process: accelerator.save_state(...)``)
and every rank loads that checkpoint; when every rank saves, every rank's RNG state is
restored exactly, also when the same directory is overwritten again and again. FSDP and
barriers entered by some ranks only end in an error naming the missing ranks, within the
process-group timeout (short here: ``NBACCEL_TIMEOUT``).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~3 s): once here, not in every forked worker
from torch.utils.data import DataLoader, TensorDataset

from nbaccel.errors import WorkerError
from nbaccel.launch.testing import run_on_workers
from nbaccel.runtime.saving.checkpointing import MANIFEST

pytestmark = pytest.mark.integration

# every collective a broken implementation waits in fails after this many seconds
SHORT = {"NBACCEL_TIMEOUT": "20"}


def _build(seed=0, **kwargs):
    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    acc = Accelerator(cpu=True, **kwargs)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    return (acc, *acc.prepare(model, optimizer, loader))


def _train(acc, model, optimizer, loader, steps):
    done = 0
    while done < steps:
        for x, y in loader:
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done == steps:
                return


def _weights(acc, model):
    return [p.detach().clone() for p in acc.unwrap_model(model).parameters()]


# -- the main process alone -----------------------------------------------------------------


def _main_only_worker(root):
    acc, model, optimizer, loader = _build()
    _train(acc, model, optimizer, loader, 3)
    saved = _weights(acc, model)
    rng_at_save = torch.get_rng_state()
    if acc.is_main_process:  # diffusers' pattern: only the main process saves
        acc.save_state(os.path.join(root, "ckpt"))
        acc.save_model(model, os.path.join(root, "model"))
    acc.wait_for_everyone()
    torch.manual_seed(100 + acc.process_index)  # "another run": other RNG streams
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    before_load = torch.get_rng_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(os.path.join(root, "ckpt"))
    rng_warnings = [str(w.message) for w in caught if "RNG state" in str(w.message)]
    return {
        "same_weights": all(
            torch.equal(a, b) for a, b in zip(saved, _weights(acc, model), strict=True)
        ),
        "rng_restored": torch.equal(torch.get_rng_state(), rng_at_save),
        "rng_kept": torch.equal(torch.get_rng_state(), before_load),
        "rng_warnings": rng_warnings,
        "step": acc.step,
        "loader_epoch": loader.state_dict()["epoch"],
    }


def test_the_main_process_alone_saves_and_every_rank_loads(tmp_path):
    results = run_on_workers(_main_only_worker, 2, args=(str(tmp_path),), env=SHORT)
    for rank, result in enumerate(results):
        assert result["same_weights"], rank
        assert result["step"] == 3
        assert result["loader_epoch"] == 0  # the epoch comes from the main process's file
    assert results[0]["rng_restored"] and not results[0]["rng_warnings"]
    # rank 1 saved nothing: it keeps its RNG state and is told so, once
    assert results[1]["rng_kept"] and len(results[1]["rng_warnings"]) == 1
    assert "rank 1 keeps its current RNG state" in results[1]["rng_warnings"][0]
    files = set(os.listdir(tmp_path / "ckpt"))
    assert {MANIFEST, "model.safetensors", "optimizer.bin", "rank_0.pt"} <= files
    assert "rank_1.pt" not in files
    assert "model.safetensors" in os.listdir(tmp_path / "model")
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "model"]  # nothing left beside them


def _hook_worker(root):
    """The diffusers shape: save/load pre-hooks write the model in their own format."""
    acc, model, optimizer, loader = _build()
    _train(acc, model, optimizer, loader, 2)

    from torch.nn.parallel import DistributedDataParallel

    def save_hook(models, weights, output_dir):
        # as in Accelerate the hooks get the user's modules (diffusers calls save_pretrained)
        assert not any(isinstance(m, DistributedDataParallel) for m in models)
        if acc.is_main_process:
            for m in models:
                torch.save(m.state_dict(), os.path.join(output_dir, "own.pt"))
                weights.pop()

    def load_hook(models, input_dir):
        assert not any(isinstance(m, DistributedDataParallel) for m in models)
        while models:
            m = models.pop()
            m.load_state_dict(torch.load(os.path.join(input_dir, "own.pt")))

    acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)
    expected = _weights(acc, model)
    if acc.is_main_process:
        acc.save_state(os.path.join(root, "checkpoint-2"))
    acc.wait_for_everyone()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc.load_state(os.path.join(root, "checkpoint-2"))
    return all(torch.equal(a, b) for a, b in zip(expected, _weights(acc, model), strict=True))


def test_save_hooks_run_in_a_main_only_save(tmp_path):
    assert run_on_workers(_hook_worker, 2, args=(str(tmp_path),), env=SHORT) == [True, True]
    files = set(os.listdir(tmp_path / "checkpoint-2"))
    assert "own.pt" in files and "model.safetensors" not in files


# -- every rank, over and over ---------------------------------------------------------------


def _every_rank_worker(root, rounds):
    acc, model, optimizer, loader = _build()
    path = os.path.join(root, "ckpt")
    for _ in range(rounds):  # each save overwrites the last one, with new RNG states
        _train(acc, model, optimizer, loader, 1)
        torch.rand(acc.process_index + 1)  # the ranks' streams differ
        acc.save_state(path)
        rng_at_save = torch.get_rng_state()
        weights = _weights(acc, model)
    torch.manual_seed(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(path)
    return {
        "rng_restored": torch.equal(torch.get_rng_state(), rng_at_save),
        "warnings": [str(w.message) for w in caught],
        "same_weights": all(
            torch.equal(a, b) for a, b in zip(weights, _weights(acc, model), strict=True)
        ),
    }


def test_every_rank_saving_restores_every_ranks_rng_after_overwrites(tmp_path):
    results = run_on_workers(_every_rank_worker, 2, args=(str(tmp_path), 4), env=SHORT)
    for rank, result in enumerate(results):
        assert result["rng_restored"] and result["same_weights"], (rank, result)
        assert not result["warnings"], (rank, result)
    ckpt = tmp_path / "ckpt"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    for rank in (0, 1):
        state = torch.load(ckpt / f"rank_{rank}.pt", weights_only=True)
        assert state["save_id"] == manifest["save_id"]  # both from the last save
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no staging or pending directory left


# -- each rank its own directory (Accelerate's stateful-dataloader test) ---------------------


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, values):
        self.values = values

    def __iter__(self):
        yield from self.values


def _own_directory_worker():
    import tempfile

    from nbaccel import Accelerator, DataLoaderConfiguration
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    acc = Accelerator(cpu=True)
    acc.dataloader_config = DataLoaderConfiguration(use_stateful_dataloader=True)
    values = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    loader = acc.prepare(DataLoader(_Stream(values), batch_size=4))
    last = 64 // (4 * acc.num_processes) - 1
    unseen, resumed = [], []
    with tempfile.TemporaryDirectory() as tmpdir:  # a different directory on every rank
        for step, batch in enumerate(loader):
            if step == last - 1:
                acc.save_state(tmpdir)
            if step >= last:
                unseen.append(batch)
        acc.load_state(tmpdir)
        resumed = list(loader)
    return [b.tolist() for b in unseen] == [b.tolist() for b in resumed] and len(resumed) == 1


def test_stateful_loader_resumes_when_each_rank_saves_to_its_own_directory():
    assert run_on_workers(_own_directory_worker, 2, env=SHORT) == [True, True]


# -- operations every rank must enter --------------------------------------------------------


def _busy_until(flag, limit=600.0):  # a hang guard: the flag is the event
    """A rank doing something else (as a training step would) until rank 0 is done."""
    import time

    deadline = time.monotonic() + limit
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)


def _fsdp_main_only_worker(root):
    from nbaccel import Accelerator, FullyShardedDataParallelPlugin
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(auto_wrap_policy="no_wrap"))
    acc.prepare(torch.nn.Linear(4, 4))
    if acc.is_main_process:
        try:
            acc.save_state(os.path.join(root, "ckpt"))
        finally:
            Path(root, "done").touch()
    else:
        _busy_until(os.path.join(root, "done"))
    return "saved"


def test_fsdp_save_state_on_the_main_process_alone_names_the_missing_rank(tmp_path):
    from nbaccel.platform import torchcompat

    if not torchcompat.fsdp_supported():
        pytest.skip("FSDP2 needs a newer torch (see FSDP_MIN_TORCH)")
    with pytest.raises(WorkerError) as caught:
        run_on_workers(
            _fsdp_main_only_worker, 2, args=(str(tmp_path),), env={"NBACCEL_TIMEOUT": "3"}
        )
    error = caught.value
    assert error.rank == 0 and error.exc_type == "RanksMissingError", error
    assert "save_state needs every rank, but rank(s) [1] did not call it" in error.message
    assert "is_main_process" in error.message  # the fix
    assert not (Path(tmp_path) / "ckpt").exists()


def _barrier_main_only_worker(root):
    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    acc = Accelerator(cpu=True)
    if acc.is_main_process:
        acc.wait_for_everyone()  # raises: rank 1 is still busy (ended with the failed job)
        Path(root, "done").touch()
    else:
        _busy_until(os.path.join(root, "done"))
    return "passed"


def test_wait_for_everyone_on_the_main_process_alone_names_the_missing_rank(tmp_path):
    with pytest.raises(WorkerError) as caught:
        run_on_workers(
            _barrier_main_only_worker, 2, args=(str(tmp_path),), env={"NBACCEL_TIMEOUT": "3"}
        )
    error = caught.value
    assert error.rank == 0 and error.exc_type == "RanksMissingError", error
    assert "wait_for_everyone needs every rank, but rank(s) [1] did not call it within 3 s" in (
        error.message
    )
    notes = "\n".join(getattr(error, "__notes__", [])) or str(error)
    # what the missing rank is doing: its stack, probed by the supervisor as the error came
    assert "did not come are doing" in notes and "in _busy_until" in notes, notes


# -- main-only and every-rank saves mixed ----------------------------------------------------


def _mixed_worker(root):
    acc, model, optimizer, loader = _build()
    path = os.path.join(root, "ckpt")
    _train(acc, model, optimizer, loader, 1)
    if acc.is_main_process:  # the main process alone, at step 1
        acc.save_state(path)
    acc.wait_for_everyone()
    _train(acc, model, optimizer, loader, 1)
    torch.rand(acc.process_index + 1)
    acc.save_state(path)  # every rank, at step 2: each rank's RNG state is saved
    every_rank = torch.get_rng_state()
    _train(acc, model, optimizer, loader, 1)
    if acc.is_main_process:  # the main process alone again: rank 1's file is from step 2
        acc.save_state(path)
    main_only = torch.get_rng_state()
    acc.wait_for_everyone()
    torch.manual_seed(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(path)
    return {
        "restored_main_only": torch.equal(torch.get_rng_state(), main_only),
        "kept_every_rank": not torch.equal(torch.get_rng_state(), every_rank),
        "warnings": [str(w.message) for w in caught if "RNG state" in str(w.message)],
    }


def test_a_ranks_file_from_another_save_is_never_restored(tmp_path):
    main, other = run_on_workers(_mixed_worker, 2, args=(str(tmp_path),), env=SHORT)
    assert main["restored_main_only"] and not main["warnings"]
    assert other["kept_every_rank"] and len(other["warnings"]) == 1  # its step-2 file is not used


def _mixed_then_every_rank_worker(root):
    acc, model, optimizer, loader = _build()
    path = os.path.join(root, "ckpt")
    for step in range(1, 4):  # main-only saves at steps 1 and 2 ...
        _train(acc, model, optimizer, loader, 1)
        if acc.is_main_process and step < 3:
            acc.save_state(path)
    acc.wait_for_everyone()
    torch.rand(acc.process_index + 1)
    acc.save_state(path)  # ... then every rank at step 3: the ids agree again
    expected = torch.get_rng_state()
    torch.manual_seed(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(path)
    return torch.equal(torch.get_rng_state(), expected), [str(w.message) for w in caught]


def test_every_rank_saving_after_main_only_saves_restores_every_rank(tmp_path):
    for restored, caught in run_on_workers(
        _mixed_then_every_rank_worker, 2, args=(str(tmp_path),), env=SHORT
    ):
        assert restored and not caught
