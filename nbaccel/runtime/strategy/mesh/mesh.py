"""The mesh strategy: tensor parallel on ``tp``, then FSDP2 over the data dimensions.

What ``Accelerator(parallelism_config=...)`` trains with when tensor parallel or sharding
is on (pure replication is the DDP strategy). Built on :class:`~nbaccel.runtime.strategy.FSDP`:
``prepare`` first parallelises the model on the mesh's ``tp`` dimension
(:mod:`nbaccel.runtime.parallel.tensor_parallel`), then -- when ``dp_shard`` or ``cp`` is enabled -- shards it with
``fully_shard`` over ``mesh["dp_shard_cp"]``, or ``mesh["dp_replicate", "dp_shard_cp"]``
(HSDP: torch replicates over the first dimension, shards over the second). Parameters are
DTensors either way, so clipping, sharded checkpoints (DCP) and full state dicts
(``get_model_state_dict``) go through torch's DTensor-aware helpers.

Example:
    >>> MeshParallel.sharded_checkpoints
    True
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ...parallel.config import ParallelismConfig
from ...parallel.export import route_save_pretrained
from ...parallel.tensor_parallel import (
    apply_tensor_parallel,
    check_transformers_mesh,
    is_tensor_parallel,
)
from ...process.state import ProcessState
from ..fsdp.fsdp import FSDP
from ..fsdp.fsdp_plugin import FullyShardedDataParallelPlugin


class MeshParallel(FSDP):
    """Tensor parallel and/or FSDP2 (HSDP) over a ``ParallelismConfig``'s ``DeviceMesh``.

    Raises:
        ConfigError: as :class:`FSDP`, plus layouts the process group cannot hold.
    """

    def __init__(
        self,
        state: ProcessState,
        config: ParallelismConfig,
        plugin: FullyShardedDataParallelPlugin | None = None,
        *,
        mixed_precision: str = "no",
    ) -> None:
        super().__init__(state, plugin, mixed_precision=mixed_precision)
        self.config = config
        if not config.fsdp_enabled:  # tensor parallel alone: not FSDP, as in Accelerate
            self.state = dataclasses.replace(self.state, distributed_type=state.distributed_type)
            self.name = "tp"
        self.device_mesh = config.get_device_mesh(state.device.type)
        check_transformers_mesh(config)  # before from_pretrained(tp_plan=...) could fail
        if config.fsdp_enabled:
            # without cp, dp_shard_cp is dp_shard: slice the real dimensions (torch deprecates
            # slicing flattened ones from the root mesh)
            dims = [
                "dp_shard" if d == "dp_shard_cp" and not config.cp_enabled else d
                for d in config.fsdp_dim_names
            ]
            self._mesh = self.device_mesh[tuple(dims)]

    def place_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.config.fsdp_enabled or any(p.is_meta for p in model.parameters()):
            return model  # fully_shard places each shard itself
        return model.to(self.state.device)  # parallelize_module splits what is here

    def wrap_model(
        self, model: torch.nn.Module, *, ddp_kwargs: Mapping[str, Any] | None = None
    ) -> torch.nn.Module:
        trainable = any(p.requires_grad for p in model.parameters())
        if self.config.tp_enabled and (trainable or is_tensor_parallel(model)):
            handler = self.config.tp_handler  # enable_async_tp: refused in check_runnable
            apply_tensor_parallel(model, self.device_mesh["tp"], getattr(handler, "plan", None))
        elif self.config.tp_enabled and self.state.is_main_process:
            # a frozen model (a teacher, a reference model) is legitimate, but the user's plan
            # is then not applied: say so once, with what each rank holds instead
            warnings.warn(self._frozen_model_warning(model), UserWarning, stacklevel=3)
        if not self.config.fsdp_enabled:
            self._models.add(model)
            route_save_pretrained(model, strategy=self)  # its own would die on the shards
            return model
        return super().wrap_model(model, ddp_kwargs=ddp_kwargs)

    def _frozen_model_warning(self, model: torch.nn.Module) -> str:
        # FSDP.wrap_model leaves a model with nothing to train unsharded as well
        return (
            f"prepare(): this {type(model).__name__} has no trainable parameters, so tensor "
            f"parallel (tp_size={self.config.tp_size}) is not applied to it (the plan is "
            "unused) and it is not sharded either: every rank holds the whole model. Fine for "
            "a frozen model used for inference; to split it, parallelise it yourself before "
            "prepare with torch's parallelize_module(model, accelerator.torch_device_mesh['tp'], "
            "plan), or prepare it with trainable parameters (requires_grad=True)."
        )

    # -- state dicts: DTensors (TP and/or FSDP) gathered to full tensors -----------------

    def holds_dtensors(self, module: torch.nn.Module) -> bool:
        """Sharded by ``fully_shard``, or split by tensor parallel alone."""
        return super().holds_dtensors(module) or is_tensor_parallel(module)

    def __repr__(self) -> str:
        return f"MeshParallel({self.config!r}, mesh={self.device_mesh!r})"


__all__ = ["MeshParallel"]
