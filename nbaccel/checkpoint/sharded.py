"""Sharded state on disk: ``torch.distributed.checkpoint`` folders and safetensors slices.

* :func:`save_dcp` / :func:`load_dcp`: every rank writes (reads) its own part of a
  state dict of ``DTensor`` shards with torch's DCP into a folder inside the checkpoint
  directory being built; files are fsynced (``sync_files``) and so is the folder, so the
  directory protocol (manifest, rename) of :mod:`nbaccel.checkpoint.directory` covers
  them like any other file. DCP reshards on load: a different world size, or plain
  tensors in one process, read the same folder.
* :func:`weight_locations` / :func:`read_rows`: where each tensor of a safetensors
  file, folder or index lives, and a slice of it read without reading the rest -- how a
  sharded model loads its weights without any rank holding the whole model.

Every function that takes part in DCP must be called on every rank.

Example:
    >>> import torch, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> save_dcp({"w": torch.arange(6.0)}, f"{folder}/model.dcp")
    >>> state = {"w": torch.zeros(6)}
    >>> load_dcp(state, f"{folder}/model.dcp")
    >>> state["w"].tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..platform.process_env import distributed_active
from .weights import _TIED_KEY, SAFE_WEIGHTS, CheckpointError, fsync_path

DCP_METADATA = ".metadata"


@contextlib.contextmanager
def _one_process_is_intended() -> Iterator[None]:
    # DCP warns whenever it runs without a process group; loading a sharded checkpoint
    # into one plain process is a supported use here, not a mistake to warn about
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def save_dcp(state: dict[str, Any], directory: str | os.PathLike[str]) -> None:
    """Write this rank's part of ``state`` into ``directory`` (all ranks call it)."""
    import torch.distributed.checkpoint as dcp

    path = Path(directory)
    writer = dcp.FileSystemWriter(str(path), sync_files=True, overwrite=True)
    with _one_process_is_intended():
        dcp.save(state, storage_writer=writer, no_dist=not distributed_active())
    fsync_path(path)  # the folder's entries (the rank files and .metadata) too


def load_dcp(state: dict[str, Any], directory: str | os.PathLike[str]) -> None:
    """Fill ``state`` (its tensors, in place, resharded as needed) from ``directory``."""
    import torch.distributed.checkpoint as dcp

    path = Path(directory)
    if not (path / DCP_METADATA).is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a torch.distributed.checkpoint folder (no {DCP_METADATA})."
        )
    reader = dcp.FileSystemReader(str(path))
    with _one_process_is_intended():
        dcp.load(state, storage_reader=reader, no_dist=not distributed_active())


def is_dcp(directory: str | os.PathLike[str]) -> bool:
    """True if ``directory`` is a complete DCP folder (its metadata is written last)."""
    return (Path(directory) / DCP_METADATA).is_file()


def weight_locations(checkpoint: str | os.PathLike[str]) -> dict[str, tuple[Path, str]]:
    """``{name: (safetensors file, stored name)}`` for a file, a saved folder or an index.

    Tied weights saved once map to the stored copy.

    Raises:
        FileNotFoundError: nothing at ``checkpoint``, or no safetensors weights there.
        CheckpointError: an index naming a missing shard.
    """
    from safetensors import safe_open

    path = Path(checkpoint)
    if path.is_dir():
        index = path / f"{SAFE_WEIGHTS}.index.json"
        path = index if index.is_file() else path / SAFE_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(
            f"no safetensors weights at {str(checkpoint)!r}: pass a .safetensors file, a folder "
            "written by save_model, or its model.safetensors.index.json."
        )
    found: dict[str, tuple[Path, str]] = {}
    aliases: dict[str, str] = {}
    if path.name.endswith(".index.json"):
        index_data = json.loads(path.read_text())
        files = sorted(set(index_data.get("weight_map", {}).values()))
        aliases.update(index_data.get(_TIED_KEY, {}))
    else:
        files = [path.name]
    for name in files:
        shard = path.parent / name
        if not shard.is_file():
            raise CheckpointError(f"{path} names shard {name!r}, which is missing.")
        with safe_open(str(shard), framework="pt") as fh:
            aliases.update(json.loads((fh.metadata() or {}).get(_TIED_KEY, "{}")))
            found.update({key: (shard, key) for key in fh.keys()})  # noqa: SIM118 (a safe_open handle, not a dict)
    for alias, name in aliases.items():
        if name in found:
            found[alias] = found[name]
    return found


def read_rows(location: tuple[Path, str], dim: int, start: int, stop: int) -> torch.Tensor:
    """Elements ``start:stop`` along ``dim`` of one stored tensor (only those are read)."""
    from safetensors import safe_open

    file, name = location
    with safe_open(str(file), framework="pt") as fh:
        stored = fh.get_slice(name)
        index = [slice(None)] * len(stored.get_shape())
        if index:
            index[dim] = slice(start, stop)
            return stored[tuple(index)]
        return fh.get_tensor(name)  # a scalar has nothing to slice


__all__ = ["is_dcp", "load_dcp", "read_rows", "save_dcp", "weight_locations"]
