"""Collectives as ``Accelerator`` methods: gather, gather_for_metrics, reduce, broadcast, pad.

A mixin over :mod:`nbaccel.runtime.collectives.ops`; the class provides ``gradient_state`` (the
active dataloader tells ``gather_for_metrics`` how many samples of the last round are
real).

Example:
    >>> import torch
    >>> from nbaccel import Accelerator
    >>> Accelerator(cpu=True).gather_for_metrics((torch.ones(2), torch.arange(2)))[1].tolist()
    [0, 1]
"""

from __future__ import annotations

from typing import Any

from ..collectives import ops, tree
from ..training.accumulation import GradientState


class CollectiveAPI:
    """Tensor and object collectives, no-ops for a single process."""

    gradient_state: GradientState
    _reads_own_share: Any  # ParallelAPI: False on ranks that repeat their group's batch

    def gather(self, tensor: Any) -> Any:
        """Concatenate every process's tensors along dim 0 (same shapes on every rank)."""
        return ops.gather(tensor)

    def gather_object(self, obj: Any) -> list[Any]:
        """Gather picklable objects (lists are concatenated)."""
        return ops.gather_object(obj)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather for evaluation: drops the samples ``even_batches`` duplicated at the end.

        Tensors may differ in size along dim 0 across ranks; non-tensor data is gathered
        as objects.
        """
        tensors_only = tree.is_tensor_tree(input_data)
        if not self._reads_own_share():  # a tensor/context-parallel rank holds a copy
            input_data = [] if isinstance(input_data, list) else input_data
            if tensors_only:
                input_data = tree.recursively_apply(lambda t: t[:0], input_data)
        if use_gather_object or not tensors_only:
            data = ops.gather_object(input_data)
        else:
            data = ops.gather(input_data, allow_uneven=True)
        remainder = self.gradient_state.remainder
        if self.gradient_state.end_of_dataloader and remainder >= 0:
            if isinstance(data, list):
                return data[:remainder]
            return tree.recursively_apply(lambda t: t[:remainder], data)
        return data

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Pad tensors along ``dim`` to the largest size on any process."""
        return ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """All-reduce tensors across processes: ``"sum"``, ``"mean"`` or ``"none"`` (plus
        nbaccel's ``"max"``, ``"min"``, ``"product"``); the result is multiplied by ``scale``."""
        return ops.reduce(tensor, reduction=reduction, scale=scale)

    def broadcast(self, tensor: Any, from_process: int = 0) -> Any:
        """Copy ``from_process``'s tensors to every process."""
        return ops.broadcast(tensor, from_process=from_process)


__all__ = ["CollectiveAPI"]
