"""Reading and writing model weights: safetensors, shards, tied weights, safe torch.load.

The functions here know nothing about processes; :mod:`nbaccel.runtime.saving.checkpointing` decides
who writes. Loading never runs pickled code unless the caller opts in with
``weights_only=False``.

Example:
    >>> parse_size("200KB"), parse_size("1GiB"), parse_size(512)
    (200000, 1073741824, 512)
"""

from __future__ import annotations

import json
import os
import pickle
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, ConfigError
from ..platform.tpu import backend_for
from .durable import fsync_path, make_dirs, temp_name

SAFE_WEIGHTS = "model.safetensors"
TORCH_WEIGHTS = "pytorch_model.bin"
_TIED_KEY = "nbaccel_tied_weights"  # safetensors metadata / index key: {alias: kept_name}
# One id per save_model call, in every safetensors file's metadata and in the index: it
# marks the files as written by save_model (so a later save may remove them, and only
# them) and lets a reader detect a shard set mixed from two saves.
_SAVE_ID = "nbaccel_save_id"
_FORMATS = (("model", ".safetensors"), ("pytorch_model", ".bin"))
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: int | str) -> int:
    """Return ``size`` in bytes: an int, or a string like ``"10GB"``, ``"200KB"``, ``"5MiB"``.

    Raises:
        ConfigError: anything else, or a size < 1.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", size)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(
                f"max_shard_size={size!r} is not a size; use an int (bytes) or a string "
                "such as '10GB', '500MB', '200KB' or '1GiB'."
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(
            f"max_shard_size={size!r} must be an int (bytes) or a string like '10GB'."
        )
    if value < 1:
        raise ConfigError(f"max_shard_size={size!r} must be at least 1 byte.")
    return value


def torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` then fsync."""
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def torch_load(path: str | os.PathLike[str], *, weights_only: bool = True) -> Any:
    """``torch.load`` on CPU, refusing pickled code unless ``weights_only=False``.

    Raises:
        CheckpointError: the file needs arbitrary unpickling; the message says how to opt in.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path} contains Python objects that torch.load(weights_only=True) refuses to "
            f"unpickle ({str(err).splitlines()[0]}). Loading it would run code stored in the "
            "file. If, and only if, you trust its source, pass weights_only=False "
            "(e.g. accelerator.load_state(path, weights_only=False) or "
            "load_checkpoint_in_model(model, path, weights_only=False))."
        ) from err


def dedupe_tied(
    state: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Prepare a state dict for safetensors: CPU, contiguous, no shared storage.

    Tensors that are the same view of the same storage (tied weights) are stored
    once under the first name; the returned ``aliases`` maps each dropped name to
    the kept one. Tensors that overlap in any other way are copied.
    """
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_view: dict[tuple[Any, ...], str] = {}
    storages: set[tuple[torch.device, int]] = set()
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(
                f"state dict entry {name!r} is a {type(tensor).__name__}, not a tensor"
            )
        tensor = tensor.detach()
        if tensor.device.type == "meta":
            raise ConfigError(f"parameter {name!r} is on the meta device and has no data to save")
        if tensor.numel():
            tpu = backend_for(tensor.device.type)  # TPU tensors have no storage pointer
            ptr = tpu.tensor_id(tensor) if tpu else tensor.untyped_storage().data_ptr()
            view = (
                tensor.device,
                ptr,
                tensor.storage_offset(),
                tuple(tensor.shape),
                tensor.stride(),
                tensor.dtype,
            )
            if view in by_view:
                aliases[name] = by_view[view]
                continue
            by_view[view] = name
            if (tensor.device, ptr) in storages:
                tensor = tensor.clone()  # overlaps another tensor without being it: own copy
            storages.add((tensor.device, ptr))
        kept[name] = tensor.cpu().contiguous()
    return kept, aliases


def write_safetensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    aliases: Mapping[str, str],
    save_id: str | None = None,
) -> None:
    """Write one safetensors file (fsynced), recording ``aliases`` in its metadata."""
    from safetensors.torch import save_file

    metadata = {"format": "pt"}
    if save_id is not None:
        metadata[_SAVE_ID] = save_id
    if aliases:
        metadata[_TIED_KEY] = json.dumps(dict(aliases), sort_keys=True)
    save_file(dict(tensors), str(path), metadata=metadata)
    fsync_path(path)


def _safetensors_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return dict(fh.metadata() or {})


