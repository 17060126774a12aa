"""Parallelism sizes from the launch configuration, checked before any process starts.

The ``parallelism_config_*`` fields come from Accelerate's config-file keys,
``nbaccel launch --parallelism_config_tp_size 2`` or the panel.

Example:
    >>> from nbaccel.config import LaunchConfig
    >>> parallelism_from_launch(LaunchConfig(parallelism_config_dp_shard_size=2)).total_size
    2
    >>> parallelism_from_launch(LaunchConfig()) is None
    True
"""

from __future__ import annotations

from typing import Any

from ...config.launch_config import PARALLELISM_SIZE_FIELDS
from .checks import check_runnable, check_strategy
from .config import ParallelismConfig

_PREFIX = "parallelism_config_"


def parallelism_from_launch(cfg: Any) -> ParallelismConfig | None:
    """The sizes the launch configuration gives, or None when all are 1."""
    sizes: dict[str, Any] = {
        name[len(_PREFIX) :]: int(getattr(cfg, name)) for name in PARALLELISM_SIZE_FIELDS
    }
    if all(size == 1 for size in sizes.values()):
        return None
    return ParallelismConfig(**sizes)


def check_launch(cfg: Any, *, num_processes: int) -> None:
    """Refuse sizes that do not fit ``num_processes`` (all nodes), or need hardware this
    launch lacks, before anything starts.

    Raises:
        ConfigError: naming the sizes, the process count and the fix; sizes that shard
            next to ``strategy="deepspeed"``.
    """
    config = parallelism_from_launch(cfg)
    if config is None:
        return
    device = cfg.compute_device
    if device == "auto":
        from ...platform.hardware import cuda_device_count

        device = "gpu" if cuda_device_count() > 0 else "cpu"
    check_runnable(
        config, device_type="cuda" if device == "gpu" else device, num_processes=num_processes
    )
    check_strategy(config, strategy=cfg.strategy)


__all__ = ["check_launch", "parallelism_from_launch"]
