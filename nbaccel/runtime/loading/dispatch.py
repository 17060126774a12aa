"""``dispatch_batches``: rank 0 reads every global batch and each rank receives its slice.

The way to train on data only one process can read: an ``IterableDataset`` that cannot
be sharded (a stream, a generator), or a source opened once. Rank 0 iterates the
unprepared loader; per step it takes one batch (``split_batches=True``) or
``num_processes`` batches concatenated (``split_batches=False``, so every rank still
gets ``batch_size`` samples), broadcasts that global batch and every rank keeps its
contiguous slice. The other ranks never touch the dataset.

A global batch that does not split evenly (the last one) is completed by repeating its
first samples when ``even_batches`` (the loader records how many samples are real, so
``gather_for_metrics`` drops the repeats); otherwise the last ranks get smaller (or no)
slices.

Example:
    >>> import torch
    >>> d = BatchDispatcher(num_processes=2, process_index=1, split_batches=True)
    >>> d.slice({"x": torch.arange(6)})["x"].tolist()   # rank 1 of a 6-sample batch
    [3, 4, 5]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import tree

_CONTAINERS = (torch.Tensor, Mapping, list, tuple)


def _is_leaf(obj: Any) -> bool:
    """A tensor, or a flat list/tuple of plain values (e.g. collated strings)."""
    if isinstance(obj, torch.Tensor):
        return True
    return isinstance(obj, list | tuple) and not any(isinstance(v, _CONTAINERS) for v in obj)


def _map(fn: Callable[[Any], Any], batch: Any) -> Any:
    """Apply ``fn`` to every sliceable leaf, rebuilding the containers."""
    if _is_leaf(batch):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {k: _map(fn, v) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map(fn, v) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(_map(fn, v) for v in batch)
    return batch  # scalars and other objects travel unchanged


def _leaves(batch: Any) -> list[Any]:
    return tree._leaves(batch, _map)


def _rebuild(batch: Any, values: Iterable[Any]) -> Any:
    return tree._rebuild(batch, values, _map)


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """Concatenate collated batches (tensors along ``dim``, lists end to end).

    Example:
        >>> concatenate([(torch.ones(1), ["a"]), (torch.zeros(2), ["b", "c"])])
        (tensor([1., 0., 0.]), ['a', 'b', 'c'])
    """
    batches = data
    if len(batches) == 1:
        return batches[0]
    columns = zip(*(_leaves(b) for b in batches), strict=True)
    merged = [
        torch.cat(col, dim=dim)
        if isinstance(col[0], torch.Tensor)
        else type(col[0])(itertools.chain(*col))
        for col in columns
    ]
    return _rebuild(batches[0], merged)


def _to_cpu(leaf: Any) -> Any:
    return leaf.cpu() if isinstance(leaf, torch.Tensor) else leaf


def _take(leaf: Any, rows: list[int]) -> Any:
    if isinstance(leaf, torch.Tensor):
        return leaf[torch.tensor(rows, dtype=torch.long)]
    return type(leaf)(leaf[i] for i in rows)


class BatchDispatcher:
    """Turns rank 0's stream of loader batches into this rank's slices (see module doc).

    Args:
        num_processes: ranks sharing each global batch.
        process_index: this rank.
        split_batches: one loader batch per step (else ``num_processes`` batches).
        even_batches: complete a short global batch so every rank gets a full slice.

    Attributes:
        remainder: real samples in the last global batch when it was completed, else -1.
    """

    def __init__(
        self,
        num_processes: int,
        process_index: int,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        self.num_processes = num_processes
        self.process_index = process_index
        self.group = 1 if split_batches else num_processes
        self.even_batches = even_batches
        self.remainder = -1

    def __len__(self) -> int:
        raise TypeError("use steps(n) for the length of a dispatched loader")

    def steps(self, loader_batches: int) -> int:
        """Steps of an epoch whose unprepared loader has ``loader_batches`` batches."""
        return math.ceil(loader_batches / self.group)

    def slice(self, batch: Any) -> Any:
        """This rank's rows of a global ``batch`` (None when it gets no rows)."""
        leaves = _leaves(batch)
        if not leaves:
            raise TypeError(
                f"dispatch_batches cannot split a batch of type {type(batch).__name__}: "
                "collate batches into tensors, lists or dicts/tuples of them."
            )
        n, p, r = len(leaves[0]), self.num_processes, self.process_index
        width = math.ceil(n / p)
        rows = list(range(r * width, min((r + 1) * width, n)))
        if self.even_batches and n % p:
            self.remainder = n  # rank-major: the first n gathered samples are the real ones
            rows = [i % n for i in range(r * width, (r + 1) * width)]
        if not rows:
            return None
        return _map(lambda leaf: _take(leaf, rows), batch)

    def stream(self, open_source: Callable[[], Iterable[Any]], consume: int = 0) -> Iterator[Any]:
        """Yield this rank's slices; ``open_source()`` is called on rank 0 only.

        A collective: every rank must iterate it to the end. ``consume`` global steps
        are skipped first (resuming mid-epoch).
        """
        self.remainder = -1
        source = iter(open_source()) if self.process_index == 0 else None
        for step in itertools.count():
            payload: list[Any] = [None]
            if source is not None:
                batches = list(itertools.islice(source, self.group))
                if batches:
                    payload[0] = _map(_to_cpu, concatenate(batches))
            if dist.is_available() and dist.is_initialized() and self.num_processes > 1:
                dist.broadcast_object_list(payload, src=0)
            if payload[0] is None:
                return
            if step < consume:
                continue
            piece = self.slice(payload[0])
            if piece is not None:
                yield piece


__all__ = ["BatchDispatcher", "concatenate"]
