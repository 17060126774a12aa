"""Small keyword-only option objects accepted by :class:`nbaccel.Accelerator`.

These mirror the names users know from the best-known peer so scripts port by
changing the import. Each validates itself on construction.

Example:
    >>> from nbaccel.runtime.facade.options import DataLoaderConfiguration
    >>> DataLoaderConfiguration(split_batches=True).split_batches
    True
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ...errors import ConfigError
from ..strategy import DDPCommunicationHookType, check_hook_options


class KwargsHandler:
    """Base of the ``kwargs_handlers=[...]`` objects: ``to_kwargs()`` returns non-defaults."""

    def to_kwargs(self) -> dict[str, Any]:
        """Return the fields that differ from their defaults.

        Example:
            >>> DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs()
            {'find_unused_parameters': True}
        """
        default = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if getattr(self, f.name) != getattr(default, f.name)
        }


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Keyword arguments forwarded to ``torch.nn.parallel.DistributedDataParallel``, plus a
    gradient communication hook (:mod:`nbaccel.runtime.strategy.ddp.comm_hooks`): ``comm_hook``,
    ``comm_wrapper`` (a :class:`DDPCommunicationHookType` or its value) and
    ``comm_state_option`` (PowerSGD settings)."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: Any = DDPCommunicationHookType.NO
    comm_wrapper: Any = DDPCommunicationHookType.NO
    comm_state_option: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_hook_options(self.comm_hook, self.comm_wrapper, self.comm_state_option)


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Keyword arguments forwarded to ``torch.amp.GradScaler`` (fp16 only)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class AutocastKwargs(KwargsHandler):
    """Options of the autocast context used for the prepared model's forward."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class AORecipeKwargs(KwargsHandler):
    """fp8 through torchao (``mixed_precision="fp8"``): its ``Float8LinearConfig`` and which
    ``Linear`` layers to convert.

    ``config``: a ``torchao.float8.Float8LinearConfig`` (``None``: torchao's tensorwise
    default). ``module_filter_func(module, fully_qualified_name) -> bool`` chooses the
    layers itself; without it the first and last ``Linear`` stay in bf16 (as Accelerate
    keeps them, for stability) and of the rest only the layers that gain from fp8 are
    converted (:func:`nbaccel.runtime.compute.fp8.fp8_gains`).

    Example:
        >>> AORecipeKwargs(module_filter_func=lambda m, name: name != "head").config is None
        True
    """

    config: Any = None
    module_filter_func: Any = None


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Options forwarded to ``torch.distributed.init_process_group``."""

    backend: str | None = None
    init_method: str | None = None
    timeout: timedelta | None = None


@dataclass
class ProfileKwargs(KwargsHandler):
    """``accelerator.profile()`` settings: the arguments of ``torch.profiler.profile``.

    ``activities``: ``"cpu"``, ``"cuda"``, ``"xpu"``... (default: the CPU, plus CUDA when
    available); ``schedule_option``: ``torch.profiler.schedule`` fields (``wait``,
    ``warmup``, ``active``, ``repeat``, ``skip_first``); ``on_trace_ready``: called with the
    profiler when a trace is ready; ``output_trace_dir``: every rank writes its chrome
    trace there, ``profile_{rank}.json``.
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Any = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | os.PathLike[str] | None = None


@dataclass(kw_only=True)
class DataLoaderConfiguration:
    """How prepared dataloaders shard and iterate.

    Args:
        split_batches: if True the loader's batch size is the *global* batch size and
            each rank gets a slice of every batch; if False each rank gets whole batches.
        even_batches: wrap around so every rank sees the same number of batches.
        dispatch_batches: rank 0 alone reads the data and sends each rank its slice of
            every global batch. ``None`` (Accelerate's default): True for an
            ``IterableDataset`` (with device placement), else False: every rank reads its
            own shard.
        use_seedable_sampler: shuffle a ``RandomSampler`` by ``data_seed + epoch``
            (Accelerate's ``SeedableRandomSampler``). False: on several processes the
            sampler's generator is seeded once at prepare from the global RNG and runs on
            across epochs; on one process it draws a seed every epoch (plain PyTorch).
        data_seed: the seed of the seedable sampler (default: ``torch.initial_seed()``).
        non_blocking: use ``non_blocking`` copies when moving batches to the device.
        use_stateful_dataloader: ``load_state`` also restores the position inside the
            epoch (exact resume, no skipping in the script). False (Accelerate's default):
            the loader restarts at the beginning of the saved epoch, in the same order,
            and the script skips what it saw (``skip_first_batches``). Prepared loaders
            always have ``state_dict()``/``load_state_dict()``.

    Example:
        >>> DataLoaderConfiguration(dispatch_batches=True, data_seed=3).data_seed
        3
    """

    split_batches: bool = False
    even_batches: bool = True
    dispatch_batches: bool | None = None
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        seed = self.data_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigError(f"data_seed={seed!r} must be an int (or None).")


