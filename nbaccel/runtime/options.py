"""Small keyword-only option objects accepted by :class:`nbaccel.Accelerator`.

These mirror the names users know from the best-known peer so scripts port by
changing the import. Each validates itself on construction.

Example:
    >>> from nbaccel.runtime.options import DataLoaderConfiguration
    >>> DataLoaderConfiguration(split_batches=True).split_batches
    True
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..errors import ConfigError


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
    """Keyword arguments forwarded to ``torch.nn.parallel.DistributedDataParallel``."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


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
class InitProcessGroupKwargs(KwargsHandler):
    """Options forwarded to ``torch.distributed.init_process_group``."""

    backend: str | None = None
    init_method: str | None = None
    timeout: timedelta | None = None


@dataclass(kw_only=True)
class DataLoaderConfiguration:
    """How prepared dataloaders shard and iterate.

    Args:
        split_batches: if True the loader's batch size is the *global* batch size and
            each rank gets a slice of every batch; if False each rank gets whole batches.
        even_batches: wrap around so every rank sees the same number of batches.
        dispatch_batches: accepted for compatibility; only ``None``/``False`` supported.
        use_seedable_sampler: use a sampler whose shuffle depends only on (seed, epoch).
        non_blocking: use ``non_blocking`` copies when moving batches to the device.
    """

    split_batches: bool = False
    even_batches: bool = True
    dispatch_batches: bool | None = None
    use_seedable_sampler: bool = False
    non_blocking: bool = False

    def __post_init__(self) -> None:
        if self.dispatch_batches:
            raise ConfigError(
                "dispatch_batches=True is not supported by nbaccel; every rank reads its own "
                "shard. Leave dispatch_batches unset."
            )


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


# Keywords of the best-known peer that nbaccel accepts only as None (clear error otherwise).
PEER_ONLY_KEYWORDS: tuple[str, ...] = (
    "deepspeed_plugin",
    "deepspeed_plugins",
    "fsdp_plugin",
    "megatron_lm_plugin",
    "torch_tp_plugin",
    "gradient_accumulation_plugin",
    "dynamo_backend",
    "dynamo_plugin",
    "parallelism_config",
)

HANDLER_TYPES: tuple[type[KwargsHandler], ...] = (
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    AutocastKwargs,
    InitProcessGroupKwargs,
)


def check_unexpected_keywords(owner: str, unexpected: dict[str, Any], valid: list[str]) -> None:
    """Raise ``TypeError`` for an unknown keyword (listing ``valid``), ``ConfigError`` for a
    peer-only keyword (``fsdp_plugin``, ...) given a value other than ``None``."""
    for name, value in unexpected.items():
        if name not in PEER_ONLY_KEYWORDS:
            raise TypeError(
                f"{owner}() got an unexpected keyword argument {name!r}; valid keywords: "
                f"{', '.join(sorted(valid))}."
            )
        if value is not None:
            raise ConfigError(
                f"{owner}({name}=...) is not supported by nbaccel; remove it (FSDP, DeepSpeed, "
                "Megatron, tensor-parallel and dynamo plugins are not part of nbaccel)."
            )


def parse_kwargs_handlers(handlers: Any) -> dict[type, Any]:
    """``kwargs_handlers=[...]`` as ``{handler type: handler}``; one of each type at most.

    Example:
        >>> list(parse_kwargs_handlers([GradScalerKwargs(init_scale=2.0)]))
        [<class 'nbaccel.runtime.options.GradScalerKwargs'>]
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
    config: DataLoaderConfiguration | None, split_batches: bool | None, even_batches: bool | None
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
        )
    for name, value in (("split_batches", split_batches), ("even_batches", even_batches)):
        if value is not None and value != getattr(config, name):
            raise ConfigError(
                f"{name}={value!r} conflicts with dataloader_config.{name}="
                f"{getattr(config, name)!r}; set it in one place only."
            )
    return config


__all__ = [
    "HANDLER_TYPES",
    "PEER_ONLY_KEYWORDS",
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "ProjectConfiguration",
    "check_unexpected_keywords",
    "parse_kwargs_handlers",
    "resolve_dataloader_config",
]
