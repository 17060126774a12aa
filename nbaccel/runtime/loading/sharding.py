"""Sharding any batch sampler or iterable dataset across processes.

The pure index arithmetic behind :mod:`nbaccel.runtime.loading.data`: which batches (or which
slices of every batch) each rank reads, and how the last round is completed so
every rank sees as many batches as the others (``even_batches``).

Example:
    >>> from torch.utils.data import BatchSampler, SequentialSampler
    >>> batches = BatchSampler(SequentialSampler(range(10)), batch_size=4, drop_last=False)
    >>> list(BatchSamplerShard(batches, num_processes=2, process_index=1))
    [[4, 5, 6, 7], [2, 3, 4, 5]]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch.utils.data import IterableDataset, Sampler

from ...errors import ConfigError

T = TypeVar("T")


def _with_last(iterable: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Yield ``(item, is_last)``, looking one item ahead."""
    it = iter(iterable)
    try:
        previous = next(it)
    except StopIteration:
        return
    for item in it:
        yield previous, False
        previous = item
    yield previous, True


def _fill(items: list[Any], pool: Sequence[Any], size: int) -> list[Any]:
    """``items`` completed to ``size`` by cycling through ``pool`` (the epoch's first samples)."""
    out = list(items)
    if not pool:
        return out
    for extra in itertools.cycle(pool):
        if len(out) >= size:
            break
        out.append(extra)
    return out


