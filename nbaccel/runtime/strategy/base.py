"""The strategy interface, and the single-process strategy every other one builds on.

A strategy is how the model takes part in training across processes: it wraps the
model, controls gradient synchronisation, clips gradients (the global norm), and
produces/consumes the model and optimizer state dicts that checkpoints hold, and
writes/reads its shards of a sharded checkpoint. Every strategy answers the same calls
(:meth:`~SingleProcess.prepare`, ``backward``, ``no_sync``, ``clip_grad_norm_``, the state
dicts, ``save_shards``/``load_shards``, the ``plugin`` it carries); the ``Accelerator``
calls them, never branches on the distributed type or probes for a method, and keeps its
own lists of prepared objects: a strategy hands back what it made (:class:`Prepared`).

Example:
    >>> import torch
    >>> from nbaccel.runtime.process.state import get_state
    >>> strategy = SingleProcess(get_state(cpu=True))
    >>> model = strategy.wrap_model(torch.nn.Linear(2, 2))
    >>> sorted(strategy.model_state_dict(model))
    ['bias', 'weight']
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..process.state import ProcessState
from ..saving.sharded_state import load_dcp_shards, save_dcp_shards
from ..training.wrappers import object_kind, unwrap_model


@dataclasses.dataclass(frozen=True)
class PrepareContext:
    """What a strategy's :meth:`~SingleProcess.prepare` may use of the ``Accelerator``.

    Attributes:
        placement: per object, whether to move it to the device.
        prepare_one: kind (``"model"``, ``"optimizer"``, ``"scheduler"``, ``"dataloader"``,
            in the order they are prepared) -> the Accelerator's one-object prepare, which
            also keeps what it returns.
        gradient_state: the Accelerator's accumulation state.
        num_processes: processes taking part.
        split_batches: the Accelerator's ``split_batches``.
        step_scheduler_with_optimizer: the Accelerator's setting of that name.
    """

    placement: list[bool]
    prepare_one: Mapping[str, Callable[[Any, bool], Any]]
    gradient_state: Any
    num_processes: int
    split_batches: bool
    step_scheduler_with_optimizer: bool


@dataclasses.dataclass
class Prepared:
    """What :meth:`~SingleProcess.prepare` returns: the objects, in the order given, and
    those the strategy made itself (not through ``prepare_one``) for the Accelerator to keep."""

    objects: list[Any]
    models: list[Any] = dataclasses.field(default_factory=list)
    optimizers: list[Any] = dataclasses.field(default_factory=list)
    schedulers: list[Any] = dataclasses.field(default_factory=list)


class SingleProcess:
    """One process, or several that share nothing but collectives: no model wrapper."""

    #: short name shown in errors and reprs
    name = "single"
    #: save_state writes one shard per rank (torch.distributed.checkpoint) instead of full files
    sharded_checkpoints = False
    #: model/optimizer state dicts need every rank (collectives): checkpoint calls must be
    #: made on every rank. False: the state is replicated, any rank can save it alone.
    collective_state = False
    #: how :meth:`save_shards` writes: ``"dcp"`` (torch.distributed.checkpoint, any
    #: strategy reshards it) or ``"engine"`` (DeepSpeed's own files)
    shard_format = "dcp"
    #: the plugin this strategy carries (an FSDP or DeepSpeed plugin), or None
    plugin: Any = None
    #: ``accelerator.state.deepspeed_plugin`` (Accelerate's name): set by DeepSpeed only
    deepspeed_plugin: Any = None

    def __init__(self, state: ProcessState) -> None:
        self.state = state

    def prepare(self, objects: tuple[Any, ...], ctx: PrepareContext) -> Prepared:
        """Prepare what ``Accelerator.prepare`` was given: each object by its kind, models
        first (optimizers follow their parameters); others are returned unchanged."""
        kinds = [object_kind(obj) for obj in objects]
        result = list(objects)
        for kind, prepare_one in ctx.prepare_one.items():
            for i, obj in enumerate(objects):
                if kinds[i] == kind:
                    result[i] = prepare_one(obj, ctx.placement[i])
        return Prepared(result)

    def precision_modes(self, requested: str) -> tuple[str, str]:
        """(the precision the Accelerator reports, the one nbaccel's precision runs)."""
        return requested, requested

    def backward(
        self,
        loss: torch.Tensor,
        *,
        precision: Any,
        num_steps: int,
        sync_gradients: bool,
        **kwargs: Any,
    ) -> None:
        """``loss.backward()`` scaled for accumulation, through the precision (loss scaling)."""
        if num_steps > 1:
            loss = loss / num_steps
        precision.backward(loss, **kwargs)

    def place_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move the model to this process's device (before :meth:`wrap_model`)."""
        return model.to(self.state.device)

    def wrap_model(
        self, model: torch.nn.Module, *, ddp_kwargs: Mapping[str, Any] | None = None
    ) -> torch.nn.Module:
        """The model as it trains (here: as it is)."""
        return model

    def no_sync(self, model: Any) -> contextlib.AbstractContextManager[Any]:
        """A context in which backward does not synchronise gradients (nothing to skip here)."""
        return contextlib.nullcontext()

    def clip_grad_norm_(
        self, parameters: list[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        """Clip the norm of all gradients together; return the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True) -> Any:
        """The user's module inside whatever this strategy (or ``torch.compile``) added."""
        return unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper)

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full state dict of the user's module (what checkpoints and exports hold)."""
        return unwrap_model(model).state_dict()

    def load_model_state_dict(
        self, model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True
    ) -> Any:
        """Load a full state dict into the user's module."""
        return unwrap_model(model).load_state_dict(state, strict=strict)

    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state dict as checkpoints hold it."""
        state: dict[str, Any] = optimizer.state_dict()
        return state

    def load_optimizer_state_dict(self, optimizer: Any, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`optimizer_state_dict` produced."""
        optimizer.load_state_dict(state)

    def save_shards(self, models: list[Any], optimizers: list[Any], directory: Path) -> None:
        """Write this rank's shard of each model and optimizer into ``directory`` (every
        rank calls it): torch.distributed.checkpoint, which any strategy reshards."""
        modules = [self.unwrap_model(model) for model in models]
        save_dcp_shards(modules, optimizers, directory)

    def load_shards(
        self, models: list[Any], optimizers: list[Any], source: Path, *, strict: bool = True
    ) -> None:
        """Restore what :meth:`save_shards` wrote, resharded to this run (every rank)."""
        modules = [self.unwrap_model(model) for model in models]
        load_dcp_shards(modules, optimizers, source, strict=strict)

    def free_memory(self) -> None:
        """Forget the prepared models this strategy holds (``Accelerator.free_memory``)."""

    def after_optimizer_step(self, optimizer: Any) -> None:
        """Hook run after every real optimizer step (XLA cuts its lazy graph here)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.state.world_size})"


__all__ = ["PrepareContext", "Prepared", "SingleProcess"]
