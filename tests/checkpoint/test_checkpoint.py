"""save_state / load_state / save_model / save through the Accelerator, on real processes.

Workers are module-level functions run by ``run_on_workers`` (forked gloo groups);
every file is real, under ``tmp_path``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~3 s): once here, not in every forked worker
from torch.utils.data import DataLoader, TensorDataset
from waits import HANG_GUARD_S

from nbaccel.errors import ConfigError, WorkerError
from nbaccel.launch.testing import run_on_workers
from nbaccel.runtime.facade.options import ProjectConfiguration
from nbaccel.runtime.saving.checkpointing import MANIFEST

pytestmark = pytest.mark.integration


def _accelerator(**kwargs):
    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    return Accelerator(cpu=True, **kwargs)


def _auto(root, total_limit=None):
    return ProjectConfiguration(
        project_dir=str(root), automatic_checkpoint_naming=True, total_limit=total_limit
    )


def _build(seed, **accelerator_kwargs):
    """A fresh Accelerator with a dropout model, AdamW, a scheduler and a shuffled loader."""
    acc = _accelerator(**accelerator_kwargs)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    ids = torch.arange(40, dtype=torch.float32).unsqueeze(1)
    targets = torch.randn(40, 1, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(ids, targets), batch_size=4, shuffle=True)
    return (acc, *acc.prepare(model, optimizer, scheduler, loader))


def _stream(loader):
    while True:  # epochs back to back; a checkpoint may fall in the middle of one
        yield from loader


def _train(acc, model, optimizer, scheduler, batches, steps):
    seen = []
    for _ in range(steps):
        ids, y = next(batches)
        seen.append(ids[:, 0].long().tolist())
        x = ids.repeat(1, 4) / 40.0
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return seen


def _weights(acc, model):
    return [p.detach().clone() for p in acc.unwrap_model(model).parameters()]


def _stateful():
    from nbaccel.runtime.facade.options import DataLoaderConfiguration

    # load_state restores the position inside the epoch only when asked (Accelerate's rule)
    return DataLoaderConfiguration(use_stateful_dataloader=True)


def _resume_worker(root, k):
    acc, model, optimizer, scheduler, loader = _build(0, dataloader_config=_stateful())
    uninterrupted = _train(acc, model, optimizer, scheduler, _stream(loader), 2 * k)
    expected = _weights(acc, model)

    acc, model, optimizer, scheduler, loader = _build(0, dataloader_config=_stateful())
    before = _train(acc, model, optimizer, scheduler, _stream(loader), k)
    path = acc.save_state(root)
    # a "restarted" run: other initial weights, other RNG streams
    acc, model, optimizer, scheduler, loader = _build(1234, dataloader_config=_stateful())
    torch.manual_seed(999 + acc.process_index)
    acc.load_state(path)
    assert acc.step == k
    after = _train(acc, model, optimizer, scheduler, _stream(loader), k)
    got = _weights(acc, model)
    diff = max((a - b).abs().max().item() for a, b in zip(expected, got, strict=True))
    return {"same_batches": uninterrupted == before + after, "diff": diff, "step": acc.step}


def test_resume_gives_the_same_batches_and_weights_as_an_uninterrupted_run(tmp_path):
    # 40 samples, batch 4, 2 ranks: 5 batches per epoch; the save falls mid-epoch 1
    results = run_on_workers(_resume_worker, num_processes=2, args=(str(tmp_path / "ck"), 7))
    for result in results:
        assert result["same_batches"]
        assert result["diff"] < 1e-6
        assert result["step"] == 14
    files = sorted(os.listdir(tmp_path / "ck"))
    assert {"rank_0.pt", "rank_1.pt", MANIFEST, "model.safetensors"} <= set(files)


class Counter:
    """A custom object for register_for_checkpointing, holding numpy state."""

    def __init__(self) -> None:
        self.count = 0
        self.history = np.zeros(3)

    def state_dict(self):
        return {"count": self.count, "history": self.history.copy()}

    def load_state_dict(self, state):
        self.count = state["count"]
        self.history = state["history"]


def _pruning_worker(root):
    acc, model, optimizer, scheduler, loader = _build(0, project_config=_auto(root, total_limit=2))
    counter = Counter()
    acc.register_for_checkpointing(counter)
    batches = _stream(loader)
    saved = []
    for i in range(4):
        _train(acc, model, optimizer, scheduler, batches, 1)
        counter.count, counter.history[i % 3] = i + 1, i + 0.5
        saved.append(Path(acc.save_state()).name)
    remaining = sorted(os.listdir(Path(root) / "checkpoints"))
    expected = _weights(acc, model)

    acc, model, optimizer, scheduler, loader = _build(7, project_config=_auto(root, total_limit=2))
    fresh = Counter()
    acc.register_for_checkpointing(fresh)
    loaded = Path(acc.load_state()).name  # no argument: the latest complete checkpoint
    same = all(torch.equal(a, b) for a, b in zip(expected, _weights(acc, model), strict=True))
    next_name = Path(acc.save_state()).name  # numbering continues after the loaded one
    return {
        "saved": saved,
        "remaining": remaining,
        "loaded": loaded,
        "same": same,
        "counter": (fresh.count, fresh.history.tolist()),
        "next": next_name,
        "after_next": sorted(os.listdir(Path(root) / "checkpoints")),
    }


def test_automatic_naming_total_limit_and_load_latest(tmp_path):
    (result,) = run_on_workers(_pruning_worker, num_processes=1, args=(str(tmp_path),))
    assert result["saved"] == [f"checkpoint_{i}" for i in range(4)]
    assert result["remaining"] == ["checkpoint_2", "checkpoint_3"]  # oldest pruned first
    assert result["loaded"] == "checkpoint_3"
    assert result["same"]
    assert result["counter"] == (4, [3.5, 1.5, 2.5])
    assert result["next"] == "checkpoint_4"
    assert result["after_next"] == ["checkpoint_3", "checkpoint_4"]


def _fp16_scaler_worker(root):
    acc, model, optimizer, scheduler, loader = _build(
        0, mixed_precision="fp16", project_config=_auto(root)
    )
    _train(acc, model, optimizer, scheduler, _stream(loader), 3)
    scale = acc.precision.scaler.get_scale()
    acc.save_state()
    acc, *_ = _build(0, mixed_precision="fp16", project_config=_auto(root))
    acc.load_state()
    return scale, acc.precision.scaler.get_scale()


def test_grad_scaler_state_is_restored(tmp_path):
    (saved, restored) = run_on_workers(_fp16_scaler_worker, 1, args=(str(tmp_path),))[0]
    assert saved == restored and saved < 65536.0  # it backed off at least once


# -- a save killed with SIGKILL in the middle of writing -----------------------------------


def _save_and_get_killed(root, ready):
    """Child process: one good checkpoint, then a second save that stops half-way."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    torch.set_num_threads(1)  # a fresh OpenMP pool, as run_on_workers does
    import nbaccel.runtime.saving._checkpoint_write as checkpoint

    acc, model, optimizer, scheduler, loader = _build(0, project_config=_auto(root))
    batches = _stream(loader)
    _train(acc, model, optimizer, scheduler, batches, 2)
    acc.save_state()
    _train(acc, model, optimizer, scheduler, batches, 2)
    real_save = checkpoint.torch_save

    def torch_save_then_stall(obj, path):
        if Path(path).name != "optimizer.bin":
            return real_save(obj, path)
        real_save(obj, path)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])  # a half-written file
        Path(ready).write_text(str(path))
        time.sleep(600)  # the test kills us here

    checkpoint.torch_save = torch_save_then_stall
    acc.save_state()


