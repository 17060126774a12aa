"""What ``Accelerator.prepare`` turns models, optimizers and schedulers into.

* models: moved to the device, given to the precision (fp8 swaps layers), wrapped in
  ``DistributedDataParallel`` when several processes train, and (mixed precision)
  their forward runs under autocast with floating outputs returned in float32;
* optimizers: :class:`PreparedOptimizer`, which steps through the precision (fp16
  may skip a step) and only on gradient-synchronising micro-steps;
* schedulers: :class:`PreparedScheduler`, which steps with its optimizers.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 2)
    >>> unwrap_model(model) is model
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ...tracking import steps
from ..collectives.tree import recursively_apply
from .accumulation import GradientState

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _LOW_PRECISION else t


def convert_to_fp32(tensor: Any) -> Any:
    """float16/bfloat16 tensors in ``tensor`` (a tree) become float32 (others are untouched)."""
    data = tensor
    if type(data) is torch.Tensor:  # the usual model output: no tree walk
        return _to_fp32(data)
    return recursively_apply(_to_fp32, data)


class AutocastForward:
    """A model's ``forward`` run under the precision's autocast, outputs back in float32."""

    def __init__(self, forward: Callable[..., Any], precision: Any) -> None:
        functools.update_wrapper(self, forward)
        self.__wrapped__ = forward
        self.precision = precision

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision.autocast():
            outputs = self.__wrapped__(*args, **kwargs)
        return convert_to_fp32(outputs)


def unwrap_model(model: torch.nn.Module, keep_fp32_wrapper: bool = True) -> torch.nn.Module:
    """The user's module inside ``DistributedDataParallel``/``DataParallel``/``torch.compile``.

    With ``keep_fp32_wrapper=False`` nbaccel's autocast forward wrapper is removed from
    the returned module too (in a single process that module *is* the prepared model,
    which then trains without autocast).
    """
    while True:
        if isinstance(model, DistributedDataParallel | torch.nn.DataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            break
    if not keep_fp32_wrapper:
        forward = model.__dict__.get("forward")
        while isinstance(forward, AutocastForward):
            forward = forward.__wrapped__
        if "forward" in model.__dict__:
            if getattr(forward, "__self__", None) is model:  # the class's own bound forward
                del model.__dict__["forward"]
            else:
                model.__dict__["forward"] = forward
    return model


def _move_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Move optimizer state tensors onto their parameter's device (``step`` counters stay)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            for key, value in state.items():
                if key != "step" and torch.is_tensor(value) and value.device != param.device:
                    state[key] = value.to(param.device)


def prepare_model(
    model: torch.nn.Module,
    *,
    strategy: Any,
    precision: Any,
    device_placement: bool = True,
    ddp_kwargs: Mapping[str, Any] | None = None,
    autocast: bool = True,
    wrap: bool = True,
) -> tuple[torch.nn.Module, dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]]]:
    """Place, convert and wrap ``model`` (the wrapping is the ``strategy``'s; none with
    ``wrap=False``); forward under the precision's autocast unless ``autocast=False``; also
    return ``{id(old): (old, new)}`` for the parameters the precision replaced (so
    optimizers can be pointed at the new ones)."""
    before = dict(model.named_parameters())
    if device_placement:
        model = strategy.place_model(model)
    hook = getattr(precision, "prepare_model", None)
    if callable(hook):
        model = hook(model)
    if wrap:
        model = strategy.wrap_model(model, ddp_kwargs=ddp_kwargs)
    # fp8 swaps layers and FSDP shards parameters: both replace Parameter objects
    after = dict(strategy.unwrap_model(model).named_parameters())
    replaced = {
        id(old): (old, after[name])
        for name, old in before.items()
        if name in after and after[name] is not old
    }
    if autocast and getattr(precision, "mode", "no") != "no":
        # on the outermost module: DDP keeps its class name, the user's module stays clean
        model.forward = AutocastForward(model.forward, precision)
    return model, replaced


class PreparedOptimizer(torch.optim.Optimizer):
    """An optimizer that steps through the precision and only on synchronising micro-steps.

    Attribute access (``param_groups``, ``state``, ``defaults``) goes to the wrapped
    ``optimizer``; ``step_was_skipped`` tells whether the last real step was skipped
    (fp16 overflow).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        precision: Any,
        gradient_state: GradientState,
        counts_updates: bool = True,
        device_placement: bool = True,
        replaced: Mapping[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] | None = None,
        after_step: Callable[[Any], None] | None = None,
    ) -> None:
        # torch.optim.Optimizer.__init__ is skipped on purpose: all state lives in `optimizer`
        self.optimizer = optimizer
        self.precision = precision
        self.gradient_state = gradient_state
        self.counts_updates = counts_updates
        self.step_was_skipped = False
        self.after_step = after_step
        if replaced:
            for group in optimizer.param_groups:
                group["params"] = [
                    replaced[id(p)][1] if id(p) in replaced else p for p in group["params"]
                ]
        if device_placement:
            _move_optimizer_state(optimizer)
        register = getattr(precision, "add_optimizer", None)
        if callable(register):  # fp16 updates its loss scale once all optimizers stepped
            register(optimizer)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if not self.gradient_state.sync_gradients:
            return  # accumulating: keep the gradients of the earlier micro-steps
        if set_to_none is None:
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if not self.gradient_state.sync_gradients:
            return
        if closure is not None:  # e.g. LBFGS; loss scaling cannot re-run a closure
            if getattr(self.precision, "scaler", None) is not None:
                raise ValueError(
                    "optimizer.step(closure) cannot be combined with mixed_precision='fp16' "
                    "(the loss scaler needs the gradients first): use bf16 or fp32."
                )
            self.optimizer.step(closure)
            taken = True
        else:
            taken = bool(self.precision.step(self.optimizer))
        if self.after_step is not None:
            self.after_step(self.optimizer)  # the strategy's hook (XLA cuts its graph)
        self.step_was_skipped = not taken
        if taken and self.counts_updates:
            self.gradient_state.updates += 1
            steps.optimizer_stepped(self.gradient_state.updates)  # the live monitor's timing

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def train(self) -> None:  # schedule-free optimizers
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """A learning-rate scheduler that steps with its optimizers.

    It does nothing on accumulation micro-steps and after a skipped (fp16 overflow)
    optimizer step; otherwise it advances ``num_processes`` times per call (unless
    ``split_batches``), because each rank sees ``1/num_processes`` of the batches the
    schedule was written for.
    """

    def __init__(
        self,
        scheduler: Any,
        optimizers: Sequence[PreparedOptimizer],
        *,
        gradient_state: GradientState,
        step_with_optimizer: bool = True,
        split_batches: bool = False,
        num_processes: int = 1,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = list(optimizers)
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches
        self.num_processes = num_processes

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        plateau = isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        repeats = 1 if self.split_batches or plateau else self.num_processes
        for _ in range(repeats):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR refuses overrun
            if total is not None and self.scheduler._step_count > total:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)


