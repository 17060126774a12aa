"""Attributes of Accelerate's ``Accelerator`` beyond the core API, and what assigning does.

A mixin. Reading: ``native_amp``, ``use_fp16``, ``is_fsdp2``, ``multi_device``,
``use_seedable_sampler``, ``use_stateful_dataloader``, ``non_blocking``,
``save_iteration``, ``torch_device_mesh``, the ``*_handler`` objects, ``profile()``.

Assigning (``Accelerator.__setattr__``), so that no assignment a script makes is
silently without the effect it has under Accelerate:

* Accelerate's settable attributes have its effect: ``gradient_accumulation_steps``
  (the next micro-steps accumulate that many), ``native_amp = False`` (models prepared
  afterwards, and ``accelerator.autocast()``, run without autocast), ``even_batches``,
  ``step``, and the plain settings read when objects are prepared or trackers start
  (``dataloader_config``, ``device_placement``, ``rng_types``,
  ``step_scheduler_with_optimizer``, ``project_configuration``, ``log_with``,
  ``trackers``, ``ddp_kwargs``, ``dynamo_plugin``);
* read-only facts (``mixed_precision``, ``state``, ``device``, ``num_processes``...)
  raise ``AttributeError``, as Accelerate's read-only properties do;
* Accelerate attributes nbaccel has no counterpart for (``scaler``,
  ``deepspeed_engine_wrapped``, ``fp8_recipe_handler``...) raise, naming the way;
* a new name that looks like a typo of a known one (``gradient_acumulation_steps``)
  raises with the suggestion; any other new name is stored, as on any object (a
  script's own bookkeeping).

Example:
    >>> from nbaccel import Accelerator
    >>> accelerator = Accelerator(cpu=True)
    >>> accelerator.gradient_accumulation_steps = 4
    >>> accelerator.gradient_state.num_steps
    4
"""

from __future__ import annotations

import contextlib
import difflib
import warnings
from collections.abc import Iterator
from typing import Any

from ...errors import ConfigError
from ..collectives import ops
from . import profiling
from .options import (
    AORecipeKwargs,
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)

# plain attributes whose new value takes effect (read when preparing, saving, logging)
SETTABLE = frozenset(
    {
        "dataloader_config",
        "device_placement",
        "rng_types",
        "step_scheduler_with_optimizer",
        "project_configuration",
        "log_with",
        "trackers",
        "ddp_kwargs",
        "dynamo_plugin",
        "gradient_state",  # free_memory() starts a new one
    }
)
# Accelerate attributes that nbaccel does not have: what to do instead
NOT_HONOURED = {
    "scaler": "the fp16 GradScaler is built from kwargs_handlers=[GradScalerKwargs(...)]",
    "deepspeed_engine_wrapped": "under DeepSpeed the prepared model is the engine itself "
    "(accelerator.backward runs engine.backward and engine.step)",
    "flag_tensor": "use set_trigger() / check_trigger()",
    "delayed_fp8_autocast": "fp8 runs through torchao (kwargs_handlers=[AORecipeKwargs(...)])",
    "has_lomo_optimizer": "LOMO optimizers are not supported",
}


