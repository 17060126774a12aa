"""Every choice of the launch configuration, defined once.

Precision modes, start methods and compute devices are ``Literal`` types here; the
launcher, the runtime, the CLI and the widget panel derive their options from these
tuples so they can never drift apart.

Example:
    >>> normalize_precision("BF16")
    'bf16'
    >>> "spawn" in START_METHODS
    True
"""

from __future__ import annotations

from typing import Literal, get_args

from ..errors import ConfigError

PrecisionType = Literal["no", "fp16", "bf16", "fp8"]
StartMethodType = Literal["auto", "fork", "spawn"]
ComputeDeviceType = Literal["auto", "cpu", "gpu", "tpu"]

PRECISIONS: tuple[str, ...] = get_args(PrecisionType)
START_METHODS: tuple[str, ...] = get_args(StartMethodType)
COMPUTE_DEVICES: tuple[str, ...] = get_args(ComputeDeviceType)


def normalize_precision(value: object, *, argument: str = "mixed_precision") -> str:
    """Return the canonical precision name, or raise a ``ConfigError`` naming ``argument``.

    ``None`` and ``"fp32"`` mean ``"no"``; matching is case-insensitive.

    Example:
        >>> normalize_precision("BF16")
        'bf16'
    """
    if value is None:
        return "no"
    if not isinstance(value, str):
        raise ConfigError(
            f"{argument}={value!r} is not a string; use one of {', '.join(PRECISIONS)}."
        )
    lowered = value.strip().lower()
    if lowered in ("fp32", "no", "none", ""):
        return "no"
    if lowered not in PRECISIONS:
        raise ConfigError(f"{argument}={value!r} is unknown; use one of {', '.join(PRECISIONS)}.")
    return lowered


__all__ = [
    "COMPUTE_DEVICES",
    "PRECISIONS",
    "START_METHODS",
    "ComputeDeviceType",
    "PrecisionType",
    "StartMethodType",
    "normalize_precision",
]
