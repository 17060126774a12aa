"""The strategy interface, and the single-process strategy every other one builds on.

A strategy is how the model takes part in training across processes: it wraps the
model, controls gradient synchronisation, clips gradients (the global norm), and
produces/consumes the model and optimizer state dicts that checkpoints hold. The
``Accelerator`` calls these methods and never branches on the distributed type.

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
from collections.abc import Mapping
from typing import Any

import torch

from ..process.state import ProcessState
from ..training.wrappers import unwrap_model


class SingleProcess:
    """One process, or several that share nothing but collectives: no model wrapper."""

    #: short name shown in errors and reprs
    name = "single"
    #: save_state writes one shard per rank (torch.distributed.checkpoint) instead of full files
    sharded_checkpoints = False
    #: model/optimizer state dicts need every rank (collectives): checkpoint calls must be
    #: made on every rank. False: the state is replicated, any rank can save it alone.
    collective_state = False

    def __init__(self, state: ProcessState) -> None:
        self.state = state

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

    def free_memory(self) -> None:
        """Forget the prepared models this strategy holds (``Accelerator.free_memory``)."""

    def after_optimizer_step(self, optimizer: Any) -> None:
        """Hook run after every real optimizer step (XLA cuts its lazy graph here)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.state.world_size})"


__all__ = ["SingleProcess"]
