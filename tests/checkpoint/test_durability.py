"""Durability: save_model keeps other files and is atomic, overwrites leave no gap,
fsync errors are errors, nodes without a shared filesystem each get a full checkpoint."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from nbaccel.checkpoint import durable, weights
from nbaccel.checkpoint.directory import latest_checkpoint, prune, read_manifest
from nbaccel.checkpoint.weights import CheckpointError, read_weights, save_model_files
from nbaccel.launch.testing import run_on_workers
from nbaccel.runtime.saving.checkpointing import MANIFEST


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- save_model ----------------------------------------------------------------------------


def test_save_model_keeps_files_it_did_not_write(tmp_path):
    user_files = {
        "model_ema.safetensors": b"ema weights",
        "model-best.safetensors": b"best weights",
        "pytorch_model_old.bin": b"old",
        "notes.txt": b"hello",
    }
    for name, data in user_files.items():
        (tmp_path / name).write_bytes(data)
    save_model_files(_model(0).state_dict(), tmp_path, max_shard_size=1500)
    save_model_files(_model(1).state_dict(), tmp_path)  # one file now: shards go
    for name, data in user_files.items():
        assert (tmp_path / name).read_bytes() == data, f"{name} was touched"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*user_files, "model.safetensors"])
    assert _same(read_weights(tmp_path), _model(1).state_dict())


def test_save_model_switching_format_removes_only_its_own_files(tmp_path):
    save_model_files(_model(0).state_dict(), tmp_path, max_shard_size=1500)
    save_model_files(_model(1).state_dict(), tmp_path, safe_serialization=False)
    # the stale safetensors set would win over the new .bin when reading: it is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pytorch_model.bin"]
    assert _same(read_weights(tmp_path), _model(1).state_dict())


def test_a_save_model_that_fails_midway_leaves_the_previous_weights(tmp_path, monkeypatch):
    save_model_files(_model(0).state_dict(), tmp_path, max_shard_size=1500)
    before = sorted(os.listdir(tmp_path))
    calls = []

    def failing_save(obj, path):  # the disk fills up on the second shard
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path)

    real_save = weights.torch_save
    monkeypatch.setattr(weights, "torch_save", failing_save)
    with pytest.raises(OSError, match="No space"):
        save_model_files(
            _model(1).state_dict(), tmp_path, max_shard_size=1500, safe_serialization=False
        )
    assert sorted(os.listdir(tmp_path)) == before  # no temporary file left, nothing deleted
    assert _same(read_weights(tmp_path), _model(0).state_dict())


def test_shards_from_two_saves_are_detected(tmp_path):
    save_model_files(_model(0).state_dict(), tmp_path / "a", max_shard_size=1500)
    save_model_files(_model(1).state_dict(), tmp_path / "b", max_shard_size=1500)
    # a crash between renaming shards and renaming the index leaves such a mixture
    shard = sorted((tmp_path / "b").glob("model-00001-*"))[0]
    shutil.copy(shard, tmp_path / "a" / shard.name)
    with pytest.raises(CheckpointError, match="another save_model"):
        read_weights(tmp_path / "a")


# -- fsync ---------------------------------------------------------------------------------


def test_fsync_errors_on_files_are_raised(tmp_path, monkeypatch):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")

    def lost_write(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", lost_write)
    with pytest.raises(OSError, match="fsync failed"):
        durable.fsync_path(path)
    with pytest.raises(OSError, match="fsync failed"):
        save_model_files(_model(0).state_dict(), tmp_path / "out")
    assert not list((tmp_path / "out").glob("model*"))  # nothing published


def test_fsync_on_a_directory_tolerates_only_unsupported(tmp_path, monkeypatch):
    def unsupported(fd):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", unsupported)
    durable.fsync_path(tmp_path)  # some filesystems cannot fsync directories

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError, match="fsync failed"):
        durable.fsync_path(tmp_path)


# -- overwriting a checkpoint --------------------------------------------------------------


def _fake_checkpoint(path: Path, marker: str) -> None:
    path.mkdir(parents=True)
    (path / "data.txt").write_text(marker)
    manifest = {"format": "nbaccel-checkpoint", "version": 1, "files": {"data.txt": len(marker)}}
    (path / MANIFEST).write_text(json.dumps(manifest))


def test_a_kill_between_the_two_renames_of_an_overwrite_loses_nothing(tmp_path):
    """State after `os.replace(target, old)` and before `os.replace(tmp, target)`."""
    root = tmp_path / "checkpoints"
    _fake_checkpoint(root / ".checkpoint_3.old-abc", "three")
    _fake_checkpoint(root / "checkpoint_2", "two")
    (root / ".checkpoint_3.tmp-abc").mkdir()  # the new copy, never published
    with pytest.warns(UserWarning, match="restored"):
        assert latest_checkpoint(root) == root / "checkpoint_3"
    assert (root / "checkpoint_3" / "data.txt").read_text() == "three"
    # also when loading the path directly
    _fake_checkpoint(tmp_path / ".ckpt.old-def", "mine")
    with pytest.warns(UserWarning, match="restored"):
        read_manifest(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "data.txt").read_text() == "mine"


def test_prune_keeps_a_displaced_copy_whose_checkpoint_is_missing(tmp_path):
    class Config:
        total_limit = None

    class Acc:
        project_configuration = Config()

    _fake_checkpoint(tmp_path / ".checkpoint_5.old-abc", "five")
    _fake_checkpoint(tmp_path / "checkpoint_1", "one")
    _fake_checkpoint(tmp_path / ".checkpoint_1.old-xyz", "stale")
    (tmp_path / ".checkpoint_6.tmp-abc").mkdir()
    prune(Acc(), tmp_path)
    names = sorted(os.listdir(tmp_path))
    assert ".checkpoint_5.old-abc" in names or "checkpoint_5" in names
    assert ".checkpoint_1.old-xyz" not in names and ".checkpoint_6.tmp-abc" not in names


def test_exchange_swaps_directories_atomically(tmp_path):
    _fake_checkpoint(tmp_path / "a", "A")
    _fake_checkpoint(tmp_path / "b", "B")
    if not durable.exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("this filesystem cannot exchange directories (the two-rename path runs)")
    assert (tmp_path / "a" / "data.txt").read_text() == "B"
    assert (tmp_path / "b" / "data.txt").read_text() == "A"


# -- nodes that share no filesystem --------------------------------------------------------


def _separate_nodes_worker(root):
    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    rank = os.environ["RANK"]
    # one process per "node", each with its own disk: a directory of its own (the launcher
    # installed this process's rank facts; the simulated topology replaces them)
    import dataclasses

    from nbaccel.platform.process_env import install_process_facts, read_environment

    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=rank)
    facts = read_environment()
    install_process_facts(
        dataclasses.replace(facts, local_rank=0, local_world_size=1, node_rank=int(rank))
    )
    node_dir = Path(root) / f"node{rank}"
    node_dir.mkdir()
    os.chdir(node_dir)
    reset_state()
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Linear(4, 4))
    optimizer = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    saved = acc.save_state("ckpt")
    expected = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.save_state("ckpt")  # an overwrite, on both nodes
    with torch.no_grad():
        for p, v in zip(model.parameters(), expected.values(), strict=True):
            p.copy_(v)
    acc.save_state("ckpt")
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    loaded = acc.load_state("ckpt")
    got = acc.unwrap_model(model).state_dict()
    del optimizer
    return {
        "saved": saved,
        "loaded": loaded,
        "same": all(torch.equal(got[k], expected[k]) for k in expected),
        "files": sorted(os.listdir(node_dir / "ckpt")),
        "entries": sorted(os.listdir(node_dir)),
    }


@pytest.mark.integration
def test_save_and_load_state_on_nodes_without_a_shared_filesystem(tmp_path):
    results = run_on_workers(_separate_nodes_worker, 2, args=(str(tmp_path),))
    for rank, result in enumerate(results):
        assert result["same"], f"node {rank} did not restore its weights: {result}"
        assert result["entries"] == ["ckpt"], result  # no .tmp-/.old- leftovers
        assert f"rank_{rank}.pt" in result["files"] and MANIFEST in result["files"], result
        assert "model.safetensors" in result["files"], result
