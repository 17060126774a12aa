"""Local SGD: ranks train on their own for a few steps, then average their parameters.

``LocalSGD(accelerator=, model=, local_sgd_steps=)`` is a context manager around the
training loop. Inside it the prepared (DDP) model skips the gradient all-reduce; every
``local_sgd_steps`` calls of :meth:`LocalSGD.step` (after ``optimizer.step()``) the
parameters are averaged over the processes with one all-reduce, and once more when the
block ends. One process, or ``enabled=False``: nothing changes. Communication drops by
a factor of ``local_sgd_steps`` (plus one parameter average instead of a gradient one).

Example:
    >>> import torch
    >>> from nbaccel import Accelerator
    >>> accelerator = Accelerator(cpu=True)
    >>> model = accelerator.prepare(torch.nn.Linear(2, 1))
    >>> with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=4) as local_sgd:
    ...     local_sgd.step()
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from ...errors import ConfigError
from ...platform.process_env import distributed_active


class LocalSGD:
    """Average the model's parameters every ``local_sgd_steps`` steps instead of every step.

    Args:
        accelerator: the ``Accelerator`` that prepared ``model``.
        model: the prepared model.
        local_sgd_steps: optimizer steps between two parameter averages (>= 1).
        enabled: False turns it into a no-op (e.g. to compare).

    Raises:
        ConfigError: ``local_sgd_steps`` < 1, or a strategy whose parameters are sharded
            (FSDP): averaging needs every rank to hold the whole model.
    """

    def __init__(
        self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True
    ) -> None:
        if isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int):
            raise ConfigError(f"local_sgd_steps={local_sgd_steps!r} must be an int >= 1.")
        if local_sgd_steps < 1:
            raise ConfigError(f"local_sgd_steps={local_sgd_steps!r} must be an int >= 1.")
        if accelerator.strategy.collective_state:
            raise ConfigError(
                "LocalSGD averages whole models, but under FSDP every rank holds a shard: use "
                "the default DDP strategy (no fsdp_plugin / strategy='fsdp') with LocalSGD."
            )
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self.enabled = bool(enabled) and distributed_active()
        self.num_steps = 0
        self._no_sync: contextlib.AbstractContextManager[Any] | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._no_sync is None:
            return
        try:
            if exc_type is None:
                self._average()  # every rank leaves with the same model
        finally:
            self._no_sync.__exit__(exc_type, exc, tb)
            self._no_sync = None

    def step(self) -> None:
        """Count one optimizer step; average the parameters every ``local_sgd_steps``."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    @torch.no_grad()
    def _average(self) -> None:
        params = [p for p in self.accelerator.unwrap_model(self.model).parameters()]
        if not params:
            return
        flat = torch.cat([p.detach().reshape(-1).float() for p in params])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p).to(p.dtype))
            offset += n


__all__ = ["LocalSGD"]
