"""Process state, at the path scripts know from ``accelerate.state``.

The implementation is :mod:`nbaccel.runtime.state`; this module only re-exports it.

Example:
    >>> from nbaccel.state import DistributedType
    >>> DistributedType.MULTI_CPU.value
    'MULTI_CPU'
"""

from .runtime.state import (
    DistributedType,
    EnvironmentSnapshot,
    ProcessState,
    current_state,
    get_state,
    read_environment,
    reset_state,
)

__all__ = [
    "DistributedType",
    "EnvironmentSnapshot",
    "ProcessState",
    "current_state",
    "get_state",
    "read_environment",
    "reset_state",
]