def _read_safetensors(path: Path, save_id: str | None = None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(str(path), device="cpu")
    metadata = _safetensors_metadata(path)
    if save_id is not None and metadata.get(_SAVE_ID, save_id) != save_id:
        raise CheckpointError(
            f"{path} belongs to another save_model() than its index (an interrupted save "
            "replaced some shards): save the model again."
        )
    aliases = json.loads(metadata.get(_TIED_KEY, "{}"))
    for alias, name in aliases.items():
        if name in tensors:
            tensors[alias] = tensors[name]
    return tensors


def _written_by_save_model(directory: Path) -> set[Path]:
    """Weight files in ``directory`` that an earlier ``save_model`` wrote, in either format.

    Known from its index (the index and every shard it names) or, for a single
    safetensors file, from the save id in the file's metadata. Anything else (a
    user's ``model_ema.safetensors``, ``model-best.safetensors``) is not ours.
    """
    ours: set[Path] = set()
    for base, ext in _FORMATS:
        index_path = directory / f"{base}{ext}.index.json"
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            names = {str(name) for name in weight_map.values()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            names = None
        if names is not None:
            ours.add(index_path)
            ours.update(directory / n for n in names if Path(n).name == n)
        single = directory / f"{base}{ext}"
        if ext == ".safetensors" and single.is_file():
            try:
                if _SAVE_ID in _safetensors_metadata(single):
                    ours.add(single)
            except Exception:  # not a readable safetensors file: not ours to delete
                pass
    return ours


def save_model_files(
    state: Mapping[str, torch.Tensor],
    save_directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> list[Path]:
    """Write ``state`` as one weights file or as shards plus an index JSON; return the files.

    Shard names follow the common convention (``model-00001-of-00003.safetensors`` and
    ``model.safetensors.index.json`` with a ``weight_map``), so other tools read them;
    the split is huggingface_hub's ``split_torch_state_dict_into_shards``.

    Durable and atomic per file: every file is written under a temporary name,
    fsynced and renamed into place, the index last (it is the commit point of a
    sharded save), then the directory is fsynced. Only after that are the files of an
    earlier ``save_model`` into the same directory that this save did not replace
    removed; other files in the directory are never touched.
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    limit = parse_size(max_shard_size)
    directory = Path(save_directory)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"save_directory={str(directory)!r} is a file; pass a directory path.")
    make_dirs(directory)
    if safe_serialization:
        tensors, aliases = dedupe_tied(state)
        base, ext = "model", ".safetensors"
    else:  # torch.save keeps shared storage within a file by itself
        tensors = {k: v.detach().cpu() for k, v in state.items()}
        aliases, base, ext = {}, "pytorch_model", ".bin"
    split = split_torch_state_dict_into_shards(
        tensors, filename_pattern=base + "{suffix}" + ext, max_shard_size=limit
    )
    previous = _written_by_save_model(directory)
    save_id = uuid.uuid4().hex
    staged: list[tuple[Path, Path]] = []  # (temporary, final), renamed in this order
    try:
        for filename, names in split.filename_to_tensors.items():
            shard = {name: tensors[name] for name in names}
            final = directory / filename
            staged.append((temp_name(final), final))
            if safe_serialization:
                shard_aliases = {a: k for a, k in aliases.items() if k in shard}
                write_safetensors(shard, staged[-1][0], shard_aliases, save_id)
            else:
                torch_save(shard, staged[-1][0])
        if split.is_sharded:
            index: dict[str, Any] = {
                "metadata": {
                    "total_size": sum(t.numel() * t.element_size() for t in tensors.values()),
                    _SAVE_ID: save_id,
                },
                "weight_map": dict(sorted(split.tensor_to_filename.items())),
            }
            if aliases:
                index[_TIED_KEY] = dict(aliases)
            final = directory / f"{base}{ext}.index.json"
            staged.append((temp_name(final), final))
            with open(staged[-1][0], "w", encoding="utf-8") as fh:
                fh.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        for tmp, final in staged:
            os.replace(tmp, final)
        fsync_path(directory)
    finally:
        for tmp, _ in staged:
            if tmp.exists():
                tmp.unlink()
    written = [final for _, final in staged]
    # indexes first, so that no index ever names a shard that is already gone
    stale = sorted(previous - set(written), key=lambda p: not p.name.endswith(".index.json"))
    for old in stale:
        old.unlink(missing_ok=True)
    if stale:
        fsync_path(directory)
    return written


def read_weights(
    path: str | os.PathLike[str], *, weights_only: bool = True
) -> dict[str, torch.Tensor]:
    """Read a state dict from a file, a sharded folder, or an index JSON (all on CPU).

    Raises:
        FileNotFoundError: nothing at ``path``, or a folder without weights.
        CheckpointError: an index naming a missing shard, or an unsafe pickle.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}: check the path.")
    if path.is_dir():
        candidates = [
            SAFE_WEIGHTS + ".index.json",
            SAFE_WEIGHTS,
            TORCH_WEIGHTS + ".index.json",
            TORCH_WEIGHTS,
        ]
        found = next((path / c for c in candidates if (path / c).is_file()), None)
        if found is None:
            raise FileNotFoundError(
                f"{str(path)!r} holds no model weights: expected one of {', '.join(candidates)}."
            )
        path = found
    if path.name.endswith(".index.json"):
        try:
            index = json.loads(path.read_text())
            weight_map = index["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"{path} is not a weights index (no 'weight_map'): {err}"
            ) from err
        state: dict[str, torch.Tensor] = {}
        save_id = (index.get("metadata") or {}).get(_SAVE_ID)
        for shard in sorted(set(weight_map.values())):
            shard_path = path.parent / shard
            if not shard_path.is_file():
                raise CheckpointError(
                    f"{path} names shard {shard!r}, which is missing: re-save the model."
                )
            if shard_path.suffix == ".safetensors":
                state.update(_read_safetensors(shard_path, save_id))
            else:
                state.update(read_weights(shard_path, weights_only=weights_only))
        for alias, name in index.get(_TIED_KEY, {}).items():
            if name in state:
                state[alias] = state[name]
        return state
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    loaded = torch_load(path, weights_only=weights_only)
    if not isinstance(loaded, Mapping):
        raise CheckpointError(
            f"{path} holds a {type(loaded).__name__}, not a state dict of tensors."
        )
    return dict(loaded)


__all__ = [
    "CheckpointError",
    "dedupe_tied",
    "fsync_path",
    "parse_size",
    "read_weights",
    "save_model_files",
    "torch_load",
    "torch_save",
    "write_safetensors",
]
