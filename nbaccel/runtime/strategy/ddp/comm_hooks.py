"""DDP communication hooks: how gradients travel between ranks (torch's own hooks).

``DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)`` compresses
every gradient bucket to float16 for the all-reduce; ``BF16`` to bfloat16;
``POWER_SGD`` / ``BATCHED_POWER_SGD`` send low-rank approximations (with error
feedback; ``comm_state_option`` sets ``PowerSGDState``'s fields, e.g.
``{"matrix_approximation_rank": 2}``); ``comm_wrapper`` (FP16/BF16) additionally
compresses what a PowerSGD hook sends. The hooks are
``torch.distributed.algorithms.ddp_comm_hooks``' own; nbaccel only registers them on
the prepared ``DistributedDataParallel`` model.

Example:
    >>> DDPCommunicationHookType("fp16") is DDPCommunicationHookType.FP16
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ....config.choices import ChoiceEnum
from ....errors import ConfigError


class DDPCommunicationHookType(ChoiceEnum):
    """The gradient communication hooks (and wrappers) ``DistributedDataParallelKwargs`` takes."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


def _kind(value: Any, what: str) -> DDPCommunicationHookType:
    try:
        return DDPCommunicationHookType(str(getattr(value, "value", value)).lower())
    except ValueError:
        names = [k.value for k in DDPCommunicationHookType]
        raise ConfigError(
            f"DistributedDataParallelKwargs({what}={value!r}): use a DDPCommunicationHookType "
            f"or one of {names}."
        ) from None


def check_hook_options(hook: Any, wrapper: Any, state_option: Any) -> None:
    """Validate the three options at construction (a bad value fails before any process
    group exists)."""
    hook_kind, wrapper_kind = _kind(hook, "comm_hook"), _kind(wrapper, "comm_wrapper")
    if wrapper_kind in (
        DDPCommunicationHookType.POWER_SGD,
        DDPCommunicationHookType.BATCHED_POWER_SGD,
    ):
        raise ConfigError(
            f"DistributedDataParallelKwargs(comm_wrapper={wrapper!r}): a wrapper compresses "
            "what a hook sends: use 'fp16', 'bf16' or 'no'."
        )
    if not isinstance(state_option, Mapping):
        raise ConfigError(
            f"DistributedDataParallelKwargs(comm_state_option={state_option!r}): pass a dict "
            "of PowerSGDState fields, e.g. {'matrix_approximation_rank': 2}."
        )
    power_sgd = hook_kind in (
        DDPCommunicationHookType.POWER_SGD,
        DDPCommunicationHookType.BATCHED_POWER_SGD,
    )
    if wrapper_kind is not DDPCommunicationHookType.NO and not power_sgd:
        raise ConfigError(
            f"comm_wrapper={wrapper_kind.value!r} compresses what a PowerSGD hook sends, but "
            f"comm_hook={hook_kind.value!r}: use comm_hook=DDPCommunicationHookType.FP16/BF16 "
            "alone, or a PowerSGD hook with the wrapper."
        )
    if state_option and not power_sgd:
        raise ConfigError(
            f"comm_state_option={dict(state_option)!r} configures a PowerSGD hook, but "
            f"comm_hook={hook_kind.value!r}: set comm_hook=DDPCommunicationHookType.POWER_SGD "
            "or drop comm_state_option."
        )


def register_comm_hook(
    model: Any, hook: Any, wrapper: Any = "no", state_option: Mapping[str, Any] | None = None
) -> None:
    """Register torch's hook ``hook`` (wrapped by ``wrapper``) on the DDP ``model``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hook_kind = _kind(hook, "comm_hook")
    if hook_kind is DDPCommunicationHookType.NO:
        return
    state: Any = None
    if hook_kind is DDPCommunicationHookType.FP16:
        function: Any = default_hooks.fp16_compress_hook
    elif hook_kind is DDPCommunicationHookType.BF16:
        function = default_hooks.bf16_compress_hook
    else:
        function = (
            powerSGD_hook.powerSGD_hook
            if hook_kind is DDPCommunicationHookType.POWER_SGD
            else powerSGD_hook.batched_powerSGD_hook
        )
        state = powerSGD_hook.PowerSGDState(process_group=None, **dict(state_option or {}))
        wrapper_kind = _kind(wrapper, "comm_wrapper")
        if wrapper_kind is DDPCommunicationHookType.FP16:
            function = default_hooks.fp16_compress_wrapper(function)
        elif wrapper_kind is DDPCommunicationHookType.BF16:
            function = default_hooks.bf16_compress_wrapper(function)
    model.register_comm_hook(state=state, hook=function)


__all__ = ["DDPCommunicationHookType", "check_hook_options", "register_comm_hook"]
