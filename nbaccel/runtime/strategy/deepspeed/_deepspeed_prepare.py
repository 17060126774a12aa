"""``Accelerator.prepare`` under DeepSpeed: one engine from model, optimizer and scheduler.

Dataloaders are prepared as always (their batch size fills
``train_micro_batch_size_per_gpu``); the model, the optimizer (a torch optimizer or
:class:`~nbaccel.runtime.strategy.deepspeed.deepspeed_plugin.DummyOptim`) and the scheduler (a torch
scheduler or :class:`~nbaccel.runtime.strategy.deepspeed.deepspeed_plugin.DummyScheduler`) go to
``deepspeed.initialize`` together, as in Accelerate. The prepared model is the engine;
the optimizer's ``step``/``zero_grad`` do nothing (``accelerator.backward`` ran
``engine.step()``) but count updates; a torch scheduler steps with them as usual, a
scheduler of the DeepSpeed config is stepped by the engine.

Example:
    >>> DeepSpeedOptimizer.zero_grad.__doc__.split(":")[0]
    'Nothing to do'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ....errors import ConfigError
from ....tracking import steps
from ...training.wrappers import PreparedOptimizer, PreparedScheduler, object_kind
from ..base import PrepareContext, Prepared
from . import _deepspeed_config as fill
from .deepspeed_plugin import DummyOptim, DummyScheduler


class DeepSpeedOptimizer(PreparedOptimizer):
    """DeepSpeed's optimizer as ``prepare`` returns it: the engine steps it in ``backward``."""

    def __init__(self, optimizer: Any, *, engine: Any, gradient_state: Any, counts: bool) -> None:
        # no precision and no device moves: the engine casts, scales and places itself
        super().__init__(
            optimizer,
            precision=None,
            gradient_state=gradient_state,
            counts_updates=counts,
            device_placement=False,
        )
        self.engine = engine

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Nothing to do: ``engine.step()`` (inside ``accelerator.backward``) zeroed them."""

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Count the update ``accelerator.backward`` made (the engine stepped already)."""
        if not self.gradient_state.sync_gradients:
            return
        self.step_was_skipped = not self.engine.was_step_applied()  # fp16 overflow
        if not self.step_was_skipped and self.counts_updates:
            self.gradient_state.updates += 1
            steps.optimizer_stepped(self.gradient_state.updates)

    def __repr__(self) -> str:
        return f"DeepSpeedOptimizer({type(self.optimizer).__name__})"


class DeepSpeedScheduler(PreparedScheduler):
    """The DeepSpeed config's scheduler: the engine steps it, ``step()`` does nothing."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: ``engine.step()`` stepped it."""


def _kind(obj: Any) -> str:
    return object_kind(obj, optimizers=(DummyOptim,), schedulers=(DummyScheduler,))


def _one(found: list[Any], kind: str) -> Any:
    if len(found) > 1:
        raise ConfigError(
            f"prepare() got {len(found)} {kind}s under DeepSpeed; its engine takes one model, "
            "one optimizer and one scheduler: prepare each further model with its own Accelerator."
        )
    return found[0] if found else None


def _check_pairing(config: dict[str, Any], optimizer: Any, scheduler: Any) -> None:
    if optimizer is not None and ("optimizer" in config) != isinstance(optimizer, DummyOptim):
        raise ConfigError(
            "the DeepSpeed config defines an optimizer, so pass DummyOptim(model.parameters(), "
            "lr=...) to prepare()"
            if "optimizer" in config
            else "DummyOptim stands for the DeepSpeed config's optimizer, and the config has "
            'no "optimizer" section: add one, or pass a torch optimizer.'
        )
    if isinstance(scheduler, DummyScheduler):
        if "scheduler" not in config and scheduler.lr_scheduler_callable is None:
            raise ConfigError(
                'DummyScheduler needs a "scheduler" section in the DeepSpeed config, or '
                "DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: ...)."
            )
    elif scheduler is not None and "scheduler" in config:
        raise ConfigError(
            "the DeepSpeed config defines a scheduler, so pass DummyScheduler(optimizer, ...) "
            "to prepare() instead of a torch scheduler (or remove the config's section)."
        )


def _offload_optimizer(config: dict[str, Any], optimizer: Any) -> Any:
    """ZeRO-Offload steps on the CPU: Adam/AdamW become DeepSpeedCPUAdam unless the config
    says ``"zero_force_ds_cpu_optimizer": false`` (DeepSpeed's rule; CPU Adam compiles once)."""
    device = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device")
    if str(device or "none") == "none" or config.get("zero_force_ds_cpu_optimizer") is False:
        return optimizer
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return optimizer  # DeepSpeed's own error names zero_force_ds_cpu_optimizer
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    defaults = optimizer.defaults
    return DeepSpeedCPUAdam(
        optimizer.param_groups,
        lr=defaults["lr"],
        betas=defaults["betas"],
        eps=defaults["eps"],
        weight_decay=defaults["weight_decay"],
        adamw_mode=type(optimizer) is torch.optim.AdamW,
    )


