"""DeepSpeed: ZeRO stages 0-3 and ZeRO-Offload, run by DeepSpeed's own engine.

``prepare`` hands the model, optimizer and scheduler together to
``deepspeed.initialize`` (:mod:`nbaccel.runtime.strategy.deepspeed._deepspeed_prepare`); the engine then
owns the update: ``accelerator.backward`` runs ``engine.backward`` and, on a
gradient-synchronising micro-step, ``engine.step()`` (clipping, optimizer step, zeroing,
the engine's scheduler). Checkpoints are the engine's own per-rank files
(``engine.save_checkpoint``), written into nbaccel's temporary checkpoint directory so
the durable protocol (fsync, manifest, atomic swap) covers them. Full weights for
``save_model``/``get_state_dict`` are gathered to the main process under ZeRO-3.

On CPU the collectives run over gloo: DeepSpeed's shared-memory all-reduce kernel is
turned off because its first use compiles C++ for minutes inside ``prepare``, with no
output in the notebook.

Example:
    >>> DeepSpeed.name
    'deepspeed'
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ....checkpoint.weights import CheckpointError
from ....errors import ConfigError
from ...process.state import DistributedType, ProcessState
from ...saving.sharded_state import TAG, engine_folder
from ..base import PrepareContext, Prepared, SingleProcess
from ._deepspeed_config import precision_from_config
from .deepspeed_plugin import DeepSpeedPlugin, require_deepspeed


def _is_engine(model: Any) -> bool:
    # no import: before deepspeed is imported nothing can be one of its engines
    deepspeed = sys.modules.get("deepspeed")
    return deepspeed is not None and isinstance(model, deepspeed.DeepSpeedEngine)


class DeepSpeed(SingleProcess):
    """Train through ``deepspeed.initialize``'s engine (one engine per Accelerator).

    Raises:
        ConfigError: deepspeed is not installed (naming the install command), XLA
            devices, or fp8.
    """

    name = "deepspeed"
    sharded_checkpoints = True
    collective_state = True
    #: prepare() hands model, optimizer and scheduler to the engine together
    shard_format = "engine"  # DeepSpeed's own per-rank files (save_shards)

    def __init__(
        self, state: ProcessState, plugin: DeepSpeedPlugin, *, mixed_precision: str = "no"
    ) -> None:
        require_deepspeed("DeepSpeedPlugin / strategy='deepspeed'")
        if state.distributed_type is DistributedType.XLA:
            raise ConfigError("DeepSpeed is not available on XLA devices in nbaccel; use 'ddp'.")
        super().__init__(dataclasses.replace(state, distributed_type=DistributedType.DEEPSPEED))
        self.plugin = self.deepspeed_plugin = plugin  # accelerator.state.deepspeed_plugin
        self.config = plugin.deepspeed_config  # filled further in prepare
        self.mixed_precision = precision_from_config(self.config, mixed_precision)
        self.engine: Any = None

    def precision_modes(self, requested: str) -> tuple[str, str]:
        # the engine casts and scales itself: nbaccel's own precision stays out of its way
        return self.mixed_precision, "no"

    # -- the engine ------------------------------------------------------------------------

    def prepare(self, objects: tuple[Any, ...], ctx: PrepareContext) -> Prepared:
        """One engine from the model, optimizer and scheduler given together (loaders as
        always): :func:`~nbaccel.runtime.strategy.deepspeed._deepspeed_prepare.prepare_deepspeed`."""
        from ._deepspeed_prepare import prepare_deepspeed

        return prepare_deepspeed(self, objects, ctx)

    def initialize(self, **kwargs: Any) -> tuple[Any, Any, Any]:
        """``deepspeed.initialize`` with this strategy's config; returns (engine, optimizer,
        scheduler) and keeps the engine for backward, clipping and checkpoints."""
        if self.engine is not None:
            raise ConfigError(
                "this Accelerator already prepared a model with DeepSpeed; one engine per "
                "Accelerator: pass model, optimizer and scheduler to one prepare() call, or "
                "create another Accelerator for the other model."
            )
        _ensure_group(self.state)
        # the engine reads its device index from LOCAL_RANK (set by nbaccel's workers, absent
        # in a one-process run inside the kernel)
        os.environ.setdefault("LOCAL_RANK", str(self.state.local_rank))
        import deepspeed
        import deepspeed.ops

        if self.state.device.type == "cpu":  # gloo, not the shm kernel's C++ JIT build
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        engine, optimizer, _, scheduler = deepspeed.initialize(config=self.config, **kwargs)
        self.engine = engine
        return engine, optimizer, scheduler

    def backward(
        self,
        loss: torch.Tensor,
        *,
        precision: Any,
        num_steps: int,
        sync_gradients: bool,
        **kwargs: Any,
    ) -> None:
        """``engine.backward`` (the engine scales for accumulation and fp16 itself); on a
        synchronising micro-step also ``engine.step()``."""
        if self.engine is None:
            raise ConfigError(
                "accelerator.backward() under DeepSpeed needs a prepared model: call "
                "accelerator.prepare(model, optimizer, dataloader, ...) first."
            )
        fixed = self.engine.gradient_accumulation_steps()
        if num_steps != fixed:  # the engine would scale the loss by its own count, silently
            raise ConfigError(
                f"gradient_accumulation_steps is {num_steps} but DeepSpeed's engine was built "
                f"with {fixed} (its loss scaling and update boundary): set it before "
                "accelerator.prepare(), in the Accelerator or the DeepSpeed config."
            )
        self.engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
        self.engine.backward(loss, **kwargs)
        if sync_gradients:
            self.engine.step()

    def free_memory(self) -> None:
        self.engine = None  # a later prepare() builds a new engine (e.g. the next fold)

    def wrap_model(
        self, model: torch.nn.Module, *, ddp_kwargs: Mapping[str, Any] | None = None
    ) -> torch.nn.Module:
        # prepare() hands the model to deepspeed.initialize; a model prepared on its own
        # would silently train outside the engine
        raise ConfigError(
            "under DeepSpeed prepare the model together with its optimizer (and dataloader, "
            "scheduler): accelerator.prepare(model, optimizer, ...); prepare_model() alone "
            "cannot build DeepSpeed's engine (evaluation_mode=True places a model for "
            "inference only)."
        )

    def no_sync(self, model: Any) -> contextlib.AbstractContextManager[Any]:
        # the engine knows the accumulation boundary (set in backward): nothing to switch
        return contextlib.nullcontext()

    def clip_grad_norm_(
        self, parameters: list[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        """The engine clipped inside ``backward`` (``gradient_clipping`` of the config);
        return the global norm it measured before clipping."""
        # the engine's value: without "gradient_clipping" DeepSpeed clips at its default (1.0)
        engine = self.engine
        configured = float(engine.gradient_clipping() if engine is not None else 0.0)
        if configured != float(max_norm) or norm_type != 2.0:
            raise ConfigError(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}) under DeepSpeed: "
                "the engine clips the 2-norm inside accelerator.backward() to the config's "
                f"gradient_clipping ({configured or 'not set'}); set DeepSpeedPlugin("
                f'gradient_clipping={max_norm}) (or "gradient_clipping": {max_norm} in the '
                "DeepSpeed config) so both agree."
            )
        norm = engine.get_global_grad_norm() if engine is not None else None
        return torch.as_tensor(0.0 if norm is None else float(norm))

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True) -> Any:
        inner: Any = model.module if _is_engine(model) else model
        return super().unwrap_model(inner, keep_fp32_wrapper=keep_fp32_wrapper)

    def _stage(self) -> int:
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    # -- state dicts (collective under ZeRO-3: call on every rank) ----------------------

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Full weights on the main process (ZeRO-3 gathers the partitions); ``{}`` elsewhere."""
        if _is_engine(model) and self._stage() == 3:
            engine: Any = model
            state = engine._zero3_consolidated_16bit_state_dict()
            return dict(state) if state is not None and self.state.is_main_process else {}
        module = self.unwrap_model(model)
        return module.state_dict() if self.state.is_main_process else {}

    def load_model_state_dict(
        self, model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True
    ) -> Any:
        # reached only for a checkpoint of full files (DDP, FULL_STATE_DICT): refused before
        # anything is loaded, so a failed load_state leaves the engine as it was
        raise CheckpointError(_NOT_OURS)

    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any]:
        raise CheckpointError(  # save_state writes the engine's files instead (save_shards)
            "DeepSpeed's optimizer state is partitioned across ranks: save it with "
            "accelerator.save_state(), which writes the engine's own per-rank files."
        )

    def load_optimizer_state_dict(self, optimizer: Any, state: Mapping[str, Any]) -> None:
        raise CheckpointError(_NOT_OURS)

    # -- checkpoints: DeepSpeed's own files, inside nbaccel's durable directory ---------

    def save_shards(self, models: list[Any], optimizers: list[Any], directory: Path) -> None:
        """Every rank writes its part of each engine with ``engine.save_checkpoint``."""
        for i, engine in enumerate(models):
            engine.save_checkpoint(str(directory / engine_folder(i)), tag=TAG, save_latest=False)

    def load_shards(
        self, models: list[Any], optimizers: list[Any], source: Path, *, strict: bool = True
    ) -> None:
        """Restore each engine (weights, optimizer partitions, the engine's scheduler)."""
        for i, engine in enumerate(models):
            folder = source / engine_folder(i)
            loaded, _ = engine.load_checkpoint(
                str(folder), tag=TAG, load_module_strict=strict, load_lr_scheduler_states=True
            )
            if loaded is None:
                raise CheckpointError(
                    f"{str(folder)!r} holds no DeepSpeed state for this engine (tag {TAG!r}): "
                    "load a checkpoint that save_state wrote under DeepSpeed."
                )

    def __repr__(self) -> str:
        return f"DeepSpeed(world_size={self.state.world_size}, zero_stage={self._stage()})"


_NOT_OURS = (
    "this checkpoint was saved without DeepSpeed: its optimizer state cannot go into "
    "DeepSpeed's partitioned optimizer. Resume it under the strategy that saved it, or load "
    "only its weights into the model before accelerator.prepare() and start a new optimizer."
)


def _ensure_group(state: ProcessState) -> None:
    """DeepSpeed needs a process group, also for one process (e.g. ZeRO-Offload on one GPU)."""
    if dist.is_available() and not dist.is_initialized() and state.world_size == 1:
        backend = "nccl" if state.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


__all__ = ["DeepSpeed"]