def object_kind(
    obj: Any, *, optimizers: tuple[type, ...] = (), schedulers: tuple[type, ...] = ()
) -> str:
    """What ``prepare`` sees in ``obj``: ``"model"``, ``"optimizer"``, ``"dataloader"``,
    ``"scheduler"`` or ``"other"`` (passed through unchanged); ``optimizers`` and
    ``schedulers``: more types a strategy counts as such (DeepSpeed's placeholders)."""
    if isinstance(obj, torch.nn.Module):
        return "model"
    if isinstance(obj, (torch.optim.Optimizer, *optimizers)):
        return "optimizer"
    if isinstance(obj, torch.utils.data.DataLoader):
        return "dataloader"
    if isinstance(obj, (PreparedScheduler, *schedulers)) or is_scheduler(obj):
        return "scheduler"
    return "other"


def is_scheduler(obj: Any) -> bool:
    """True for torch LR schedulers (and look-alikes with ``step`` and ``optimizer``)."""
    lr = torch.optim.lr_scheduler
    base = getattr(lr, "LRScheduler", getattr(lr, "_LRScheduler", object))
    if isinstance(obj, base | lr.ReduceLROnPlateau):
        return True
    return callable(getattr(obj, "step", None)) and isinstance(
        getattr(obj, "optimizer", None), torch.optim.Optimizer
    )


__all__ = [
    "AutocastForward",
    "PreparedOptimizer",
    "PreparedScheduler",
    "convert_to_fp32",
    "is_scheduler",
    "object_kind",
    "prepare_model",
    "unwrap_model",
]
