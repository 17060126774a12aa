"""Weight files and checkpoint directories without processes: shards, tied weights, safety."""

from __future__ import annotations

import json
import os

import pytest
import torch

from nbaccel import load_checkpoint_in_model
from nbaccel.checkpoint.weights import CheckpointError, parse_size, read_weights, save_model_files
from nbaccel.errors import ConfigError
from nbaccel.runtime.saving.checkpointing import MANIFEST, latest_checkpoint, read_manifest


class Tied(torch.nn.Module):
    """Embedding and output head share one weight, as in language models."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight


def _fresh(seed: int) -> Tied:
    torch.manual_seed(seed)
    return Tied()


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize(
    ("text", "expected"),
    [(512, 512), ("200KB", 200_000), ("10GB", 10**10), ("1.5MB", 1_500_000), ("2KiB", 2048)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["ten GB", "5XB", 0, -1, True, 1.5, None])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError, match="max_shard_size"):
        parse_size(bad)


def test_sharded_safetensors_with_index_and_tied_weights(tmp_path):
    model = _fresh(0)
    files = save_model_files(model.state_dict(), tmp_path, max_shard_size="3KB")
    names = sorted(f.name for f in files)
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) >= 2 and all("-of-" in n for n in shards)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert "head.weight" not in index["weight_map"]  # stored once, under emb.weight
    assert index["nbaccel_tied_weights"] == {"head.weight": "emb.weight"}
    loaded = _fresh(1)
    result = load_checkpoint_in_model(loaded, tmp_path)
    assert result.missing_keys == [] and result.unexpected_keys == []
    _assert_same(model, loaded)
    assert loaded.head.weight is loaded.emb.weight  # still tied after loading


def test_single_file_and_resave_removes_stale_shards(tmp_path):
    model = _fresh(0)
    save_model_files(model.state_dict(), tmp_path, max_shard_size=2000)
    save_model_files(model.state_dict(), tmp_path)  # now fits one file
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    loaded = _fresh(1)
    load_checkpoint_in_model(loaded, tmp_path / "model.safetensors")
    _assert_same(model, loaded)


def test_torch_bin_shards_and_single_pt_file(tmp_path):
    model = _fresh(0)
    save_model_files(
        model.state_dict(), tmp_path / "bin", max_shard_size=3000, safe_serialization=False
    )
    assert (tmp_path / "bin" / "pytorch_model.bin.index.json").is_file()
    loaded = _fresh(1)
    load_checkpoint_in_model(loaded, tmp_path / "bin")
    _assert_same(model, loaded)
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    loaded = _fresh(2)
    load_checkpoint_in_model(loaded, tmp_path / "weights.pt", device_map="cpu")
    _assert_same(model, loaded)


def test_load_reports_mismatched_keys(tmp_path):
    torch.save({"emb.weight": torch.zeros(64, 16)}, tmp_path / "partial.pt")
    with pytest.raises(CheckpointError, match="missing keys"):
        load_checkpoint_in_model(_fresh(0), tmp_path / "partial.pt")
    result = load_checkpoint_in_model(_fresh(0), tmp_path / "partial.pt", strict=False)
    assert "body.weight" in result.missing_keys


def test_pickled_code_is_refused_unless_trusted(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "hook": os.getcwd}, path)
    with pytest.raises(CheckpointError, match="weights_only=False"):
        read_weights(path)
    assert set(read_weights(path, weights_only=False)) == {"w", "hook"}


def test_missing_and_empty_locations(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint_in_model(_fresh(0), tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="holds no model weights"):
        load_checkpoint_in_model(_fresh(0), tmp_path)


def test_index_naming_a_missing_shard(tmp_path):
    save_model_files(_fresh(0).state_dict(), tmp_path, max_shard_size="3KB")
    next(tmp_path.glob("model-00001-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint_in_model(_fresh(0), tmp_path)


def test_read_manifest_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        read_manifest(tmp_path / "absent")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match="not an nbaccel checkpoint"):
        read_manifest(tmp_path / "foreign")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / MANIFEST).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="foreign"):
        read_manifest(tmp_path / "other")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "model.safetensors").write_bytes(b"12")
    manifest = {"format": "nbaccel-checkpoint", "version": 1, "files": {"model.safetensors": 3}}
    (damaged / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="incomplete or damaged"):
        read_manifest(damaged)
    leftover = tmp_path / ".checkpoint_3.tmp-abc"
    leftover.mkdir()
    with pytest.raises(CheckpointError, match="interrupted"):
        read_manifest(leftover)


def test_latest_checkpoint_skips_incomplete(tmp_path):
    for i in (1, 2, 10):
        path = tmp_path / f"checkpoint_{i}"
        path.mkdir()
        if i != 10:  # checkpoint_10 has no manifest: never chosen
            (path / MANIFEST).write_text(json.dumps({"format": "nbaccel-checkpoint", "files": {}}))
    with pytest.warns(UserWarning, match="checkpoint_10"):
        assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint_2"
    assert latest_checkpoint(tmp_path / "nothing") is None
