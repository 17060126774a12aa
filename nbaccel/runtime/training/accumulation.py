"""Gradient accumulation: when gradients are synchronised and optimizers really step.

One :class:`GradientState` per ``Accelerator``. ``accumulate(*models)`` counts
micro-steps; on all but every ``num_steps``-th one (and the last batch of the
active prepared dataloader) it enters DDP's ``no_sync`` so gradients pile up
locally, and the prepared optimizers/schedulers turn ``step()``/``zero_grad()``
into no-ops.

Example:
    >>> state = GradientState(num_steps=2)
    >>> flags = []
    >>> for _ in range(4):
    ...     with accumulate(state, []):
    ...         flags.append(state.sync_gradients)
    >>> flags
    [False, True, False, True]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch


class GradientState:
    """Accumulation bookkeeping shared by an Accelerator, its optimizers, schedulers, loaders.

    Attributes:
        num_steps: micro-steps per optimizer update.
        sync_gradients: True when the current micro-step completes an update.
        updates: optimizer updates done so far (``Accelerator.step``).
    """

    def __init__(
        self,
        num_steps: int = 1,
        *,
        sync_with_dataloader: bool = True,
        sync_each_batch: bool = False,
        adjust_scheduler: bool = True,
    ) -> None:
        self.num_steps = num_steps
        self.sync_with_dataloader = sync_with_dataloader  # the last batch always updates
        self.sync_each_batch = sync_each_batch  # all-reduce on every micro-step
        self.adjust_scheduler = adjust_scheduler
        self.sync_gradients = True
        self.updates = 0
        self._micro_step = 0
        self._loaders: list[Any] = []  # active prepared dataloaders, innermost last

    # -- the active dataloader (registered by PreparedDataLoader while it iterates) --------

    def enter(self, loader: Any) -> None:
        self._loaders.append(loader)

    def exit(self, loader: Any) -> None:
        for i in range(len(self._loaders) - 1, -1, -1):
            if self._loaders[i] is loader:
                del self._loaders[i]
                break

    @property
    def in_dataloader(self) -> bool:
        """True while a prepared dataloader is being iterated."""
        return bool(self._loaders)

    @property
    def dataloader_references(self) -> list[Any]:
        """The prepared dataloaders being iterated, outermost first."""
        return list(self._loaders)

    initialized = True  # Accelerate's GradientState is a lazily filled singleton

    @property
    def active_dataloader(self) -> Any:
        return self._loaders[-1] if self._loaders else None

    @property
    def end_of_dataloader(self) -> bool:
        """True while the active prepared dataloader is yielding its last batch."""
        loader = self.active_dataloader
        return bool(loader is not None and loader.end_of_dataloader)

    @property
    def remainder(self) -> int:
        """Real samples in the active loader's final round, or -1 (nothing duplicated)."""
        loader = self.active_dataloader
        return -1 if loader is None else int(loader.remainder)

    # -- micro-steps ----------------------------------------------------------------------

    def begin_micro_step(self) -> None:
        """Decide whether this micro-step synchronises (the last batch always does)."""
        loaders = self._loaders  # inlined end_of_dataloader: this runs on every step
        if self.sync_with_dataloader and loaders and loaders[-1].end_of_dataloader:
            self._micro_step = 0
            self.sync_gradients = True
            return
        self._micro_step += 1
        self.sync_gradients = self._micro_step % self.num_steps == 0

    def reset(self) -> None:
        self._micro_step = 0
        self.sync_gradients = True


class _MicroStep:
    """The context :func:`accumulate` returns.

    A plain class rather than a ``@contextmanager`` generator with an ``ExitStack``:
    it runs on every training step, and on synchronising steps (all of them without
    accumulation) it does nothing but count.
    """

    __slots__ = ("models", "no_sync", "stack", "state")

    def __init__(
        self,
        state: GradientState,
        models: Sequence[Any],
        no_sync: Callable[[Any], contextlib.AbstractContextManager[Any]] | None,
    ) -> None:
        self.state, self.models, self.no_sync = state, models, no_sync
        self.stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        state = self.state
        state.begin_micro_step()
        skip_sync = not state.sync_gradients and not state.sync_each_batch
        if skip_sync and self.no_sync is not None and self.models:
            stack = contextlib.ExitStack()
            with stack:  # a failing no_sync leaves the ones already entered
                for model in self.models:
                    stack.enter_context(self.no_sync(model))
                self.stack = stack.pop_all()

    def __exit__(self, *exc: Any) -> bool | None:
        stack, self.stack = self.stack, None
        return None if stack is None else stack.__exit__(*exc)


def accumulate(
    state: GradientState,
    models: Sequence[Any],
    no_sync: Callable[[Any], contextlib.AbstractContextManager[Any]] | None = None,
) -> contextlib.AbstractContextManager[None]:
    """One micro-step: skip the gradient all-reduce unless this step synchronises.

    ``no_sync(model)`` is the strategy's context that suspends synchronisation.
    """
    return _MicroStep(state, models, no_sync)


def _grads(parameters: Any) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [p.grad for p in parameters if p.grad is not None]


def total_norm(parameters: Any, norm_type: float = 2.0) -> torch.Tensor:
    """Norm of all gradients together, without changing them."""
    grads = _grads(parameters)
    if not grads:
        return torch.tensor(0.0)
    norms = [torch.linalg.vector_norm(g.detach(), norm_type) for g in grads]
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)


def _as_list(parameters: Any) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def clip_grad_norm(
    parameters: Any,
    max_norm: float,
    norm_type: float,
    *,
    state: GradientState,
    unscale: Callable[[list[torch.Tensor]], None],
    clip: Callable[[list[torch.Tensor], float, float], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Unscale (fp16) then clip the total norm; returns the norm before clipping.

    ``clip`` is the strategy's clipping (the global norm when parameters are sharded);
    torch's ``clip_grad_norm_`` by default. On accumulation micro-steps the gradients are
    incomplete: nothing is unscaled or clipped, and the current norm is returned.
    """
    params = _as_list(parameters)
    if not state.sync_gradients:
        return total_norm(params, norm_type)
    unscale(params)
    if clip is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    return clip(params, max_norm, norm_type)


def clip_grad_value(
    parameters: Any,
    clip_value: float,
    *,
    state: GradientState,
    unscale: Callable[[list[torch.Tensor]], None],
) -> None:
    """Unscale (fp16) then clamp every gradient to ``[-clip_value, clip_value]`` (sync steps)."""
    params = _as_list(parameters)
    if state.sync_gradients:
        unscale(params)
        torch.nn.utils.clip_grad_value_(params, clip_value)


__all__ = [
    "GradientState",
    "accumulate",
    "clip_grad_norm",
    "clip_grad_value",
    "total_norm",
]