class AccelerateAttributes:
    """Accelerate's extra attributes, ``profile()``, and the assignment policy."""

    _process: Any
    state: Any
    _handlers: dict[type, Any]
    dataloader_config: Any
    project_configuration: Any
    strategy: Any
    precision: Any
    gradient_state: Any
    gradient_accumulation_plugin: Any
    mixed_precision: str

    # -- reading -------------------------------------------------------------------------

    use_seedable_sampler = property(lambda self: self.dataloader_config.use_seedable_sampler)
    non_blocking = property(lambda self: self.dataloader_config.non_blocking)
    use_stateful_dataloader = property(lambda self: self.dataloader_config.use_stateful_dataloader)
    save_iteration = property(lambda self: self.project_configuration.iteration)
    is_fsdp2 = property(lambda self: self.strategy.name == "fsdp")  # nbaccel's FSDP is FSDP2
    fp8_backend = property(lambda self: "AO" if self.mixed_precision == "fp8" else None)
    ddp_handler = property(lambda self: self._handlers.get(DistributedDataParallelKwargs))
    scaler_handler = property(lambda self: self._handlers.get(GradScalerKwargs))
    init_handler = property(lambda self: self._handlers.get(InitProcessGroupKwargs))
    autocast_handler = property(lambda self: self._handlers.get(AutocastKwargs))
    profile_handler = property(lambda self: self._handlers.get(ProfileKwargs))
    ao_recipe_handler = property(lambda self: self._handlers.get(AORecipeKwargs))
    # Accelerate's handler for TransformerEngine / MS-AMP: nbaccel drives neither
    # (their Kwargs objects raise, naming AORecipeKwargs), so there is never one
    fp8_recipe_handler = property(lambda self: None)
    scaler = property(lambda self: self.precision.scaler)  # the fp16 GradScaler, else None
    should_save_model = property(lambda self: True)  # every strategy can save from any call

    @property
    def multi_device(self) -> bool:
        """True with several processes on accelerator devices (GPUs), as in Accelerate."""
        return self._process.multi_device

    @property
    def use_fp16(self) -> bool:
        """Deprecated in Accelerate: whether mixed precision is on (any mode)."""
        warnings.warn(
            "use_fp16 is deprecated (as in Accelerate): use mixed_precision != 'no'.",
            FutureWarning,
            stacklevel=2,
        )
        return self.mixed_precision != "no"

    @property
    def deepspeed_plugin(self) -> Any:
        """The ``DeepSpeedPlugin`` this Accelerator trains with (``None`` without DeepSpeed)."""
        return self.state.deepspeed_plugin

    @property
    def native_amp(self) -> bool:
        """Whether prepared models (and ``autocast()``) run under autocast."""
        return bool(self.__dict__.get("_native_amp", self.mixed_precision != "no"))

    @native_amp.setter
    def native_amp(self, value: bool) -> None:
        if value and self.mixed_precision == "no":
            raise ConfigError(
                "native_amp=True needs a mixed precision: Accelerator(mixed_precision='bf16' "
                "or 'fp16'); with mixed_precision='no' there is no autocast to enable."
            )
        self.__dict__["_native_amp"] = bool(value)

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer update; settable, as in Accelerate."""
        return int(self.gradient_state.num_steps)

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(
                f"gradient_accumulation_steps={steps!r} must be an int >= 1 "
                "(1 = update after every batch)."
            )
        self.gradient_state.num_steps = steps
        self.gradient_accumulation_plugin.num_steps = steps  # free_memory() keeps it

    @property
    def even_batches(self) -> bool:
        """Whether prepared loaders complete the last round (for loaders prepared later)."""
        return bool(self.dataloader_config.even_batches)

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = bool(value)

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[Any]:
        """Profile the block with ``torch.profiler`` (settings: ``profile_handler``, else
        the ``ProfileKwargs`` in ``kwargs_handlers``); yields the profiler."""
        handler = profile_handler or self._handlers.get(ProfileKwargs)
        with profiling.profile(
            handler, rank=self._process.rank, data_parallel=self._process.data_parallel
        ) as profiler:
            yield profiler
        if handler is not None and handler.output_trace_dir is not None:
            ops.barrier("profile")  # as Accelerate: every rank's trace exists afterwards

    # -- assigning -----------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or not self.__dict__.get("_ready", False):
            object.__setattr__(self, name, value)
            return
        cls = type(self).__name__
        if name in NOT_HONOURED:
            raise AttributeError(
                f"{cls}.{name} cannot be assigned in nbaccel: {NOT_HONOURED[name]}."
            )
        if isinstance(getattr(type(self), name, None), property) or name in SETTABLE:
            object.__setattr__(self, name, value)  # a property raises if read-only
            return
        if name in self.__dict__:
            raise AttributeError(
                f"{cls}.{name} is read-only: it was fixed when the {cls} was created (pass "
                f"the setting to {cls}(...) instead)."
            )
        known = [n for n in (*dir(type(self)), *self.__dict__) if not n.startswith("_")]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        if close:
            raise AttributeError(
                f"{cls} has no attribute {name!r}; did you mean {close[0]!r}? (a new "
                "attribute would change nothing)"
            )
        object.__setattr__(self, name, value)  # the script's own bookkeeping


__all__ = ["NOT_HONOURED", "SETTABLE", "AccelerateAttributes"]
