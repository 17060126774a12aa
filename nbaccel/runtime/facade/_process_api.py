"""Process facts and per-process helpers shared by ``PartialState`` and ``Accelerator``.

A mixin: the class provides ``_process`` (the frozen
:class:`~nbaccel.runtime.process.state.ProcessState`), the mixin derives everything scripts ask
of it (``process_index``, ``is_main_process``, ``wait_for_everyone``,
``main_process_first``, ``split_between_processes``, ``on_main_process``, ``print``...).

Example:
    >>> from nbaccel.runtime.facade.partial_state import PartialState
    >>> state = PartialState(cpu=True)
    >>> state.on_main_process(lambda: "only here")()
    'only here'
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from ..collectives import ops
from ..process.state import DistributedType, ProcessState

F = TypeVar("F", bound=Callable[..., Any])


class ProcessAPI:
    """Read-only process facts plus barriers, ordering contexts and rank decorators."""

    _process: ProcessState

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self._process.device

    @property
    def distributed_type(self) -> DistributedType:
        """``NO``, ``MULTI_CPU``, ``MULTI_GPU`` or ``XLA``."""
        return self._process.distributed_type

    @property
    def num_processes(self) -> int:
        """Processes taking part (the world size)."""
        return self._process.world_size

    @property
    def process_index(self) -> int:
        """This process's global rank."""
        return self._process.rank

    @property
    def local_process_index(self) -> int:
        """This process's rank on its machine."""
        return self._process.local_rank

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self._process.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """True on local rank 0 (once per machine)."""
        return self._process.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        """True on the highest global rank."""
        return self._process.is_last_process

    @property
    def use_distributed(self) -> bool:
        """True when more than one process takes part."""
        return self._process.use_distributed

    @property
    def backend(self) -> str | None:
        """The process-group backend (``"gloo"``, ``"nccl"``...) or None for one process."""
        return self._process.backend

    @property
    def num_nodes(self) -> int:
        """Machines taking part."""
        return self._process.num_nodes

    def wait_for_everyone(self) -> None:
        """Barrier: every process waits here until all arrive (no-op for one process)."""
        ops.barrier()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Run the block on the main process first, then on all others (e.g. downloads)."""
        return ops.first(self.is_main_process)

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Like :meth:`main_process_first`, once per machine."""
        return ops.first(self.is_local_main_process, "local_main_process_first")

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yield this process's contiguous share of a list, tuple, tensor or dict of those."""
        yield ops.split_between_processes(
            inputs, self.num_processes, self.process_index, apply_padding=apply_padding
        )

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def _only_on(self, condition: Callable[[], bool], function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if condition() else None

        return wrapper  # type: ignore[return-value]

    def on_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on the main process only (``None`` elsewhere)."""
        return self._only_on(lambda: self.is_main_process, function)

    def on_local_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on each machine's local main process only."""
        return self._only_on(lambda: self.is_local_main_process, function)

    def on_last_process(self, function: F) -> F:
        """Decorator: run ``function`` on the last process only."""
        return self._only_on(lambda: self.is_last_process, function)

    def on_process(self, function: F | None = None, process_index: int = 0) -> Any:
        """Decorator: run ``function`` on global rank ``process_index`` only."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._only_on(lambda: self.process_index == process_index, function)

    def on_local_process(self, function: F | None = None, local_process_index: int = 0) -> Any:
        """Decorator: run ``function`` on local rank ``local_process_index`` of each machine."""
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._only_on(lambda: self.local_process_index == local_process_index, function)


__all__ = ["ProcessAPI"]
