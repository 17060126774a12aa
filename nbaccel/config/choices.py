"""Every choice of the launch configuration, defined once.

Precision modes, start methods, compute devices, strategies, FSDP and DeepSpeed options, what a
hang does and how machines meet (``rdzv_backend``) are ``Literal`` types here; the
launcher, the runtime, the CLI and the widget panel derive their options from these
tuples so they can never drift apart.

Example:
    >>> normalize_precision("BF16")
    'bf16'
    >>> "spawn" in START_METHODS
    True
"""

from __future__ import annotations

import enum
from typing import Literal, get_args

from ..errors import ConfigError

PrecisionType = Literal["no", "fp16", "bf16", "fp8"]
StartMethodType = Literal["auto", "fork", "spawn"]
ComputeDeviceType = Literal["auto", "cpu", "gpu", "tpu"]
StrategyType = Literal["ddp", "fsdp", "deepspeed"]
FsdpWrapPolicyType = Literal["transformer_based_wrap", "size_based_wrap", "no_wrap"]
FsdpStateDictType = Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"]
OnHangType = Literal["report", "raise"]
DeepSpeedOffloadType = Literal["none", "cpu", "nvme"]
RdzvBackendType = Literal["static", "c10d"]

PRECISIONS: tuple[str, ...] = get_args(PrecisionType)
START_METHODS: tuple[str, ...] = get_args(StartMethodType)
COMPUTE_DEVICES: tuple[str, ...] = get_args(ComputeDeviceType)
STRATEGIES: tuple[str, ...] = get_args(StrategyType)
FSDP_WRAP_POLICIES: tuple[str, ...] = get_args(FsdpWrapPolicyType)
FSDP_STATE_DICT_TYPES: tuple[str, ...] = get_args(FsdpStateDictType)
ON_HANG: tuple[str, ...] = get_args(OnHangType)
DEEPSPEED_OFFLOAD_DEVICES: tuple[str, ...] = get_args(DeepSpeedOffloadType)
DEEPSPEED_ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
RDZV_BACKENDS: tuple[str, ...] = get_args(RdzvBackendType)


class ChoiceEnum(str, enum.Enum):
    """An enum of choices, each also its string, printed as its value (``str(m) ==
    m.value``, what Python 3.11's ``enum.StrEnum`` does; nbaccel supports 3.10): the
    base of the choice enums the peer's API names (``DynamoBackend``,
    ``DDPCommunicationHookType``), so an option shows and compares as its string.

    Example:
        >>> class Mode(ChoiceEnum):
        ...     FAST = "fast"
        >>> str(Mode.FAST), f"{Mode.FAST}", Mode.FAST == "fast"
        ('fast', 'fast', True)
    """

    def __str__(self) -> str:
        return str(self.value)


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
    "DEEPSPEED_OFFLOAD_DEVICES",
    "DEEPSPEED_ZERO_STAGES",
    "FSDP_STATE_DICT_TYPES",
    "FSDP_WRAP_POLICIES",
    "ON_HANG",
    "PRECISIONS",
    "RDZV_BACKENDS",
    "START_METHODS",
    "STRATEGIES",
    "ChoiceEnum",
    "ComputeDeviceType",
    "DeepSpeedOffloadType",
    "FsdpStateDictType",
    "FsdpWrapPolicyType",
    "OnHangType",
    "PrecisionType",
    "RdzvBackendType",
    "StartMethodType",
    "StrategyType",
    "normalize_precision",
]
