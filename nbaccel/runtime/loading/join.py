"""Uneven inputs and deferred gradient sync for DistributedDataParallel models.

* :func:`join_uneven_inputs`: torch's ``Join`` context around a loop in which ranks run
  different numbers of steps (``even_batches=False``): a rank that ran out of batches
  shadows the others' all-reduces instead of hanging them.
* :func:`trigger_sync_in_backward`: after forward passes under ``no_sync``, make the next
  backward all-reduce the gradients (DDP prepares its reducer during forward, so a
  forward under ``no_sync`` leaves it unprepared).

Both do nothing for a single process or a model that is not DDP-wrapped
(``join_uneven_inputs`` warns then, as Accelerate does).

Example:
    >>> import torch, warnings
    >>> model = torch.nn.Linear(2, 2)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     with join_uneven_inputs([model], loaders=[], distributed_type=DistributedType.NO):
    ...         pass
    >>> "only supported" in str(caught[-1].message)
    True
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from ...platform.process_env import distributed_active
from ..process.state import DistributedType
from .sharding import BatchSamplerShard

_JOINABLE_TYPES = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


@contextlib.contextmanager
def join_uneven_inputs(
    joinables: Sequence[Any],
    *,
    loaders: Sequence[Any],
    even_batches: bool | None = None,
    distributed_type: DistributedType = DistributedType.MULTI_CPU,
) -> Iterator[None]:
    """Run the block under ``torch.distributed.algorithms.Join(joinables)``.

    Args:
        joinables: prepared DDP models (or other ``torch.distributed.algorithms.Joinable``
            objects such as ``ZeroRedundancyOptimizer``).
        loaders: the prepared dataloaders whose ``even_batches`` may be overridden.
        even_batches: if not None, the prepared loaders use it inside the block.
        distributed_type: how the Accelerator runs; ``Join`` applies to DDP only (one
            process, FSDP: a warning, and the block runs as it is, as in Accelerate).

    Raises:
        TypeError: an object in ``joinables`` is not joinable.
    """
    if distributed_type not in _JOINABLE_TYPES or not distributed_active():
        warnings.warn(
            "join_uneven_inputs is only supported for multi-GPU and multi-CPU (DDP) training; "
            f"with distributed_type={distributed_type.value} it has no effect.",
            UserWarning,
            stacklevel=3,
        )
        yield
        return
    from torch.distributed.algorithms import Join, Joinable

    wrong = [type(j).__name__ for j in joinables if not isinstance(j, Joinable)]
    if wrong:
        raise TypeError(
            f"join_uneven_inputs got {wrong}, which torch's Join cannot track: pass the "
            "prepared models (DistributedDataParallel) and/or ZeroRedundancyOptimizer objects."
        )
    saved: list[tuple[BatchSamplerShard, bool]] = []
    if even_batches is not None:
        iterable = False
        for loader in loaders:
            shard = getattr(loader, "_shard", None)
            if isinstance(shard, BatchSamplerShard):
                saved.append((shard, shard.even_batches))
                shard.even_batches = even_batches
            else:
                iterable = True
        if iterable:
            warnings.warn(
                "Overriding even_batches is only supported for map-style datasets; the "
                "prepared loaders over iterable datasets keep their setting.",
                UserWarning,
                stacklevel=3,
            )
    try:
        with Join(list(joinables)):
            yield
    finally:
        for shard, value in saved:
            shard.even_batches = value


@contextlib.contextmanager
def trigger_sync_in_backward(model: Any) -> Iterator[None]:
    """Make the next backward of ``model`` all-reduce gradients, even after ``no_sync``."""
    if not isinstance(model, DistributedDataParallel) or not distributed_active():
        yield
        return
    previous = (model.require_backward_grad_sync, model.require_forward_param_sync)
    model.require_backward_grad_sync = True
    model.require_forward_param_sync = True
    # DDP marks the reducer ready during forward; do it here instead (no unused params)
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = previous


__all__ = ["join_uneven_inputs", "trigger_sync_in_backward"]