def prepare_deepspeed(strategy: Any, args: tuple[Any, ...], ctx: PrepareContext) -> Prepared:
    """What ``accelerator.prepare(*args)`` returns under DeepSpeed (see the module
    docstring), and the engine, optimizer and scheduler for the Accelerator to keep."""
    config = strategy.config
    kinds = [_kind(obj) for obj in args]
    result: list[Any] = list(args)
    loaders = [obj for obj, k in zip(args, kinds, strict=True) if k == "dataloader"]
    for i, obj in enumerate(args):
        if kinds[i] == "dataloader":
            result[i] = ctx.prepare_one["dataloader"](obj, ctx.placement[i])
    model = _one([o for o, k in zip(args, kinds, strict=True) if k == "model"], "model")
    optimizer = _one([o for o, k in zip(args, kinds, strict=True) if k == "optimizer"], "optimizer")
    scheduler = _one([o for o, k in zip(args, kinds, strict=True) if k == "scheduler"], "scheduler")
    if model is None:
        if optimizer is not None or scheduler is not None:
            raise ConfigError(
                "under DeepSpeed pass the model, optimizer and scheduler to one prepare() call "
                "(DeepSpeed builds its engine from all three)."
            )
        return Prepared(result)
    _check_pairing(config, optimizer, scheduler)
    if config.get("gradient_accumulation_steps", "auto") == "auto":
        config["gradient_accumulation_steps"] = ctx.gradient_state.num_steps
    else:  # the config's number wins, as in Accelerate (the engine scales the loss by it)
        ctx.gradient_state.num_steps = int(config["gradient_accumulation_steps"])
    fill.fill_batch_sizes(
        config,
        batch_sizes=[getattr(loader, "batch_size", None) for loader in loaders],
        num_processes=ctx.num_processes,
        split_batches=ctx.split_batches,
        train_batch_min=strategy.plugin.is_train_batch_min,
    )
    fill.fill_model_sizes(config, model)
    fill.fill_optimizer_and_scheduler(
        config,
        dummy_optimizer=optimizer if isinstance(optimizer, DummyOptim) else None,
        dummy_scheduler=scheduler if isinstance(scheduler, DummyScheduler) else None,
        num_processes=ctx.num_processes,
        split_batches=ctx.split_batches,
    )
    fill.fill_remaining(config)
    kwargs: dict[str, Any] = {"model": model}
    if isinstance(optimizer, DummyOptim):
        kwargs["model_parameters"] = optimizer.params
        if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
            kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
    elif optimizer is not None:
        config.setdefault("zero_allow_untested_optimizer", True)
        kwargs["optimizer"] = _offload_optimizer(config, optimizer)
        if scheduler is not None and kwargs["optimizer"] is not optimizer:
            scheduler.optimizer = kwargs["optimizer"]  # the schedule follows the new optimizer
    engine, ds_optimizer, ds_scheduler = strategy.initialize(**kwargs)
    done = Prepared(result, models=[engine])
    prepared_optimizer = None
    if ds_optimizer is not None:
        prepared_optimizer = DeepSpeedOptimizer(
            ds_optimizer, engine=engine, gradient_state=ctx.gradient_state, counts=True
        )
        done.optimizers.append(prepared_optimizer)
    prepared_scheduler = None
    if scheduler is not None:
        kind = DeepSpeedScheduler if isinstance(scheduler, DummyScheduler) else PreparedScheduler
        prepared_scheduler = kind(
            ds_scheduler if kind is DeepSpeedScheduler else scheduler,
            [prepared_optimizer] if prepared_optimizer is not None else [],
            gradient_state=ctx.gradient_state,
            step_with_optimizer=ctx.step_scheduler_with_optimizer,
            split_batches=ctx.split_batches,
            num_processes=ctx.num_processes,
        )
        done.schedulers.append(prepared_scheduler)
    by_kind = {"model": engine, "optimizer": prepared_optimizer, "scheduler": prepared_scheduler}
    for i, kind_of in enumerate(kinds):
        if kind_of in by_kind:
            result[i] = by_kind[kind_of]
    return done


__all__ = ["DeepSpeedOptimizer", "DeepSpeedScheduler", "prepare_deepspeed"]
