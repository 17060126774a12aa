"""Strategies: how a model takes part in training across processes.

One object per ``Accelerator``, chosen from the process state by
:func:`select_strategy`: :class:`SingleProcess` (one process), :class:`DDP`
(several processes on CPU or GPU) or :class:`XLA` (torch_xla devices). Each one
wraps the model, controls gradient sync, clips, and makes state dicts; the
facade calls them and never compares distributed types.

Example:
    >>> from nbaccel.runtime.state import get_state
    >>> select_strategy(get_state(cpu=True)).name
    'single'
"""

from __future__ import annotations

from ..state import DistributedType, ProcessState
from .base import SingleProcess
from .ddp import DDP
from .xla import XLA

Strategy = SingleProcess  # the interface every strategy implements

_BY_TYPE: dict[DistributedType, type[SingleProcess]] = {
    DistributedType.NO: SingleProcess,
    DistributedType.MULTI_CPU: DDP,
    DistributedType.MULTI_GPU: DDP,
    DistributedType.XLA: XLA,
}


def select_strategy(state: ProcessState) -> SingleProcess:
    """The strategy for this process's distributed type."""
    return _BY_TYPE[state.distributed_type](state)


__all__ = ["DDP", "XLA", "SingleProcess", "Strategy", "select_strategy"]
