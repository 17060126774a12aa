"""The ``Accelerator`` facade: one training loop for CPU, one GPU or many processes.

It holds the process state, the strategy, the precision, the accumulation state and the
prepared objects, and delegates: model wrapping, gradient sync, clipping and state dicts to
the strategy (:mod:`nbaccel.runtime.strategy`), optimizers and schedulers to
:mod:`nbaccel.runtime.training.wrappers`, sharding to :mod:`nbaccel.runtime.loading.data`, collectives to
:mod:`nbaccel.runtime.collectives.ops`, checkpoints to :mod:`nbaccel.runtime.saving.checkpointing` and
:mod:`nbaccel.runtime.saving.model_io`, trackers to :mod:`nbaccel.tracking`.

Example:
    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> accelerator = Accelerator()
    >>> model = torch.nn.Linear(3, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> loader = DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), batch_size=4)
    >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    >>> for x, y in loader:
    ...     optimizer.zero_grad()
    ...     loss = torch.nn.functional.mse_loss(model(x), y)
    ...     accelerator.backward(loss)
    ...     optimizer.step()
    >>> accelerator.step
    2
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import itertools
import os
from collections.abc import Sequence
from typing import Any

import torch

from ...checkpoint.store import check as check_store
from ...config import launch_config, normalize_precision
from ...errors import ConfigError
from ...tracking import steps as step_clock
from ..accelerate_utils.compat import empty_cuda_caches
from ..collectives.triggers import Trigger
from ..compute import dynamo
from ..compute.precision import autocast_context, make_precision
from ..loading import join
from ..loading.data import PreparedDataLoader, prepare_data_loader, skip_first_batches
from ..parallel.api import ParallelAPI, resolve_parallelism
from ..process.rng import set_seed, validate_rng_types
from ..process.state import DistributedType, ProcessState, get_state
from ..saving.hooks import HookRegistry
from ..strategy import (
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    PrepareContext,
    Strategy,
    check_deepspeed_argument,
    check_fsdp_arguments,
    select_strategy,
)
from ..training.accumulation import GradientState, accumulate, clip_grad_norm, clip_grad_value
from ..training.wrappers import PreparedOptimizer, PreparedScheduler, prepare_model
from ._accelerate_attrs import AccelerateAttributes
from ._checkpoint_api import CheckpointAPI
from ._collective_api import CollectiveAPI
from ._tracking_api import TrackingAPI
from .options import (
    AORecipeKwargs,
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProjectConfiguration,
    check_unexpected_keywords,
    parse_kwargs_handlers,
    resolve_dataloader_config,
)
from .partial_state import AcceleratorState

_SERIALS = itertools.count()


def _accumulation_plugin(
    plugin: GradientAccumulationPlugin | None, steps: int | None
) -> GradientAccumulationPlugin | None:
    if plugin is None:
        return None
    if not isinstance(plugin, GradientAccumulationPlugin):
        raise TypeError(
            f"gradient_accumulation_plugin={plugin!r}: pass a GradientAccumulationPlugin(...)."
        )
    if steps is not None and steps != plugin.num_steps:
        raise ConfigError(
            f"gradient_accumulation_steps={steps!r} conflicts with gradient_accumulation_plugin"
            f"(num_steps={plugin.num_steps}); set the number of steps in one place only."
        )
    return plugin


def _launch_defaults(mixed_precision: Any, steps: Any) -> tuple[str, int]:
    """Fill unset precision / accumulation steps from ``NBACCEL_*`` env and the config file."""
    if mixed_precision is not None and steps is not None:
        return normalize_precision(mixed_precision), steps
    # the launcher's typed configuration in a launched worker, else environment and file
    cfg = launch_config({"mixed_precision": mixed_precision, "gradient_accumulation_steps": steps})
    return cfg.mixed_precision, cfg.gradient_accumulation_steps


class Accelerator(AccelerateAttributes, TrackingAPI, CollectiveAPI, CheckpointAPI, ParallelAPI):
    """Prepare a model, optimizer, dataloaders and scheduler for whatever hardware runs this.

    Args:
        device_placement: move models and batches to :attr:`device`.
        split_batches: a loader's batch size is the global one, sliced across processes.
        mixed_precision: "no", "fp16", "bf16" or "fp8"; ``None`` reads
            ``NBACCEL_MIXED_PRECISION`` / the config file, else "no".
        gradient_accumulation_steps: micro-steps per update (>= 1); ``None`` reads
            ``NBACCEL_GRADIENT_ACCUMULATION_STEPS`` / the config file, else 1.
        cpu: run on the CPU even if a GPU is visible.
        rng_types: RNGs kept in step across processes: "generator" (default: samplers
            with a ``generator`` shuffle identically, seeded per epoch) plus any of
            "torch", "cuda", "python", "numpy" (rank 0's state is copied at every
            dataloader iteration; add "torch" for custom samplers using the global RNG).
        log_with: tracker name(s) or ``GeneralTracker`` instances (see :meth:`init_trackers`).
        project_dir: where checkpoints and tracker logs go.
        project_config: a ``ProjectConfiguration`` (``project_dir`` overrides its directory).
        even_batches: wrap around so every process gets the same number of batches.
        step_scheduler_with_optimizer: step prepared schedulers only with real optimizer steps.
        kwargs_handlers: ``DistributedDataParallelKwargs``, ``GradScalerKwargs``,
            ``AutocastKwargs``, ``InitProcessGroupKwargs``, ``ProfileKwargs``,
            ``AORecipeKwargs`` (one of each at most).
        dataloader_config: a ``DataLoaderConfiguration`` (alternative to split/even/dispatch).
        dispatch_batches: rank 0 reads every global batch and sends each rank its slice.
        gradient_accumulation_plugin: a ``GradientAccumulationPlugin`` (instead of
            ``gradient_accumulation_steps``).
        dynamo_backend: ``torch.compile`` backend applied to prepared models ("no": none).
        dynamo_plugin: a ``TorchDynamoPlugin`` (backend, mode, fullgraph, dynamic, options).
        fsdp_plugin: a ``FullyShardedDataParallelPlugin``: shard models with FSDP2 (``None``
            reads ``strategy="fsdp"`` from the launch configuration when several processes run).
        deepspeed_plugin: a ``DeepSpeedPlugin``: train with DeepSpeed's ZeRO engine (needs
            the ``deepspeed`` package; ``None`` reads ``strategy="deepspeed"`` from the launch
            configuration).
        parallelism_config: a ``ParallelismConfig``: HSDP, tensor parallel and their
            ``DeviceMesh`` (:mod:`nbaccel.runtime.parallel`).

    Raises:
        TypeError: an unknown keyword (the message lists the valid ones).
        ConfigError: an invalid value, or a setting that conflicts with the running group.
        LaunchError: the process group could not be formed.
    """

    def __init__(
        self,
        *,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool = False,
        rng_types: list[str] | None = None,
        log_with: Any = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: ProjectConfiguration | None = None,
        even_batches: bool | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[KwargsHandler] | None = None,
        dataloader_config: DataLoaderConfiguration | None = None,
        dispatch_batches: bool | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        dynamo_backend: Any = None,
        dynamo_plugin: dynamo.TorchDynamoPlugin | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        deepspeed_plugin: DeepSpeedPlugin | None = None,
        parallelism_config: Any = None,
        **unexpected: Any,
    ) -> None:
        fsdp_plugin = check_fsdp_arguments(fsdp_plugin, unexpected)
        deepspeed_plugin = check_deepspeed_argument(deepspeed_plugin, fsdp_plugin)
        if unexpected:  # inspect.signature costs ~1 ms: only when there is something to report
            valid = [p for p in inspect.signature(Accelerator).parameters if p != "unexpected"]
            check_unexpected_keywords("Accelerator", unexpected, valid)
        handlers = self._handlers = parse_kwargs_handlers(kwargs_handlers)
        self.dataloader_config = resolve_dataloader_config(
            dataloader_config, split_batches, even_batches, dispatch_batches
        )
        steps = gradient_accumulation_steps
        plugin = _accumulation_plugin(gradient_accumulation_plugin, steps)
        if plugin is not None:
            steps = plugin.num_steps
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
        ):
            raise ConfigError(
                f"gradient_accumulation_steps={steps!r} must be an int >= 1 "
                "(1 = update after every batch)."
            )
        mixed_precision, steps = _launch_defaults(mixed_precision, steps)
        self.rng_types = validate_rng_types(rng_types)
        self.dynamo_plugin = dynamo.resolve_plugin(dynamo_backend, dynamo_plugin)
        self.dynamo_backend = self.dynamo_plugin.backend
        init = handlers.get(InitProcessGroupKwargs)
        process = get_state(cpu=cpu, init_kwargs=init.to_kwargs() if init else None)
        self._parallelism = resolve_parallelism(
            parallelism_config, process, fsdp_plugin=fsdp_plugin, deepspeed_plugin=deepspeed_plugin
        )
        self.strategy: Strategy = select_strategy(
            process,
            fsdp_plugin,
            deepspeed_plugin,
            mixed_precision=mixed_precision,
            parallelism=self._parallelism,
        )
        self._process: ProcessState = self.strategy.state  # DistributedType.FSDP under FSDP
        # DeepSpeed's engine casts and scales itself: nbaccel's precision then runs "no"
        mixed_precision, own_precision = self.strategy.precision_modes(mixed_precision)
        scaler, autocast = handlers.get(GradScalerKwargs), handlers.get(AutocastKwargs)
        self.precision = make_precision(  # unsupported modes raise ConfigError here
            own_precision,
            self.device,
            scaler_kwargs=scaler.to_kwargs() if scaler else None,
            autocast_kwargs=autocast.to_kwargs() if autocast else None,
            fp8_recipe=handlers.get(AORecipeKwargs),
        )
        self.mixed_precision: str = mixed_precision
        self.state = AcceleratorState.for_accelerator(self._process, mixed_precision)
        self.state.deepspeed_plugin = self.strategy.deepspeed_plugin
        ddp = handlers.get(DistributedDataParallelKwargs)
        self.ddp_kwargs: dict[str, Any] = ddp.to_kwargs() if ddp else {}
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:  # overrides the config's directory (and its default logs)
            config, previous = self.project_configuration, self.project_configuration.project_dir
            config.project_dir = project_dir
            if config.logging_dir in (None, previous):
                config.logging_dir = project_dir
        # an object-store project_dir whose package is missing fails here, on every rank,
        # before training starts (not at the first save)
        check_store(self.project_configuration.project_dir or "")
        self.log_with = log_with
        self.trackers: list[Any] = []
        self.gradient_accumulation_plugin = plugin or GradientAccumulationPlugin(num_steps=steps)
        self.gradient_state = self._new_gradient_state()
        self._hooks = HookRegistry()
        self._trigger = Trigger()
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[PreparedOptimizer] = []
        self._schedulers: list[PreparedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        self._custom_objects: list[Any] = []
        self._serial = next(_SERIALS)  # the same on every rank: names this one's checkpoints
        self._ready = True  # from now on assignments follow AccelerateAttributes' policy
        # parameters the precision replaced in models (fp8), so optimizers can follow them
        self._replaced_params: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}

    # -- process facts -------------------------------------------------------------------

    split_batches = property(lambda self: self.dataloader_config.split_batches)
    dispatch_batches = property(lambda self: bool(self.dataloader_config.dispatch_batches))
    project_dir = property(lambda self: self.project_configuration.project_dir)
    logging_dir = property(lambda self: self.project_configuration.logging_dir)
    sync_gradients = property(lambda self: self.gradient_state.sync_gradients)
    distributed_type = property(lambda self: self.state.distributed_type)

    def _new_gradient_state(self) -> GradientState:
        plugin = self.gradient_accumulation_plugin
        return GradientState(
            plugin.num_steps,
            sync_with_dataloader=plugin.sync_with_dataloader,
            sync_each_batch=plugin.sync_each_batch,
            adjust_scheduler=plugin.adjust_scheduler,
        )

    @property
    def step(self) -> int:
        """Optimizer updates done so far (restored by :meth:`load_state`)."""
        return self.gradient_state.updates

    @step.setter
    def step(self, value: int) -> None:
        self.gradient_state.updates = int(value)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True if the last optimizer step was skipped (fp16 overflow): don't step the LR."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    def __repr__(self) -> str:
        s = self._process
        return (
            f"Accelerator(distributed_type={s.distributed_type.value}, num_processes="
            f"{s.world_size}, process_index={s.rank}, device={s.device}, "
            f"mixed_precision={self.mixed_precision!r})"
        )

    # -- prepare --------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare models, optimizers, schedulers and dataloaders; returns them in order.

        Models are handled first, then optimizers, schedulers and loaders, whatever the
        argument order. Objects prepared before, and objects of any other kind (None,
        numbers, custom objects), are returned unchanged.
        """
        if device_placement is not None and len(device_placement) != len(args):
            raise ValueError(
                f"device_placement has {len(device_placement)} entries for {len(args)} objects."
            )
        placement = device_placement or [self.device_placement] * len(args)
        ctx = PrepareContext(
            placement=placement,
            prepare_one={  # in this order: optimizers follow their models' parameters
                "model": self.prepare_model,
                "optimizer": self.prepare_optimizer,
                "scheduler": lambda obj, _placement: self.prepare_scheduler(obj),
                "dataloader": self.prepare_data_loader,
            },
            gradient_state=self.gradient_state,
            num_processes=self.num_processes,
            split_batches=self.split_batches,
            step_scheduler_with_optimizer=self.step_scheduler_with_optimizer,
        )
        done = self.strategy.prepare(args, ctx)  # DeepSpeed: one engine of all three
        self._models.extend(done.models)
        self._optimizers.extend(done.optimizers)
        self._schedulers.extend(done.schedulers)
        result = done.objects
        return result[0] if len(result) == 1 else tuple(result)

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> Any:
        """Prepare one model (see :meth:`prepare`); ``evaluation_mode``: for inference only,
        placed and under autocast but not wrapped for distributed training."""
        for prepared in self._models:
            if model is prepared or model is self.strategy.unwrap_model(prepared):
                return prepared
        placement = self.device_placement if device_placement is None else device_placement
        prepared, replaced = prepare_model(
            model,
            strategy=self.strategy,
            precision=self.precision,
            device_placement=placement,
            ddp_kwargs=self.ddp_kwargs,
            autocast=self.native_amp,
            wrap=not evaluation_mode,
        )
        self._replaced_params.update(replaced)
        prepared = dynamo.compile_model(prepared, self.dynamo_plugin)
        check = getattr(self.precision, "check_compiled", None)  # fp8: eager is slower
        if check is not None and not evaluation_mode:
            check(self.dynamo_plugin.backend != "no" or dynamo.is_compiled(model))
        self._models.append(prepared)
        return prepared

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> PreparedOptimizer:
        """Prepare one optimizer (see :meth:`prepare`)."""
        if isinstance(optimizer, PreparedOptimizer):
            return optimizer
        prepared = PreparedOptimizer(
            optimizer,
            precision=self.precision,
            gradient_state=self.gradient_state,
            counts_updates=not self._optimizers,
            device_placement=self.device_placement
            if device_placement is None
            else device_placement,
            replaced=self._replaced_params,
            after_step=self.strategy.after_optimizer_step,
        )
        self._optimizers.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        """Prepare one LR scheduler (see :meth:`prepare`)."""
        if isinstance(scheduler, PreparedScheduler):
            return scheduler
        target = getattr(scheduler, "optimizer", None)
        optimizers = [o for o in self._optimizers if target is o or target is o.optimizer]
        prepared = PreparedScheduler(
            scheduler,
            optimizers,
            gradient_state=self.gradient_state,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
            num_processes=self.num_processes,
        )
        self._schedulers.append(prepared)
        return prepared

    def prepare_data_loader(self, data_loader: Any, device_placement: bool | None = None) -> Any:
        """Prepare one DataLoader (see :meth:`prepare`); a collective when distributed."""
        dataloader = data_loader
        if isinstance(dataloader, PreparedDataLoader):
            return dataloader
        placement = self.device_placement if device_placement is None else device_placement
        dispatch = self.dataloader_config.dispatch_batches
        if dispatch is None:  # Accelerate's default: iterable datasets are read by rank 0
            dispatch = placement and isinstance(
                dataloader.dataset, torch.utils.data.IterableDataset
            )
        num_processes, process_index = self._data_parallel()  # TP ranks: the same batches
        prepared = prepare_data_loader(
            dataloader,
            num_processes=num_processes,
            process_index=process_index,
            split_batches=self.split_batches,
            even_batches=self.even_batches,
            device=self.device if placement else None,
            non_blocking=self.dataloader_config.non_blocking,
            gradient_state=self.gradient_state,
            rng_types=self.rng_types,
            dispatch_batches=bool(dispatch),
            data_seed=self.dataloader_config.data_seed,
            use_stateful_dataloader=self.dataloader_config.use_stateful_dataloader,
            use_seedable_sampler=self.dataloader_config.use_seedable_sampler,
        )
        self._dataloaders.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """A loader whose next iteration skips ``num_batches`` (to resume mid-epoch)."""
        return skip_first_batches(dataloader, num_batches)

    # -- training step ---------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` scaled for accumulation and (fp16) loss scaling."""
        step_clock.backward_started()  # the live monitor's step timing (no-op outside a launch)
        self.strategy.backward(
            loss,
            precision=self.precision,
            num_steps=self.gradient_state.num_steps,
            sync_gradients=self.gradient_state.sync_gradients,
            **kwargs,
        )
        step_clock.backward_finished()

    def accumulate(self, *models: Any) -> contextlib.AbstractContextManager[None]:
        """Context for one micro-step of gradient accumulation (all prepared models if none)."""
        models = models or tuple(self._models)
        return accumulate(self.gradient_state, models, self.strategy.no_sync)

    def no_sync(self, model: Any) -> contextlib.AbstractContextManager[None]:
        """Skip the gradient all-reduce inside the block (no-op for a single process)."""
        return self.strategy.no_sync(model)

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Any:
        """The mixed-precision autocast context (prepared models already run under it);
        ``autocast_handler`` overrides the ``AutocastKwargs`` inside the block."""
        if not self.native_amp:
            return contextlib.nullcontext()
        return autocast_context(self.precision, autocast_handler)

    def _unscale_for(self, parameters: list[torch.Tensor]) -> None:
        wanted = {id(p) for p in parameters}
        for opt in self._optimizers:
            if any(id(p) in wanted for g in opt.param_groups for p in g["params"]):
                self.precision.unscale_(opt.optimizer)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide fp16-scaled gradients by the loss scale (no-op otherwise)."""
        for opt in [optimizer] if optimizer is not None else self._optimizers:
            self.precision.unscale_(getattr(opt, "optimizer", opt))

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        """Unscale, clip the total norm, return the norm before clipping (sync steps only)."""
        return clip_grad_norm(
            parameters,
            max_norm,
            norm_type,
            state=self.gradient_state,
            unscale=self._unscale_for,
            clip=self.strategy.clip_grad_norm_,
        )

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Unscale, then clamp every gradient to ``[-clip_value, clip_value]`` (sync steps)."""
        clip_grad_value(
            parameters, clip_value, state=self.gradient_state, unscale=self._unscale_for
        )

    def tqdm(self, *args: Any, **kwargs: Any) -> Any:
        """A progress bar drawn by the main process only (see :func:`nbaccel.tracking.progress.tqdm`)."""
        from ...tracking.progress import tqdm

        return tqdm(*args, **kwargs)

    # -- uneven inputs and cross-rank signals ---------------------------------------------

    def join_uneven_inputs(
        self, joinables: Sequence[Any], even_batches: bool | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Context for ranks with different numbers of batches (DDP ``Join``); ``even_batches``
        overrides the prepared loaders' setting inside the block."""
        return join.join_uneven_inputs(
            joinables,
            loaders=self._dataloaders,
            even_batches=even_batches,
            distributed_type=self.distributed_type,
        )

    def trigger_sync_in_backward(self, model: Any) -> contextlib.AbstractContextManager[None]:
        """Make the next backward all-reduce gradients after forwards under :meth:`no_sync`."""
        return join.trigger_sync_in_backward(model)

    def set_trigger(self) -> None:
        """Raise this rank's flag; :meth:`check_trigger` then returns True on every rank."""
        self._trigger.set()

    def check_trigger(self) -> bool:
        """True on every rank if any rank called :meth:`set_trigger` (resets it); collective."""
        return self._trigger.check()

    # -- models and memory -----------------------------------------------------------------

    def unwrap_model(
        self,
        model: torch.nn.Module,
        keep_fp32_wrapper: bool = True,
        keep_torch_compile: bool = True,
    ) -> Any:
        """The user's module inside DDP (and ``torch.compile`` unless ``keep_torch_compile``)."""

        def inner(m: Any) -> Any:
            return self.strategy.unwrap_model(m, keep_fp32_wrapper=keep_fp32_wrapper)

        return dynamo.unwrap(model, inner, keep_torch_compile)

    def set_seed(self, seed: int, device_specific: bool = False) -> None:
        """Seed python, numpy and torch (plus the process index if ``device_specific``)."""
        set_seed(seed, device_specific=device_specific)

    def free_memory(self, *objects: Any) -> list[None]:
        """Drop every prepared object this Accelerator holds, collect garbage, empty caches."""
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self.strategy.free_memory()
        self.gradient_state = self._new_gradient_state()
        forget = getattr(self.precision, "forget_optimizers", None)
        if callable(forget):  # fp16 no longer waits for the released optimizers to step
            forget()
        gc.collect()
        empty_cuda_caches()  # cuBLAS's workspaces too: empty_cache() leaves them
        return [None] * len(objects)

    clear = free_memory


__all__ = ["Accelerator", "AcceleratorState", "DistributedType"]