class BatchSamplerShard(Sampler[list[int]]):
    """This rank's batches of another batch sampler (see the module docstring).

    Args:
        batch_sampler: any iterable of index lists (``BatchSampler`` or custom).
        num_processes: ranks sharing the data.
        process_index: this rank.
        split_batches: slice every batch across ranks instead of dealing whole batches.
        even_batches: wrap around so every rank gets as many (and as large) batches.

    Attributes:
        remainder: real samples in the last round (rank-major), or -1 if no samples
            were duplicated this epoch.
    """

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size: int | None = getattr(batch_sampler, "batch_size", None)
        self.drop_last: bool = bool(getattr(batch_sampler, "drop_last", False))
        self.remainder = -1
        self.skip = 0  # batches of *this rank* to skip in the next iteration only
        if split_batches and self.batch_size is not None and self.batch_size % num_processes:
            suggestion = max(self.batch_size // num_processes, 1) * num_processes
            raise ConfigError(
                f"split_batches=True with batch_size={self.batch_size} and {num_processes} "
                "processes: the batch size is the global one and must be a multiple of the "
                f"process count. Use batch_size={suggestion} or split_batches=False."
            )

    def __len__(self) -> int:
        n = len(self.batch_sampler)  # type: ignore[arg-type]
        p, r = self.num_processes, self.process_index
        if self.split_batches:
            return n - (0 if self.even_batches else self._short_last_piece(n))
        if self.drop_last:
            return n // p
        if self.even_batches:
            return math.ceil(n / p)
        return n // p + (1 if r < n % p else 0)

    def _short_last_piece(self, n: int) -> int:
        """1 if (split, uneven) this rank gets no slice of a short last batch, else 0."""
        sampler = getattr(self.batch_sampler, "sampler", None)
        if n == 0 or not self.batch_size or self.drop_last or not hasattr(sampler, "__len__"):
            return 0
        last = len(sampler) % self.batch_size or self.batch_size  # type: ignore[arg-type]
        width = math.ceil(last / self.num_processes)
        return 0 if self.process_index * width < last else 1

    def __iter__(self) -> Iterator[list[int]]:
        self.remainder = -1
        skip, self.skip = self.skip, 0
        batches = self._split() if self.split_batches else self._deal()
        return itertools.islice(batches, skip, None)

    def _deal(self) -> Iterator[list[int]]:
        p, r, size = self.num_processes, self.process_index, self.batch_size
        first_samples: list[int] = []  # the epoch's first samples, to wrap around with
        first_batches: list[list[int]] = []
        round_: list[list[int]] = []
        for batch, last in _with_last(self.batch_sampler):
            batch = list(batch)
            if size and len(first_samples) < p * size:
                first_samples.extend(batch)
            if len(first_batches) < p:
                first_batches.append(batch)
            round_.append(batch)
            if len(round_) < p:
                continue
            complete = not last or not size or all(len(b) == size for b in round_)
            if complete or not self.even_batches:
                yield round_[r]
                round_ = []
        if not round_ or self.drop_last:
            return
        if not self.even_batches:
            if r < len(round_):
                yield round_[r]
            return
        if size:  # flatten the last round, complete it, deal equal batches
            flat = [i for b in round_ for i in b]
            self.remainder = len(flat)
            flat = _fill(flat, first_samples, p * size)
            yield flat[r * size : (r + 1) * size]
            return
        self.remainder = sum(len(b) for b in round_)  # unknown batch size: lend whole batches
        k = len(round_)
        yield round_[r] if r < k else first_batches[(r - k) % len(first_batches)]

    def _split(self) -> Iterator[list[int]]:
        p, r, size = self.num_processes, self.process_index, self.batch_size
        first_samples: list[int] = []
        for batch, last in _with_last(self.batch_sampler):
            batch = list(batch)
            if len(first_samples) < (size or len(batch)):
                first_samples.extend(batch)
            target = len(batch)
            if last and size and len(batch) < size:
                target = size
            if len(batch) % p:
                target = max(target, math.ceil(len(batch) / p) * p)
            if target > len(batch) and self.even_batches:
                if last:
                    self.remainder = len(batch)
                batch = _fill(batch, first_samples, target)
            width = math.ceil(len(batch) / p)
            piece = batch[r * width : (r + 1) * width]
            if piece:
                yield piece


class IterableDatasetShard(IterableDataset):
    """This rank's share of an ``IterableDataset``, read in rounds of ``chunk`` samples.

    With ``split_batches=False`` a round is ``num_processes * batch_size`` samples and
    rank ``r`` takes the ``r``-th ``batch_size``; with ``split_batches=True`` a round
    is ``batch_size`` samples cut in ``num_processes`` slices. With ``num_workers > 0``
    each worker reads its own copy of the dataset, as with a plain ``DataLoader`` (and
    Accelerate): a dataset splits itself between workers with ``get_worker_info()``.
    """

    def __init__(
        self,
        dataset: Iterable[Any],
        batch_size: int,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
        seed_generator: bool = False,
    ) -> None:
        if split_batches and batch_size % num_processes:
            raise ConfigError(
                f"split_batches=True needs batch_size ({batch_size}) to be a multiple of the "
                f"process count ({num_processes})."
            )
        self.dataset = dataset
        self.per_rank = batch_size // num_processes if split_batches else batch_size
        self.chunk = self.per_rank * num_processes
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.even_batches = even_batches
        self.remainder = -1
        # Accelerate's sharded iterable: a dataset without set_epoch but with a torch
        # `generator` has it seeded with the epoch number at every iteration
        self.seed_generator = seed_generator
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        total = len(self.dataset)  # type: ignore[arg-type]
        rounds, tail = divmod(total, self.chunk)
        mine = rounds * self.per_rank
        if tail and not self.drop_last:
            if self.even_batches:
                mine += self.per_rank
            else:
                mine += min(max(tail - self.process_index * self.per_rank, 0), self.per_rank)
        return mine

    def _mine(self, samples: list[Any]) -> list[Any]:
        lo = self.process_index * self.per_rank
        return samples[lo : lo + self.per_rank]

    def __iter__(self) -> Iterator[Any]:
        own = getattr(self.dataset, "generator", None)
        seeds = self.seed_generator and not hasattr(self.dataset, "set_epoch")
        if seeds and isinstance(own, torch.Generator):
            own.manual_seed(self.epoch)
        self.remainder = -1
        first: list[Any] = []
        buffer: list[Any] = []
        for sample in self.dataset:
            if len(first) < self.chunk:
                first.append(sample)
            buffer.append(sample)
            if len(buffer) == self.chunk:
                yield from self._mine(buffer)
                buffer = []
        if not buffer or self.drop_last:
            return
        if self.even_batches:
            self.remainder = len(buffer)
            buffer = _fill(buffer, first, self.chunk)
        yield from self._mine(buffer)


__all__ = ["BatchSamplerShard", "IterableDatasetShard"]
