"""The strategy part of the launch configuration, as the workers receive it.

``strategy`` and the ``fsdp_*``/``deepspeed_*`` fields of :class:`~nbaccel.config.LaunchConfig` travel
to every worker as ``NBACCEL_*`` environment text (as ``mixed_precision`` does), so the
``Accelerator()`` inside the launched function picks FSDP or DeepSpeed without a code
change.

Example:
    >>> from nbaccel.config import LaunchConfig
    >>> strategy_environment(LaunchConfig(strategy="fsdp"))["NBACCEL_STRATEGY"]
    'fsdp'
"""

from __future__ import annotations

from .fields import field_names
from .launch_config import LaunchConfig


def strategy_fields() -> tuple[str, ...]:
    """``strategy`` and the ``fsdp_*``/``deepspeed_*`` fields: what a worker's
    ``Accelerator()`` must see."""
    return tuple(
        n for n in field_names() if n == "strategy" or n.startswith(("fsdp_", "deepspeed_"))
    )


def strategy_environment(cfg: LaunchConfig) -> dict[str, str]:
    """``NBACCEL_STRATEGY`` and (for "fsdp"/"deepspeed") the strategy's fields for the workers.

    The launcher passes the strategy the same way as ``mixed_precision``: as environment
    text that :func:`nbaccel.config.resolve_launch_config` parses back in every worker.

    Example:
        >>> strategy_environment(LaunchConfig(strategy="fsdp"))["NBACCEL_FSDP_CPU_OFFLOAD"]
        '0'
    """
    if cfg.strategy == "ddp":  # said explicitly: a kernel's NBACCEL_STRATEGY must not leak in
        return {"NBACCEL_STRATEGY": "ddp"}
    env: dict[str, str] = {}
    for name in strategy_fields():
        value = getattr(cfg, name)
        text = "none" if value is None else str(int(value)) if isinstance(value, bool) else value
        env[f"NBACCEL_{name.upper()}"] = str(text)
    return env


__all__ = ["strategy_environment", "strategy_fields"]
