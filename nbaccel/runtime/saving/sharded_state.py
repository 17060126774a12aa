"""Sharded checkpoints and weights for sharded (FSDP2) models.

* :func:`save_sharded` / :func:`load_sharded`: the model and optimizer part of
  ``save_state``/``load_state`` when the strategy shards checkpoints: every rank writes
  its shard with ``torch.distributed.checkpoint`` (files: :mod:`nbaccel.checkpoint.sharded`)
  into the checkpoint directory being built. State dicts come from
  ``torch.distributed.checkpoint.state_dict`` (keys are parameter names), so any
  strategy -- FSDP on another world size, or one plain process -- loads them (DCP
  reshards).
* :func:`load_weights_into_sharded`: safetensors weights into a sharded model, each
  rank reading only the rows of its own shard.

Example:
    >>> holds_sharded("no/such/checkpoint")
    False
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ...checkpoint.sharded import is_dcp, load_dcp, read_rows, save_dcp, weight_locations
from ...checkpoint.weights import CheckpointError
from ...errors import ConfigError
from ...platform import torchcompat

#: the folder (per prepared model) and tag of DeepSpeed's engine files inside a checkpoint
ENGINE_FOLDER, TAG = "pytorch_model", "state"


def _suffix(i: int) -> str:
    return "" if i == 0 else f"_{i}"


def engine_folder(i: int) -> str:
    """The folder of the ``i``-th prepared engine's files (DeepSpeed's own layout)."""
    return ENGINE_FOLDER if i == 0 else f"{ENGINE_FOLDER}_{i}"


def holds_engine_state(source: str | os.PathLike[str]) -> bool:
    """True if the checkpoint at ``source`` holds DeepSpeed engine files."""
    return (Path(source) / ENGINE_FOLDER / TAG).is_dir()


def owner_model(models: Any, optimizer: Any) -> torch.nn.Module:
    """The prepared model whose parameters ``optimizer`` updates (torch's optimizer
    state-dict helpers key the state by that model's parameter names)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # a PreparedOptimizer's torch one
    params = {id(p) for group in inner.param_groups for p in group["params"]}
    owners = [m for m in models if any(id(p) in params for p in m.parameters())]
    if len(owners) != 1:
        raise ConfigError(
            f"an optimizer must update the parameters of exactly one prepared model for FSDP "
            f"checkpoints; this one updates {len(owners)}. Use one optimizer per model."
        )
    return owners[0]


def save_dcp_shards(modules: list[torch.nn.Module], optimizers: list[Any], directory: Path) -> None:
    """Every rank writes its shard of each module and optimizer with DCP (call on all ranks)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    for i, module in enumerate(modules):
        save_dcp({"model": get_model_state_dict(module)}, directory / f"model{_suffix(i)}.dcp")
    for i, optimizer in enumerate(optimizers):
        inner = optimizer.optimizer
        state = get_optimizer_state_dict(owner_model(modules, inner), inner)
        save_dcp({"optimizer": state}, directory / f"optimizer{_suffix(i)}.dcp")


def load_dcp_shards(
    modules: list[torch.nn.Module], optimizers: list[Any], source: Path, *, strict: bool = True
) -> None:
    """Restore what :func:`save_dcp_shards` wrote, resharded to this run (all ranks)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for i, module in enumerate(modules):
        state = get_model_state_dict(module)
        load_dcp({"model": state}, source / f"model{_suffix(i)}.dcp")
        set_model_state_dict(module, state, options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers):
        inner = optimizer.optimizer
        model = owner_model(modules, inner)
        optim_state: Any = get_optimizer_state_dict(model, inner)
        load_dcp({"optimizer": optim_state}, source / f"optimizer{_suffix(i)}.dcp")
        set_optimizer_state_dict(model, inner, optim_state)


def shard_format_of(source: str | os.PathLike[str]) -> str:
    """``"engine"`` for DeepSpeed's engine files, else ``"dcp"`` (the strategies' ``shard_format``)."""
    return "engine" if holds_engine_state(source) else "dcp"


def save_sharded(acc: Any, directory: Path) -> None:
    """Every rank writes its shard of each prepared model and optimizer (call on all ranks):
    the strategy writes them in its own format."""
    acc.strategy.save_shards(acc._models, acc._optimizers, directory)


def holds_sharded(source: str | os.PathLike[str]) -> bool:
    """True if the checkpoint at ``source`` holds DCP model/optimizer folders (or
    DeepSpeed's engine files)."""
    if holds_engine_state(source):
        return True
    return is_dcp(Path(source) / "model.dcp") or is_dcp(Path(source) / "optimizer.dcp")


def load_sharded(acc: Any, source: Path, *, strict: bool = True) -> None:
    """Restore what :func:`save_sharded` wrote, resharded to this run (call on all ranks)."""
    saved_as = shard_format_of(source)
    if saved_as != acc.strategy.shard_format:
        raise CheckpointError(
            f"{str(source)!r} was saved under "
            f"{'DeepSpeed' if saved_as == 'engine' else 'FSDP'} and this Accelerator "
            f"runs {acc.strategy.name}: load it with the strategy that saved it (DeepSpeed "
            "checkpoints convert to full weights with the zero_to_fp32.py script inside them)."
        )
    acc.strategy.load_shards(acc._models, acc._optimizers, source, strict=strict)


def _local_part(tensor: Any, location: tuple[Path, str]) -> torch.Tensor:
    """This rank's part of a stored tensor, for a DTensor sharded on one mesh dimension."""
    dtensor = torchcompat.dtensor_module()
    Shard, distribute_tensor = dtensor.Shard, dtensor.distribute_tensor

    local = tensor.to_local()
    placement = tensor.placements[0] if len(tensor.placements) == 1 else None
    if isinstance(placement, Shard):
        mesh, dim = tensor.device_mesh, placement.dim
        size, count = tensor.shape[dim], mesh.size()
        step = -(-size // count)  # torch.chunk's split, as fully_shard uses
        start = min(mesh.get_local_rank() * step, size)
        rows = read_rows(location, dim, start, min(start + step, size))
        if rows.shape == local.shape:
            return rows
    full = read_rows(location, 0, 0, tensor.shape[0] if tensor.dim() else 0)
    placements = tensor.placements
    return distribute_tensor(full, tensor.device_mesh, placements, src_data_rank=None).to_local()


def load_weights_into_sharded(
    module: torch.nn.Module, checkpoint: str | os.PathLike[str], *, strict: bool = True
) -> tuple[list[str], list[str]]:
    """Load safetensors weights into a sharded model in place; return (missing, unexpected).

    Each rank reads only the slice of each tensor that its shard holds, so no rank ever
    holds the whole model.
    """
    DTensor = torchcompat.dtensor_module().DTensor

    where = weight_locations(checkpoint)
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(where)), sorted(set(where) - set(own))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{checkpoint} does not match {type(module).__name__}: missing keys {missing[:10]}, "
            f"unexpected keys {unexpected[:10]}. Pass strict=False to load the matching part."
        )
    with torch.no_grad():
        for name, tensor in own.items():
            if name not in where:
                continue
            if isinstance(tensor, DTensor):
                tensor.to_local().copy_(_local_part(tensor, where[name]))
            else:
                size = tensor.shape[0] if tensor.dim() else 0
                tensor.copy_(read_rows(where[name], 0, 0, size))
    return missing, unexpected


def is_sharded_model(module: torch.nn.Module) -> bool:
    """True if ``module`` holds DTensor parameters (``fully_shard`` was applied)."""
    DTensor = torchcompat.dtensor_module().DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


__all__ = [
    "ENGINE_FOLDER",
    "TAG",
    "engine_folder",
    "holds_engine_state",
    "holds_sharded",
    "is_sharded_model",
    "load_dcp_shards",
    "load_sharded",
    "load_weights_into_sharded",
    "owner_model",
    "save_dcp_shards",
    "save_sharded",
    "shard_format_of",
]