@dataclass(kw_only=True)
class ProjectConfiguration:
    """Where checkpoints and logs go.

    Args:
        project_dir: root directory of the run.
        logging_dir: where trackers write; defaults to ``project_dir``.
        automatic_checkpoint_naming: save to ``project_dir/checkpoints/checkpoint_{i}``.
        total_limit: keep at most this many automatic checkpoints (>= 1) or ``None``.
        iteration: index of the next automatic checkpoint.
        save_on_each_node: write per-machine files on every node, not only node 0.

    Example:
        >>> ProjectConfiguration(project_dir="runs/a", automatic_checkpoint_naming=True).total_limit
    """

    project_dir: str | os.PathLike[str] | None = None
    logging_dir: str | os.PathLike[str] | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.total_limit is not None and (
            isinstance(self.total_limit, bool)
            or not isinstance(self.total_limit, int)
            or self.total_limit < 1
        ):
            raise ConfigError(
                f"total_limit={self.total_limit!r} must be an int >= 1 "
                "(or None to keep every checkpoint)."
            )
        if self.automatic_checkpoint_naming and self.project_dir is None:
            raise ConfigError(
                "automatic_checkpoint_naming=True needs project_dir: "
                "pass ProjectConfiguration(project_dir='runs/my_run', ...)."
            )
        if self.logging_dir is None and self.project_dir is not None:
            self.logging_dir = self.project_dir


@dataclass(kw_only=True)
class GradientAccumulationPlugin:
    """Gradient accumulation settings, as one object (``Accelerator(gradient_accumulation_plugin=)``).

    Args:
        num_steps: micro-steps per optimizer update (>= 1).
        adjust_scheduler: accepted for compatibility: prepared schedulers always step
            only with real optimizer updates.
        sync_with_dataloader: force a gradient sync (and update) on the last batch of the
            active prepared dataloader, even mid-accumulation.
        sync_each_batch: all-reduce gradients on every micro-step (no ``no_sync``): more
            communication, less memory for the un-synchronised gradients.

    Example:
        >>> GradientAccumulationPlugin(num_steps=4).num_steps
        4
    """

    num_steps: int = 1
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        n = self.num_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(
                f"GradientAccumulationPlugin(num_steps={n!r}): use an int >= 1 "
                "(1 = update after every batch)."
            )


# Keywords of the best-known peer that nbaccel accepts only as None, with what to use instead.
PEER_ONLY_KEYWORDS: dict[str, str] = {
    "deepspeed_plugins": (
        "nbaccel drives one DeepSpeed engine per Accelerator: pass one "
        "deepspeed_plugin=DeepSpeedPlugin(...)."
    ),
    "fsdp_plugin": "FSDP is not available in this nbaccel build; remove fsdp_plugin.",
    "megatron_lm_plugin": (
        "Megatron-LM (tensor/pipeline parallelism) is not part of nbaccel. Shard a model "
        "too large for one device with PyTorch FSDP2 (fsdp_plugin=...), or train with the "
        "default DDP; drop megatron_lm_plugin."
    ),
    "torch_tp_plugin": "tensor parallelism is not part of nbaccel: use fsdp_plugin=... or DDP.",
}

HANDLER_TYPES: tuple[type[KwargsHandler], ...] = (
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    AutocastKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    AORecipeKwargs,
)


def check_unexpected_keywords(owner: str, unexpected: dict[str, Any], valid: list[str]) -> None:
    """Raise ``TypeError`` for an unknown keyword (listing ``valid``), ``ConfigError`` naming
    the alternative for a peer-only keyword (``deepspeed_plugin``, ...) given a value."""
    for name, value in unexpected.items():
        if name not in PEER_ONLY_KEYWORDS:
            raise TypeError(
                f"{owner}() got an unexpected keyword argument {name!r}; valid keywords: "
                f"{', '.join(sorted(valid))}."
            )
        if value is not None:
            raise ConfigError(f"{owner}({name}=...) is not supported: {PEER_ONLY_KEYWORDS[name]}")


def parse_kwargs_handlers(handlers: Any) -> dict[type, Any]:
    """``kwargs_handlers=[...]`` as ``{handler type: handler}``; one of each type at most.

    Example:
        >>> list(parse_kwargs_handlers([GradScalerKwargs(init_scale=2.0)]))
        [<class 'nbaccel.runtime.facade.options.GradScalerKwargs'>]
    """
    found: dict[type, Any] = {}
    for handler in handlers or ():
        kind = next((k for k in HANDLER_TYPES if isinstance(handler, k)), None)
        if kind is None:
            raise TypeError(
                f"kwargs_handlers got {handler!r}; pass instances of "
                f"{', '.join(k.__name__ for k in HANDLER_TYPES)}."
            )
        if kind in found:
            raise ConfigError(f"kwargs_handlers has two {kind.__name__} objects; pass one.")
        found[kind] = handler
    return found


def resolve_dataloader_config(
    config: DataLoaderConfiguration | None,
    split_batches: bool | None,
    even_batches: bool | None,
    dispatch_batches: bool | None = None,
) -> DataLoaderConfiguration:
    """Merge the plain ``split_batches``/``even_batches`` keywords with ``dataloader_config``.

    Setting the same option in both places to different values is an error.

    Example:
        >>> resolve_dataloader_config(None, True, None).split_batches
        True
    """
    if config is None:
        return DataLoaderConfiguration(
            split_batches=bool(split_batches),
            even_batches=True if even_batches is None else bool(even_batches),
            dispatch_batches=dispatch_batches,
        )
    plain = {
        "split_batches": split_batches,
        "even_batches": even_batches,
        "dispatch_batches": dispatch_batches,
    }
    for name, value in plain.items():
        if value is not None and value != getattr(config, name):
            raise ConfigError(
                f"{name}={value!r} conflicts with dataloader_config.{name}="
                f"{getattr(config, name)!r}; set it in one place only."
            )
    return config


__all__ = [
    "HANDLER_TYPES",
    "PEER_ONLY_KEYWORDS",
    "AORecipeKwargs",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "ProfileKwargs",
    "ProjectConfiguration",
    "check_unexpected_keywords",
    "parse_kwargs_handlers",
    "resolve_dataloader_config",
]
