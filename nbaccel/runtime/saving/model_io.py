"""Model weights in and out: ``save_model``, ``save`` and ``load_checkpoint_in_model``.

The file formats (safetensors shards plus an index, torch files, tied weights) are
:mod:`nbaccel.checkpoint.weights`; this module decides what to write from a
prepared model (unwrapped first) and on which rank.

Example:
    >>> import torch, tempfile
    >>> model = torch.nn.Linear(2, 2)
    >>> folder = tempfile.mkdtemp()
    >>> from nbaccel.checkpoint.weights import save_model_files
    >>> _ = save_model_files(model.state_dict(), folder)
    >>> load_checkpoint_in_model(torch.nn.Linear(2, 2), folder).missing_keys
    []
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ...checkpoint import remote
from ...checkpoint.durable import replace, temp_name
from ...checkpoint.store import as_local, check, is_url
from ...checkpoint.weights import (
    CheckpointError,
    dedupe_tied,
    parse_size,
    read_weights,
    save_model_files,
    torch_save,
    write_safetensors,
)
from ...errors import ConfigError
from ..process import rank_check
from ..training.wrappers import unwrap_model
from ._checkpoint_collective import FIX as COLLECTIVE_FIX
from .sharded_state import is_sharded_model, load_weights_into_sharded


class LoadResult(NamedTuple):
    """Keys the checkpoint lacked and keys the model did not expect."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _place(model: torch.nn.Module, device_map: Any) -> None:
    if device_map is None:
        return
    if device_map == "auto" or (isinstance(device_map, Mapping) and "disk" in device_map.values()):
        raise ConfigError(
            f"device_map={device_map!r} is not supported: pass a device ('cpu', 'cuda:0') or a "
            "dict mapping module names to devices, e.g. {'': 'cuda:0', 'head': 'cpu'}."
        )
    if not isinstance(device_map, Mapping):
        model.to(
            torch.device(device_map) if not isinstance(device_map, int) else f"cuda:{device_map}"
        )
        return
    for prefix in sorted(device_map, key=lambda p: p.count(".") + bool(p)):  # parents first
        device = device_map[prefix]
        device = f"cuda:{device}" if isinstance(device, int) else device
        try:
            module = model.get_submodule(prefix)
        except AttributeError as err:
            raise ConfigError(
                f"device_map names {prefix!r}, which the model does not have."
            ) from err
        module.to(torch.device(device))


def _cast(state: dict[str, Any], dtype: Any, keep_fp32: list[str] | None) -> dict[str, Any]:
    if dtype is None:
        return state
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    kept = list(keep_fp32 or [])

    def target_dtype(name: str) -> Any:
        parts = name.split(".")
        return torch.float32 if any(k in parts for k in kept) else dtype

    return {k: v.to(target_dtype(k)) if torch.is_floating_point(v) else v for k, v in state.items()}


def load_checkpoint_in_model(
    model: torch.nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: Any = None,
    offload_folder: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = True,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
    *,
    weights_only: bool = True,
) -> LoadResult:
    """Load weights into ``model`` in place from a file, a sharded folder or an index JSON.

    Args:
        model: the model (wrappers such as DDP are looked through). A sharded (FSDP)
            model loads safetensors weights shard by shard: each rank reads its rows only.
        checkpoint: ``*.safetensors``, a torch ``*.bin``/``*.pt`` state dict, a folder
            written by ``save_model``, or a ``*.index.json``; a path or an fsspec URL
            (``s3://bucket/model``: downloaded to a temporary folder first).
        device_map: ``None`` (leave parameters where they are), a device, or a dict
            ``{module_name: device}`` (``""`` is the whole model) applied after loading.
        offload_folder, offload_buffers, offload_8bit_bnb: disk/CPU offload of a dispatched
            model (Accelerate's big-model inference): not in nbaccel, an error if set.
        dtype: cast floating-point weights to this dtype (``"float16"`` or a torch dtype),
            except those of modules named in ``keep_in_fp32_modules``.
        keep_in_fp32_modules: module name parts whose weights stay float32 with ``dtype``.
        strict: raise if keys are missing or unexpected (Accelerate's default is False:
            nbaccel raises, naming the keys, instead of loading part of a model silently).
        offload_state_dict, full_state_dict, broadcast_from_rank0: accepted; the result
            is the same (every rank reads what it needs, sharded models their rows).
        weights_only: keep ``True`` unless you trust a torch file that holds more than tensors.

    Example:
        >>> load_checkpoint_in_model(model, "out/model")  # doctest: +SKIP
    """
    for name, value in (
        ("offload_folder", offload_folder),
        ("offload_buffers", offload_buffers),
        ("offload_8bit_bnb", offload_8bit_bnb),
    ):
        if value:
            raise ConfigError(
                f"load_checkpoint_in_model({name}=...) offloads a dispatched model, which "
                "nbaccel does not do: load the weights and model.to(device), or shard a model "
                "too big for one device with FSDP2 (FullyShardedDataParallelPlugin(cpu_offload=True))."
            )
    if isinstance(checkpoint, str) and is_url(checkpoint):  # read from a local copy
        with tempfile.TemporaryDirectory(prefix="nbaccel-weights-") as folder:
            local = remote.fetch_weights(checkpoint, Path(folder))
            return load_checkpoint_in_model(
                model,
                local,
                device_map=device_map,
                dtype=dtype,
                keep_in_fp32_modules=keep_in_fp32_modules,
                strict=strict,
                weights_only=weights_only,
            )
    checkpoint = as_local(checkpoint)  # file:// URLs too
    target = unwrap_model(model)
    if is_sharded_model(target):  # FSDP: each rank reads only its shard's rows
        missing, unexpected = load_weights_into_sharded(target, checkpoint, strict=strict)
        _place(target, device_map)
        return LoadResult(missing, unexpected)
    state = _cast(read_weights(checkpoint, weights_only=weights_only), dtype, keep_in_fp32_modules)
    expected = set(target.state_dict())
    result = LoadResult(sorted(expected - set(state)), sorted(set(state) - expected))
    if strict and (result.missing_keys or result.unexpected_keys):
        raise CheckpointError(
            f"{checkpoint} does not match {type(target).__name__}: missing keys "
            f"{result.missing_keys[:10]}, unexpected keys {result.unexpected_keys[:10]}. "
            "Pass strict=False to load the matching part."
        )
    target.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    _place(target, device_map)
    return result


