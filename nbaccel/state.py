"""Process state, at the path scripts know from ``accelerate.state``.

The implementation is :mod:`nbaccel.runtime.process.state` (the frozen process state) and
:mod:`nbaccel.runtime.facade.partial_state` (``PartialState``, ``AcceleratorState``); this module
only re-exports them.

Example:
    >>> from nbaccel.state import DistributedType
    >>> DistributedType.MULTI_CPU.value
    'MULTI_CPU'
"""

from .runtime.facade.partial_state import AcceleratorState, PartialState, is_initialized
from .runtime.process.state import (
    DistributedType,
    EnvironmentSnapshot,
    ProcessState,
    current_state,
    get_state,
    read_environment,
    reset_state,
)
from .runtime.training.accumulation import GradientState

__all__ = [
    "AcceleratorState",
    "DistributedType",
    "EnvironmentSnapshot",
    "GradientState",
    "PartialState",
    "ProcessState",
    "current_state",
    "get_state",
    "is_initialized",
    "read_environment",
    "reset_state",
]