def _after_kill_worker(root, leftover):
    from nbaccel.runtime.saving.checkpointing import CheckpointError

    acc, *_ = _build(0, project_config=_auto(root))
    loaded = Path(acc.load_state()).name
    try:
        acc.load_state(leftover)
        refused = ""
    except CheckpointError as err:
        refused = str(err)
    # the next save reuses the number of the one that died and removes the leftover
    acc.project_configuration.iteration = 1
    saved = Path(acc.save_state()).name
    return loaded, refused, saved, sorted(os.listdir(Path(root) / "checkpoints"))


def test_save_killed_mid_write_leaves_previous_checkpoint_loadable(tmp_path):
    ready = tmp_path / "ready"
    child = mp.get_context("fork").Process(
        target=_save_and_get_killed, args=(str(tmp_path), str(ready))
    )
    child.start()
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not ready.exists() and child.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), f"the saving child never reached the stall (exit {child.exitcode})"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == -signal.SIGKILL
    checkpoints = tmp_path / "checkpoints"
    names = sorted(os.listdir(checkpoints))
    leftovers = [n for n in names if ".tmp-" in n]
    assert "checkpoint_0" in names and "checkpoint_1" not in names and len(leftovers) == 1
    assert not (checkpoints / leftovers[0] / MANIFEST).exists()
    (loaded, refused, saved, after) = run_on_workers(
        _after_kill_worker, 1, args=(str(tmp_path), str(checkpoints / leftovers[0]))
    )[0]
    assert loaded == "checkpoint_0"
    assert "interrupted" in refused
    assert saved == "checkpoint_1"
    assert after == ["checkpoint_0", "checkpoint_1"]


# -- save_model and save through the Accelerator --------------------------------------------


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(100, 32)
        self.mid = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 100, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.relu(self.mid(self.emb(ids))))


