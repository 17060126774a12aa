"""Checkpoints of sharded (FSDP2) models on real 2-process gloo groups.

save_state/load_state (sharded through torch.distributed.checkpoint, and full),
a save killed half-way, loading a sharded checkpoint in one plain process (DCP
reshards), save_model's full safetensors weights, and models built on the meta
device that are materialised and loaded shard by shard -- with the peak memory per
rank measured against the size of the whole model.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~3 s): once here, not in every worker
from torch.utils.data import DataLoader, TensorDataset

from nbaccel.errors import WorkerError
from nbaccel.launch.testing import run_on_workers
from nbaccel.runtime.facade.options import ProjectConfiguration
from nbaccel.runtime.saving.checkpointing import MANIFEST

pytestmark = pytest.mark.integration


def _plugin(state_dict_type="SHARDED_STATE_DICT", **kwargs):
    from nbaccel import FullyShardedDataParallelPlugin

    kwargs.setdefault("min_num_params", 50)
    return FullyShardedDataParallelPlugin(
        auto_wrap_policy="size_based_wrap", state_dict_type=state_dict_type, **kwargs
    )


def _build(seed, state_dict_type="SHARDED_STATE_DICT", fsdp=True, **kwargs):
    """A fresh FSDP Accelerator with a dropout model, AdamW, a scheduler, a shuffled loader."""
    from nbaccel import Accelerator, DataLoaderConfiguration
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    # the tests resume mid-epoch without skipping: the stateful loader restores the position
    kwargs.setdefault("dataloader_config", DataLoaderConfiguration(use_stateful_dataloader=True))
    acc = Accelerator(fsdp_plugin=_plugin(state_dict_type) if fsdp else None, **kwargs)
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
    while True:
        yield from loader


def _train(acc, model, optimizer, scheduler, batches, steps):
    for _ in range(steps):
        ids, y = next(batches)
        acc.backward(torch.nn.functional.mse_loss(model(ids.repeat(1, 4) / 40.0), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _full(acc, model):
    return {k: v.clone() for k, v in acc.get_state_dict(model).items()}


def _resume_worker(root, state_dict_type, k):
    acc, model, optimizer, scheduler, loader = _build(0, state_dict_type)
    _train(acc, model, optimizer, scheduler, _stream(loader), 2 * k)
    expected = _full(acc, model)

    acc, model, optimizer, scheduler, loader = _build(0, state_dict_type)
    batches = _stream(loader)
    _train(acc, model, optimizer, scheduler, batches, k)
    path = acc.save_state(root)
    acc, model, optimizer, scheduler, loader = _build(1234, state_dict_type)  # "restarted"
    torch.manual_seed(999 + acc.process_index)
    acc.load_state(path)
    assert acc.step == k
    _train(acc, model, optimizer, scheduler, _stream(loader), k)
    got = _full(acc, model)
    diff = max(((expected[n] - got[n]).abs().max().item() for n in expected), default=0.0)
    return {"diff": diff, "step": acc.step, "keys": sorted(got)}


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_save_load_continue_equals_uninterrupted(tmp_path, state_dict_type):
    results = run_on_workers(_resume_worker, 2, args=(str(tmp_path / "ckpt"), state_dict_type, 3))
    assert results[0]["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert results[0]["diff"] == 0.0 and results[0]["step"] == results[1]["step"] == 6
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
    files = set(manifest["files"])
    if state_dict_type == "SHARDED_STATE_DICT":  # one file per rank, plus DCP's metadata
        for folder in ("model.dcp", "optimizer.dcp"):
            assert {
                f"{folder}/__0_0.distcp",
                f"{folder}/__1_0.distcp",
                f"{folder}/.metadata",
            } <= files
        assert "model.safetensors" not in files
    else:
        assert {"model.safetensors", "optimizer.bin"} <= files


# -- a save killed half-way ------------------------------------------------------------------


def _killed_save_worker(root):
    import nbaccel.runtime.saving.sharded_state as sharded_state

    config = ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True)
    acc, model, optimizer, scheduler, loader = _build(0, project_config=config)
    batches = _stream(loader)
    _train(acc, model, optimizer, scheduler, batches, 2)
    acc.save_state()
    weights = _full(acc, model)  # a collective: every rank calls it
    if acc.is_main_process:
        torch.save(weights, Path(root) / "saved_weights.pt")
    _train(acc, model, optimizer, scheduler, batches, 2)
    real = sharded_state.save_dcp

    def save_then_die(state, directory):
        real(state, directory)
        if acc.process_index == 1:  # rank 1 dies with its shard written, nothing published
            os.kill(os.getpid(), signal.SIGKILL)

    sharded_state.save_dcp = save_then_die
    acc.save_state()


def _load_latest_worker(root):
    config = ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True)
    acc, model, *_ = _build(1234, project_config=config)
    loaded = Path(acc.load_state()).name
    return loaded, _full(acc, model)


def test_a_killed_sharded_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    with pytest.raises(WorkerError):
        run_on_workers(_killed_save_worker, 2, args=(str(tmp_path),))
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert "checkpoint_0" in names and "checkpoint_1" not in names  # never published
    (loaded, weights), _ = run_on_workers(_load_latest_worker, 2, args=(str(tmp_path),))
    assert loaded == "checkpoint_0"
    saved = torch.load(tmp_path / "saved_weights.pt")
    assert all(torch.equal(saved[k], weights[k]) for k in saved)


# -- a sharded checkpoint loads into one plain process (DCP reshards) --------------------------


def _save_sharded_worker(root):
    acc, model, optimizer, scheduler, loader = _build(0)
    _train(acc, model, optimizer, scheduler, _stream(loader), 3)
    acc.save_state(root)
    return _full(acc, model)


def _load_in_one_process(root):
    acc, model, optimizer, *_ = _build(1234, fsdp=False, cpu=True)
    acc.load_state(root)
    exp_avg = [optimizer.state[p]["exp_avg"].abs().sum().item() for p in model.parameters()]
    return {k: v.clone() for k, v in model.state_dict().items()}, exp_avg, acc.step


def test_a_sharded_checkpoint_loads_on_another_world_size(tmp_path):
    saved = run_on_workers(_save_sharded_worker, 2, args=(str(tmp_path / "c"),))[0]
    weights, exp_avg, step = run_on_workers(_load_in_one_process, 1, args=(str(tmp_path / "c"),))[0]
    assert step == 3
    assert sorted(weights) == sorted(saved)
    assert all(torch.equal(weights[k], saved[k]) for k in saved)
    assert all(value > 0 for value in exp_avg)  # AdamW's moments came back too


# -- save_model: full safetensors weights that load into the plain model -----------------------


def _save_model_worker(folder):
    acc, model, optimizer, scheduler, loader = _build(0)
    _train(acc, model, optimizer, scheduler, _stream(loader), 2)
    files = acc.save_model(model, folder, max_shard_size="200B")
    return [Path(f).name for f in files], _full(acc, model)


def test_save_model_writes_full_weights_that_load_into_the_unwrapped_model(tmp_path):
    from nbaccel import load_checkpoint_in_model

    (files0, state0), (files1, state1) = run_on_workers(
        _save_model_worker, 2, args=(str(tmp_path / "out"),)
    )
    assert files1 == [] and state1 == {}
    assert "model.safetensors.index.json" in files0 and len(files0) >= 3  # shards + index
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )
    assert load_checkpoint_in_model(model, tmp_path / "out").missing_keys == []
    assert all(torch.equal(model.state_dict()[k], state0[k]) for k in state0)


# -- models bigger than one process: meta device, shard-wise materialisation -------------------

_LAYERS, _WIDTH = 16, 1024  # 16.8M parameters, 67 MB in fp32


def _big_model():
    return torch.nn.Sequential(*[torch.nn.Linear(_WIDTH, _WIDTH) for _ in range(_LAYERS)])


def _write_big_weights(folder):
    from nbaccel.checkpoint.weights import save_model_files

    torch.manual_seed(7)
    model = _big_model()
    save_model_files(model.state_dict(), folder, max_shard_size="20MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _kib(field):
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _meta_worker(folder):
    from nbaccel import Accelerator, load_checkpoint_in_model
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    acc = Accelerator(fsdp_plugin=_plugin(min_num_params=_WIDTH * _WIDTH))
    # one small sharded model first: the one-time cost of FSDP's imports and first kernels
    # (~17 MB here) is no part of the model's memory
    with torch.device("meta"):
        warm = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    acc.prepare(warm)(torch.randn(2, 64)).sum().backward()
    Path("/proc/self/clear_refs").write_text("5")  # restart the peak-RSS counter here
    start = _kib("VmRSS")
    with torch.device("meta"):
        model = _big_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    load_checkpoint_in_model(model, folder)  # each rank reads only its shard's rows
    peak = (_kib("VmHWM") - start) * 1024
    first = model[0].weight.full_tensor()  # one layer, gathered, to check the values
    loss = model(torch.randn(4, _WIDTH)).square().mean()
    acc.backward(loss)
    optimizer.step()
    changed = not torch.equal(model[0].weight.full_tensor(), first)
    return peak, first, bool(torch.isfinite(loss)), changed


def test_a_meta_model_loads_shard_by_shard_below_the_full_size_and_trains(tmp_path):
    folder = str(tmp_path / "weights")
    full_bytes = run_on_workers(_write_big_weights, 1, args=(folder,))[0]
    results = run_on_workers(_meta_worker, 2, args=(folder,))
    torch.manual_seed(7)
    expected = _big_model()[0].weight.detach()
    for peak, first, finite, changed in results:
        assert torch.equal(first, expected)
        assert finite and changed
        # a rank holds its half plus transient reads: well below the whole model
        assert peak < 0.75 * full_bytes, (peak, full_bytes)


def _ram_efficient_worker():
    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    plugin = _plugin(cpu_ram_efficient_loading=True)
    acc = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(3)
    if acc.is_main_process:  # only rank 0 holds real weights
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 2))
    else:
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 2))
    model = acc.prepare(model)
    local_on_meta = any(p.to_local().is_meta for p in model.parameters())
    return _full(acc, model), local_on_meta


def test_cpu_ram_efficient_loading_shards_rank0_weights_out():
    (state, meta0), (_, meta1) = run_on_workers(_ram_efficient_worker, 2)
    torch.manual_seed(3)
    expected = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 2)).state_dict()
    assert not meta0 and not meta1
    assert all(torch.equal(state[k], expected[k]) for k in expected)


# -- merge_fsdp_weights: a sharded checkpoint into full weights --------------------------------


def _merge_worker(root):
    from nbaccel.utils import load_checkpoint_in_model, merge_fsdp_weights

    acc, model, optimizer, scheduler, loader = _build(0, "SHARDED_STATE_DICT")
    _train(acc, model, optimizer, scheduler, _stream(loader), 2)
    acc.save_state(os.path.join(root, "ckpt"))
    full = _full(acc, model)  # every rank; the full weights on the main process
    if not acc.is_main_process:
        return True
    merge_fsdp_weights(os.path.join(root, "ckpt"), os.path.join(root, "merged"))
    plain = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )
    load_checkpoint_in_model(plain, os.path.join(root, "merged"))
    return all(torch.equal(plain.state_dict()[k], full[k]) for k in full)


def test_merge_fsdp_weights_writes_the_full_model(tmp_path):
    assert run_on_workers(_merge_worker, 2, args=(str(tmp_path),)) == [True, True]
    assert "model.safetensors" in os.listdir(tmp_path / "merged")
