"""The strategy part of the launch configuration, and its ``NBACCEL_*`` environment form.

nbaccel's launchers hand every worker the resolved :class:`~nbaccel.config.LaunchConfig`
object, typed (:func:`~nbaccel.config.install_launch_config`), so no setting travels as
text. :func:`strategy_environment` is for processes nbaccel does not start (``torchrun``,
a scheduler's job, a test's environment): there ``strategy`` and the ``fsdp_*`` /
``deepspeed_*`` fields set as ``NBACCEL_*`` variables reach the ``Accelerator()``, which
reads them through :func:`~nbaccel.config.resolve_launch_config`.

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
    """``NBACCEL_STRATEGY`` and (for "fsdp"/"deepspeed") the strategy's fields as the
    environment text that :func:`nbaccel.config.resolve_launch_config` parses back.

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