def _save_model_worker(root):
    acc = _accelerator()
    torch.manual_seed(0)
    model = acc.prepare(TiedLM())
    written = acc.save_model(model, root, max_shard_size="4KB")
    acc.save({"rank": torch.tensor(acc.process_index)}, os.path.join(root, "extra.pt"))
    acc.wait_for_everyone()
    from nbaccel import load_checkpoint_in_model

    torch.manual_seed(1)
    fresh = TiedLM()
    load_checkpoint_in_model(fresh, root)
    reference = acc.unwrap_model(model).state_dict()
    same = all(torch.equal(v, fresh.state_dict()[k]) for k, v in reference.items())
    return [p.name for p in written], same, fresh.out.weight is fresh.emb.weight


def test_save_model_shards_with_index_on_the_main_process_only(tmp_path):
    results = run_on_workers(_save_model_worker, 2, args=(str(tmp_path),))
    (written0, same0, tied0), (written1, same1, tied1) = results
    assert written1 == []  # rank 1 wrote nothing
    shards = [n for n in written0 if n.endswith(".safetensors")]
    assert len(shards) >= 3 and "model.safetensors.index.json" in written0
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert same0 and same1 and tied0 and tied1
    assert torch.load(tmp_path / "extra.pt")["rank"].item() == 0  # written once, by rank 0


# -- bad inputs ----------------------------------------------------------------------------


def test_total_limit_zero_is_rejected():
    with pytest.raises(ConfigError, match="total_limit"):
        ProjectConfiguration(project_dir="x", automatic_checkpoint_naming=True, total_limit=0)


def _bad_inputs_worker(root):
    from nbaccel.runtime.saving.checkpointing import CheckpointError

    acc, *_ = _build(0)
    errors = {}
    attempts = {
        "missing": lambda: acc.load_state(os.path.join(root, "absent")),
        "foreign": lambda: acc.load_state(root),
        "no_dir": lambda: acc.save_state(),
        "no_dir_load": lambda: acc.load_state(),
        "register": lambda: acc.register_for_checkpointing(object()),
        "overwrite_foreign": lambda: acc.save_state(root),
        "bad_shard_size": lambda: acc.save_model(acc._models[0], root, max_shard_size="lots"),
    }
    Path(root, "notes.txt").write_text("not a checkpoint")
    for name, attempt in attempts.items():
        try:
            attempt()
            errors[name] = None
        except (CheckpointError, ConfigError, FileNotFoundError, TypeError) as err:
            errors[name] = (type(err).__name__, str(err))
    # a checkpoint of a different set of objects
    path = acc.save_state(os.path.join(root, "ck"))
    other = _accelerator()
    other.prepare(torch.nn.Linear(2, 2))
    try:
        other.load_state(path)
        errors["mismatch"] = None
    except ConfigError as err:
        errors["mismatch"] = ("ConfigError", str(err))
    return errors


def test_bad_inputs_give_clear_errors(tmp_path):
    errors = run_on_workers(_bad_inputs_worker, 1, args=(str(tmp_path),))[0]
    assert errors["missing"][0] == "FileNotFoundError" and "absent" in errors["missing"][1]
    assert errors["foreign"][0] == "CheckpointError"
    assert "not an nbaccel checkpoint" in errors["foreign"][1]
    assert errors["no_dir"][0] == "ConfigError" and "output_dir" in errors["no_dir"][1]
    assert errors["no_dir_load"][0] == "ConfigError" and "input_dir" in errors["no_dir_load"][1]
    assert errors["register"][0] == "TypeError" and "state_dict" in errors["register"][1]
    assert "will not overwrite" in errors["overwrite_foreign"][1]
    assert "max_shard_size" in errors["bad_shard_size"][1]
    assert "holds 1 optimizers but this Accelerator has 0" in errors["mismatch"][1]
    assert "prepare()" in errors["mismatch"][1]


def _unsafe_worker(root):
    from nbaccel.runtime.saving.checkpointing import CheckpointError

    acc = _accelerator()
    acc.register_for_checkpointing(Pickles())
    path = acc.save_state(root)
    try:
        acc.load_state(path)
        refused = ""
    except CheckpointError as err:
        refused = str(err)
    acc.load_state(path, weights_only=False)  # the explicit opt-in works
    return refused


class Pickles:
    """State holding a function: loading it needs arbitrary unpickling."""

    def state_dict(self):
        return {"fn": os.getcwd}

    def load_state_dict(self, state):
        assert state["fn"] is os.getcwd


def test_loading_pickled_code_needs_an_explicit_opt_in(tmp_path):
    refused = run_on_workers(_unsafe_worker, 1, args=(str(tmp_path / "ck"),))[0]
    assert "weights_only=False" in refused


def test_two_process_errors_surface_on_every_rank(tmp_path):
    with pytest.raises(WorkerError, match="no checkpoint"):
        run_on_workers(_missing_dir_worker, 2, args=(str(tmp_path / "absent"),))


def _missing_dir_worker(path):
    acc, *_ = _build(0)
    acc.load_state(path)
