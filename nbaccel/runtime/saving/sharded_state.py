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
from ...platform import torchcompat
from ..strategy.deepspeed.deepspeed import holds_engine_state
from ..strategy.fsdp.fsdp import owner_model


def _suffix(i: int) -> str:
    return "" if i == 0 else f"_{i}"


def _modules(acc: Any) -> list[torch.nn.Module]:
    return [acc.strategy.unwrap_model(model) for model in acc._models]


def save_sharded(acc: Any, directory: Path) -> None:
    """Every rank writes its shard of each prepared model and optimizer (call on all ranks)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    own = getattr(acc.strategy, "save_shards", None)
    if own is not None:  # DeepSpeed: the engine writes its own per-rank files
        own(acc._models, directory)
        return
    modules = _modules(acc)
    for i, module in enumerate(modules):
        save_dcp({"model": get_model_state_dict(module)}, directory / f"model{_suffix(i)}.dcp")
    for i, optimizer in enumerate(acc._optimizers):
        inner = optimizer.optimizer
        state = get_optimizer_state_dict(owner_model(modules, inner), inner)
        save_dcp({"optimizer": state}, directory / f"optimizer{_suffix(i)}.dcp")


def holds_sharded(source: str | os.PathLike[str]) -> bool:
    """True if the checkpoint at ``source`` holds DCP model/optimizer folders (or
    DeepSpeed's engine files)."""
    if holds_engine_state(source):
        return True
    return is_dcp(Path(source) / "model.dcp") or is_dcp(Path(source) / "optimizer.dcp")


def load_sharded(acc: Any, source: Path, *, strict: bool = True) -> None:
    """Restore what :func:`save_sharded` wrote, resharded to this run (call on all ranks)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    own = getattr(acc.strategy, "load_shards", None)
    if holds_engine_state(source) != (own is not None):
        raise CheckpointError(
            f"{str(source)!r} was saved under "
            f"{'DeepSpeed' if holds_engine_state(source) else 'FSDP'} and this Accelerator "
            f"runs {acc.strategy.name}: load it with the strategy that saved it (DeepSpeed "
            "checkpoints convert to full weights with the zero_to_fp32.py script inside them)."
        )
    if own is not None:
        own(acc._models, source, strict=strict)
        return
    modules = _modules(acc)
    for i, module in enumerate(modules):
        state = get_model_state_dict(module)
        load_dcp({"model": state}, source / f"model{_suffix(i)}.dcp")
        set_model_state_dict(module, state, options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(acc._optimizers):
        inner = optimizer.optimizer
        model = owner_model(modules, inner)
        optim_state: Any = get_optimizer_state_dict(model, inner)
        load_dcp({"optimizer": optim_state}, source / f"optimizer{_suffix(i)}.dcp")
        set_optimizer_state_dict(model, inner, optim_state)


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
    "holds_sharded",
    "is_sharded_model",
    "load_sharded",
    "load_weights_into_sharded",
    "save_sharded",
]