def save_model(
    acc: Any,
    model: torch.nn.Module,
    save_directory: str | os.PathLike[str],
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> list[Path] | list[str]:
    """Write ``model``'s unwrapped weights from the main process; shards + index when large.

    Replicated training: call it on every rank or on the main process alone. FSDP: call
    it on every rank (the full weights are gathered to the main process); a call made
    on some ranks only fails with an error naming the others. Returns the files written
    (empty on other ranks). ``save_directory`` may be an fsspec URL (``s3://bucket/model``):
    the files are built in a private temporary folder and uploaded, the index last.
    """
    parse_size(max_shard_size)  # validate on every rank, not only where it writes
    url = isinstance(save_directory, str) and is_url(save_directory)
    if url:  # a missing package or unknown scheme: refused on every rank, nothing written
        check(save_directory)
    else:
        save_directory = as_local(save_directory)
    if acc.strategy.collective_state:  # FSDP gathers the weights: every rank takes part
        rank_check.all_ranks_enter("save_model", COLLECTIVE_FIX)
    elif not acc.state.is_main_process:
        return []  # replicated weights: the main process writes them, alone if need be
    state = acc.strategy.model_state_dict(model)
    if not acc.state.is_main_process:
        return []
    if url:  # built in a private folder, uploaded from there (the index last)
        with tempfile.TemporaryDirectory(prefix="nbaccel-weights-") as folder:
            save_model_files(
                state, folder, max_shard_size=max_shard_size, safe_serialization=safe_serialization
            )
            return remote.upload_weights(Path(folder), str(save_directory))
    return save_model_files(
        state,
        save_directory,
        max_shard_size=max_shard_size,
        safe_serialization=safe_serialization,
    )


def save(acc: Any, obj: Any, f: Any, safe_serialization: bool = False) -> None:
    """Save ``obj`` to ``f`` once per machine (the local main process), atomically for paths.

    With ``safe_serialization=True`` ``obj`` must be a dict of tensors (safetensors). ``f``
    may be an fsspec URL (``s3://bucket/obj.pt``): written by the main process into a
    private temporary file, then uploaded.
    """
    if isinstance(f, str) and is_url(f):
        check(f)  # on every rank: a missing package is an error everywhere
        if acc.state.is_main_process:  # one store for all machines: one writer
            with tempfile.TemporaryDirectory(prefix="nbaccel-save-") as folder:
                local = str(Path(folder) / "obj")
                _save_local(obj, local, safe_serialization)
                remote.upload_file(Path(local), f)
        return
    if not acc.state.is_local_main_process:
        return
    if hasattr(f, "write"):
        if safe_serialization:
            raise ConfigError("safe_serialization=True needs a file path, not an open file object.")
        torch.save(obj, f)
        return
    _save_local(obj, as_local(f), safe_serialization)


def _save_local(obj: Any, path: str | os.PathLike[str], safe_serialization: bool) -> None:
    path = Path(path)
    tmp = temp_name(path)
    try:
        if safe_serialization:
            if not isinstance(obj, dict):
                raise ConfigError(
                    f"safe_serialization=True saves a dict of tensors, not a {type(obj).__name__}."
                )
            tensors, aliases = dedupe_tied(obj)
            write_safetensors(tensors, tmp, aliases)
        else:
            torch_save(obj, tmp)
        replace(tmp, path)  # and fsync the folder, so the new name survives a crash
    finally:
        if tmp.exists():
            tmp.unlink()


def merge_fsdp_weights(
    checkpoint_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
) -> list[Path]:
    """Turn the sharded model of an FSDP checkpoint into full weights files (one process).

    Args:
        checkpoint_dir: a checkpoint written by ``save_state`` under FSDP (its ``model.dcp``
            folder is read), or such a ``*.dcp`` folder itself.
        output_path: the folder for the weights (safetensors shards + index, as
            ``save_model`` writes them).
        safe_serialization: safetensors (default) or torch ``.bin`` files.
        remove_checkpoint_dir: delete the ``.dcp`` folder afterwards.
    """
    import shutil
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    source = Path(checkpoint_dir)
    if (source / "model.dcp").is_dir():
        source = source / "model.dcp"
    if not source.is_dir():
        raise CheckpointError(
            f"{str(checkpoint_dir)!r} holds no sharded model: pass a checkpoint saved by "
            "save_state under FSDP (SHARDED_STATE_DICT), or its model.dcp folder."
        )
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(source, Path(tmp) / "full.pt")
        state = torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=True)
    state = state.get("model", state)
    written = save_model_files(state, output_path, safe_serialization=safe_serialization)
    if remove_checkpoint_dir:
        shutil.rmtree(source)
    return written


__all__ = ["LoadResult", "load_checkpoint_in_model", "merge_fsdp_weights", "save", "save_model"]
