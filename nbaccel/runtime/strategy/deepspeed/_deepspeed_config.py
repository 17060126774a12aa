"""Filling a DeepSpeed configuration's ``"auto"`` values from what ``prepare`` was given.

Accelerate's DeepSpeed guide lets a config file say ``"auto"`` where the value follows
from the training script: batch sizes from the dataloaders, accumulation and precision
from the ``Accelerator``, optimizer and scheduler parameters from ``DummyOptim`` /
``DummyScheduler``, ZeRO bucket sizes from ``model.config.hidden_size``. Pure
functions over dicts: no DeepSpeed import, no processes.

Example:
    >>> config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2}
    >>> fill_batch_sizes(config, batch_sizes=[4], num_processes=2, split_batches=False,
    ...                  train_batch_min=True)
    >>> config["train_micro_batch_size_per_gpu"], config["train_batch_size"]
    (4, 16)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from ....errors import ConfigError

_HIDDEN_SIZE_KEYS = (
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
)


def auto_keys(config: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """The dotted keys whose value is ``"auto"``."""
    for key, value in config.items():
        if isinstance(value, Mapping):
            yield from auto_keys(value, f"{prefix}{key}.")
        elif value == "auto":
            yield f"{prefix}{key}"


def _set_auto(config: dict[str, Any], key: str, value: Any) -> None:
    """Set the dotted ``key`` to ``value`` if it is ``"auto"`` (else leave it)."""
    *path, last = key.split(".")
    node = config
    for part in path:
        node = node.get(part, {})
        if not isinstance(node, dict):
            return
    if node.get(last) == "auto":
        node[last] = value


def precision_from_config(config: dict[str, Any], requested: str) -> str:
    """Fill ``fp16``/``bf16`` ``"auto"`` from the Accelerator's precision; return the mode
    the engine runs (a section enabled explicitly in the config wins)."""
    for mode in ("fp16", "bf16"):
        section = config.get(mode)
        if isinstance(section, dict) and section.get("enabled") == "auto":
            section["enabled"] = requested == mode
    enabled = [
        m for m in ("fp16", "bf16") if isinstance(config.get(m), dict) and config[m].get("enabled")
    ]
    if len(enabled) > 1:
        raise ConfigError("the DeepSpeed config enables both fp16 and bf16: keep one.")
    if enabled:
        return enabled[0]
    if requested in ("fp16", "bf16"):
        config[requested] = {"enabled": True}
        return requested
    if requested == "fp8":
        raise ConfigError(
            "mixed_precision='fp8' cannot be combined with DeepSpeed in nbaccel; use 'bf16'."
        )
    return "no"


def fill_batch_sizes(
    config: dict[str, Any],
    *,
    batch_sizes: list[int | None],
    num_processes: int,
    split_batches: bool,
    train_batch_min: bool,
) -> None:
    """``train_micro_batch_size_per_gpu`` and ``train_batch_size`` (after accumulation)."""
    if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        if not batch_sizes or any(b is None for b in batch_sizes):
            raise ConfigError(
                "DeepSpeed needs the micro-batch size: pass the training DataLoader (with an "
                "int batch_size) to the same accelerator.prepare(...) call as the model, or "
                'set "train_micro_batch_size_per_gpu" in the DeepSpeed config.'
            )
        sizes = [int(b) // num_processes if split_batches else int(b) for b in batch_sizes if b]
        config["train_micro_batch_size_per_gpu"] = min(sizes) if train_batch_min else max(sizes)
    micro = config["train_micro_batch_size_per_gpu"]
    steps = config.get("gradient_accumulation_steps", 1)
    if config.get("train_batch_size", "auto") == "auto":
        config["train_batch_size"] = micro * steps * num_processes


def fill_model_sizes(config: dict[str, Any], model: Any) -> None:
    """ZeRO bucket sizes from ``model.config.hidden_size`` (Accelerate's formulas)."""
    zero = config.get("zero_optimization", {})
    wanted = [k for k in _HIDDEN_SIZE_KEYS if zero.get(k) == "auto"]
    if not wanted:
        return
    model_config = getattr(model, "config", None)
    hidden = getattr(model_config, "hidden_size", None)
    sizes = getattr(model_config, "hidden_sizes", None)
    if hidden is None and sizes:
        hidden = max(sizes)
    if not isinstance(hidden, int):
        raise ConfigError(
            f'the DeepSpeed config sets zero_optimization.{wanted[0]} to "auto", which is '
            "derived from model.config.hidden_size, and this model has none: write an int "
            f"there (e.g. 50000000), or remove the key{'s' if len(wanted) > 1 else ''} "
            f"{', '.join(wanted)} to use DeepSpeed's defaults."
        )
    values = {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }
    for key in wanted:
        zero[key] = values[key]


def fill_optimizer_and_scheduler(
    config: dict[str, Any],
    *,
    dummy_optimizer: Any,
    dummy_scheduler: Any,
    num_processes: int,
    split_batches: bool,
) -> None:
    """``optimizer.params``/``scheduler.params`` ``"auto"`` from DummyOptim/DummyScheduler."""
    if dummy_optimizer is not None:
        _set_auto(config, "optimizer.params.lr", dummy_optimizer.lr)
        _set_auto(config, "optimizer.params.weight_decay", dummy_optimizer.weight_decay)
    if dummy_scheduler is not None and dummy_scheduler.lr_scheduler_callable is None:
        optimizer = dummy_scheduler.optimizer
        defaults = getattr(optimizer, "defaults", None)
        max_lr = defaults["lr"] if isinstance(defaults, dict) else getattr(optimizer, "lr", None)
        _set_auto(config, "scheduler.params.warmup_min_lr", 0)
        _set_auto(config, "scheduler.params.warmup_max_lr", max_lr)
        # DeepSpeed >= 0.19.6 refuses 0 warm-up steps
        _set_auto(
            config, "scheduler.params.warmup_num_steps", max(1, dummy_scheduler.warmup_num_steps)
        )
        total = dummy_scheduler.total_num_steps
        if total is not None:  # each process sees 1/num_processes of the batches
            per_process = total if split_batches else math.ceil(total / num_processes)
            _set_auto(config, "scheduler.params.total_num_steps", per_process)


def fill_remaining(config: dict[str, Any]) -> None:
    """Accelerate's defaults for the rest; an ``"auto"`` left over is a ConfigError."""
    _set_auto(config, "gradient_clipping", 1.0)
    _set_auto(config, "zero_optimization.stage", 2)
    _set_auto(config, "zero_optimization.offload_optimizer.device", "none")
    _set_auto(config, "zero_optimization.offload_param.device", "none")
    _set_auto(config, "zero_optimization.stage3_gather_16bit_weights_on_model_save", False)
    left = list(auto_keys(config))
    if left:
        raise ConfigError(
            f'the DeepSpeed config still has "auto" at {", ".join(left)}: nbaccel cannot '
            "derive these from the prepared objects; write the values into the config."
        )


__all__ = [
    "auto_keys",
    "fill_batch_sizes",
    "fill_model_sizes",
    "fill_optimizer_and_scheduler",
    "fill_remaining",
    "precision_from_config",
]
