"""``PartialState`` and ``AcceleratorState``: the process facts, usable without an ``Accelerator``.

Scripts ported from the best-known peer create ``PartialState()`` at the top (before any
model exists) to ask who they are, to let the main process download first, or to split
prompts between processes. Both classes are views of this process's one cached
:class:`~nbaccel.runtime.process.state.ProcessState`: creating one joins (or adopts) the process
group exactly as an ``Accelerator`` would, and every instance agrees.

Example:
    >>> state = PartialState(cpu=True)
    >>> (state.num_processes, state.process_index, state.is_main_process)
    (1, 0, True)
    >>> with state.split_between_processes(["a", "b", "c"]) as mine:
    ...     mine
    ['a', 'b', 'c']
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import torch

from ...config import normalize_precision
from ...platform import torchcompat
from ..process import rank_check
from ..process.state import DistributedType, ProcessState, get_state, reset_state
from ._process_api import ProcessAPI

_INIT_KEYWORDS = ("backend", "init_method", "timeout")

_LAST_PRECISION: dict[str, str] = {}  # the most recent Accelerator's, for AcceleratorState()


class PartialState(ProcessAPI):
    """This process's place in the job, without training state.

    Args:
        cpu: run on the CPU even if a GPU is visible.
        **kwargs: ``backend``, ``init_method``, ``timeout`` (seconds or ``timedelta``)
            for ``torch.distributed.init_process_group`` when this creates the group.

    Raises:
        TypeError: another keyword.
        LaunchError: the process group could not be formed.
    """

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(_INIT_KEYWORDS))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}() got unexpected keyword(s) {unknown}; valid: cpu, "
                f"{', '.join(_INIT_KEYWORDS)}."
            )
        timeout = kwargs.get("timeout")
        if isinstance(timeout, int | float) and not isinstance(timeout, bool):
            kwargs["timeout"] = datetime.timedelta(seconds=timeout)
        self._process = get_state(cpu=cpu, init_kwargs=kwargs)

    @property
    def process_state(self) -> ProcessState:
        """The frozen :class:`ProcessState` behind this view."""
        return self._process

    @property
    def initialized(self) -> bool:
        """Always True: constructing the state initialises it."""
        return True

    @property
    def default_device(self) -> torch.device:
        """The device this process computes on (Accelerate's name)."""
        return self._process.device

    def set_device(self) -> None:
        """Make :attr:`default_device` the current CUDA device (done already on creation)."""
        if self._process.device.type == "cuda":
            torch.cuda.set_device(self._process.device)

    @property
    def fork_launched(self) -> bool:
        """Whether ``PrepareForLaunch`` started this process (its ``FORK_LAUNCHED=1``)."""
        import os

        return os.environ.get("FORK_LAUNCHED") == "1"

    @classmethod
    def _reset_state(cls) -> None:
        """Forget this process's state, so the next one is read afresh (test suites call it
        between tests); a running process group stays and is adopted again."""
        reset_state()
        _LAST_PRECISION.clear()

    def destroy_process_group(self, group: Any = None) -> None:
        """Tear down ``group`` (default: the process group, and this process's state)."""
        if group is not None:
            torch.distributed.destroy_process_group(group)
            return
        torchcompat.destroy_process_group()
        rank_check.forget()
        reset_state()

    def __getattr__(self, name: str) -> Any:
        # nbaccel's own field names (rank, world_size, local_rank...) keep working
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return getattr(self._process, name)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}"
            ) from None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PartialState):
            return self._process == other._process
        if isinstance(other, ProcessState):
            return self._process == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._process)

    def __repr__(self) -> str:
        s = self._process
        return (
            f"{type(self).__name__}(distributed_type={s.distributed_type.value}, num_processes="
            f"{s.world_size}, process_index={s.rank}, local_process_index={s.local_rank}, "
            f"device={s.device})"
        )


class AcceleratorState(PartialState):
    """:class:`PartialState` plus the training settings (``mixed_precision``).

    ``AcceleratorState()`` created after an ``Accelerator`` reports that Accelerator's
    mixed precision; ``accelerator.state`` is the one belonging to the accelerator.

    Args:
        mixed_precision: "no", "fp16", "bf16", "fp8"; None: the last Accelerator's, else "no".
        cpu: run on the CPU even if a GPU is visible.
        **kwargs: as for :class:`PartialState`.

    Example:
        >>> AcceleratorState(cpu=True).mixed_precision in ("no", "fp16", "bf16", "fp8")
        True
    """

    # plugins of the best-known peer that nbaccel does not have (scripts test them for None)
    deepspeed_plugin: Any = None
    megatron_lm_plugin: Any = None
    dynamo_plugin: Any = None

    def __init__(self, mixed_precision: str | None = None, cpu: bool = False, **kwargs: Any):
        super().__init__(cpu=cpu, **kwargs)
        if mixed_precision is None:
            mixed_precision = _LAST_PRECISION.get("mode", "no")
        self.mixed_precision: str = normalize_precision(mixed_precision)
        _LAST_PRECISION.setdefault("mode", self.mixed_precision)

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Forget the training settings (and, with ``reset_partial_state``, the process
        state too), as test suites do between tests."""
        _LAST_PRECISION.clear()
        if reset_partial_state:
            reset_state()

    @property
    def is_fsdp2(self) -> bool:
        """True under FSDP (nbaccel's FSDP is FSDP2)."""
        return self._reported.shards_model

    @property
    def _reported(self) -> ProcessState:
        """The process state as reported: with an assigned ``distributed_type`` in place."""
        override = self.__dict__.get("_distributed_type")
        if override is None:
            return self._process
        return dataclasses.replace(self._process, distributed_type=override)

    @property
    def distributed_type(self) -> DistributedType:
        """How this process takes part; assignable, as Accelerate's test suites do (it then
        changes what is reported and ``join_uneven_inputs``' check, not the strategy)."""
        return self._reported.distributed_type

    @distributed_type.setter
    def distributed_type(self, value: DistributedType) -> None:
        self.__dict__["_distributed_type"] = DistributedType(value)

    @classmethod
    def for_accelerator(cls, process: ProcessState, mixed_precision: str) -> AcceleratorState:
        """The state of an Accelerator that already built ``process``."""
        state = cls.__new__(cls)
        state._process = process
        state.mixed_precision = mixed_precision
        _LAST_PRECISION["mode"] = mixed_precision
        return state

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, mixed_precision={self.mixed_precision!r})"


def is_initialized() -> bool:
    """True once an ``Accelerator`` (or ``AcceleratorState``) exists in this process."""
    return "mode" in _LAST_PRECISION


__all__ = ["AcceleratorState", "PartialState", "is_initialized"]
