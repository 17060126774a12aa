"""Sharded, device-placing, resumable dataloaders.

``prepare_data_loader`` rebuilds a ``torch.utils.data.DataLoader`` so that every
process reads its own share. It wraps the loader's *batch sampler*, so any
sampler or batch sampler works (not only ``DistributedSampler``):

* ``split_batches=False``: batch ``i`` of the original loader goes to rank
  ``i % num_processes`` (the global batch is ``num_processes x batch_size``).
* ``split_batches=True``: every original batch is cut into ``num_processes`` slices.
* ``even_batches=True``: the last round is completed with samples from the start of
  the epoch so every rank sees the same number (and size) of batches; the loader
  records how many samples of that round are real so ``gather_for_metrics`` can
  drop the duplicates.
* Shuffling is identical on every rank: samplers with a ``generator`` get one seeded
  with ``seed + epoch`` (the seed is agreed through the process group at prepare
  time), and the epoch advances automatically at every new iteration.

Example:
    >>> import torch
    >>> from torch.utils.data import DataLoader
    >>> loader = DataLoader(list(range(10)), batch_size=4)
    >>> shard = prepare_data_loader(loader, num_processes=2, process_index=1)
    >>> [b.tolist() for b in shard]      # rank 1: batches 1 and (wrapped) 3
    [[4, 5, 6, 7], [2, 3, 4, 5]]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    Sampler,
)

from .errors import ConfigError
from .ops import send_to_device
from .rng import agree_on_seed, synchronize_rng_states

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
    is ``batch_size`` samples cut in ``num_processes`` slices. DataLoader workers take
    alternate rounds, so ``num_workers > 0`` does not duplicate data.
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

    def set_epoch(self, epoch: int) -> None:
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
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        self.remainder = -1
        first: list[Any] = []
        buffer: list[Any] = []
        rounds = 0
        for sample in self.dataset:
            if len(first) < self.chunk:
                first.append(sample)
            buffer.append(sample)
            if len(buffer) == self.chunk:
                if rounds % workers == worker:
                    yield from self._mine(buffer)
                buffer, rounds = [], rounds + 1
        if not buffer or self.drop_last or rounds % workers != worker:
            return
        if self.even_batches:
            self.remainder = len(buffer)
            buffer = _fill(buffer, first, self.chunk)
        yield from self._mine(buffer)


@dataclass
class LoaderProgress:
    """Epoch and position of a prepared loader; shared with its ``skip_first_batches`` views."""

    seed: int | None = None
    epoch: int = 0  # epoch of the current (or last) iteration
    next_epoch: int = 0
    batches_yielded: int = 0
    in_progress: bool = False
    pending_skip: int = 0


class _FirstItem:
    """collate for ``batch_size=None`` loaders: every 'batch' holds exactly one sample."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, batch: list[Any]) -> Any:
        return self.collate(batch[0])


class PreparedDataLoader(DataLoader):
    """A ``DataLoader`` that reads this rank's shard, moves batches to the device and resumes.

    Built by :func:`prepare_data_loader`; iterate it like the original. Extra API:
    ``set_epoch(e)``, ``state_dict()``, ``load_state_dict(d)``, ``end_of_dataloader``,
    ``remainder``.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        shard: BatchSamplerShard | IterableDatasetShard,
        device: torch.device | None = None,
        non_blocking: bool = False,
        gradient_state: Any = None,
        rng_types: Sequence[str] = (),
        seeded: Sequence[Any] = (),
        progress: LoaderProgress | None = None,
        skip_once: int | None = None,
        **loader_kwargs: Any,
    ) -> None:
        if isinstance(shard, BatchSamplerShard):
            super().__init__(dataset, batch_sampler=shard, **loader_kwargs)
        else:
            super().__init__(shard, batch_size=shard.per_rank, **loader_kwargs)
        self._shard = shard
        self._rebuild = dict(
            dataset=dataset,
            shard=shard,
            device=device,
            non_blocking=non_blocking,
            gradient_state=gradient_state,
            rng_types=tuple(rng_types),
            seeded=tuple(seeded),
            **loader_kwargs,
        )
        self.device = device
        self.non_blocking = non_blocking
        self.gradient_state = gradient_state
        self.rng_types = tuple(rng_types)
        self._seeded = tuple(seeded)  # samplers whose generator we seed per epoch
        self._generators: dict[int, torch.Generator] = {}
        self.progress = progress if progress is not None else LoaderProgress()
        self._skip_once = skip_once
        self.end_of_dataloader = False
        # Each DataLoader iterator draws a base seed from `generator`, else from the global
        # torch RNG. A private one, seeded per epoch, keeps the global stream (dropout, which
        # load_state restores) the same in a resumed run as in an uninterrupted one.
        self._own_generator: torch.Generator | None = None
        if self.generator is None:
            self._own_generator = self.generator = torch.Generator()

    # -- epochs, RNG and resume ----------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.progress.epoch

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration (it advances by itself after each one)."""
        self.progress.next_epoch = int(epoch)

    @property
    def remainder(self) -> int:
        """Real samples in the final round (rank-major), or -1 when none were duplicated."""
        shard = self._shard
        if isinstance(shard, IterableDatasetShard) and self.num_workers > 0:
            try:
                total = len(shard.dataset)  # type: ignore[arg-type]
            except TypeError:
                return -1
            tail = total % shard.chunk
            return tail if tail and shard.even_batches and not shard.drop_last else -1
        return shard.remainder

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "batches_yielded", "seed"}``: where the next iteration should resume."""
        p = self.progress
        if p.in_progress:
            return {"epoch": p.epoch, "batches_yielded": p.batches_yielded, "seed": p.seed}
        return {"epoch": p.next_epoch, "batches_yielded": 0, "seed": p.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration replays ``epoch``'s order and skips the seen batches."""
        p = self.progress
        p.next_epoch = int(state.get("epoch", 0))
        p.pending_skip = int(state.get("batches_yielded", 0))
        if state.get("seed") is not None:
            p.seed = int(state["seed"])

    def _seed_epoch(self, epoch: int) -> None:
        if self._own_generator is not None:
            self._own_generator.manual_seed((self.progress.seed or 0) + epoch)
        for target in self._seeded:
            if self.progress.seed is not None and hasattr(target, "generator"):
                gen = target.generator
                if gen is None:
                    gen = self._generators.setdefault(id(target), torch.Generator())
                    target.generator = gen
                gen.manual_seed(self.progress.seed + epoch)
        shard = self._shard
        inner = getattr(shard, "batch_sampler", None)
        seen: set[int] = set()
        for target in (inner, getattr(inner, "sampler", None), *self._seeded, self.dataset):
            if target is not None and id(target) not in seen and hasattr(target, "set_epoch"):
                seen.add(id(target))
                target.set_epoch(epoch)

    # -- iteration ------------------------------------------------------------------------

    def __len__(self) -> int:
        full = super().__len__()
        return max(full - (self._skip_once or 0), 0)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        p = self.progress
        p.epoch, p.next_epoch = p.next_epoch, p.next_epoch + 1
        skip = p.pending_skip if self._skip_once is None else self._skip_once
        p.pending_skip, self._skip_once = 0, None
        self._seed_epoch(p.epoch)
        synchronize_rng_states(self.rng_types)
        consume = skip
        if isinstance(self._shard, BatchSamplerShard):  # skip indices, not loaded batches
            self._shard.skip, consume = skip, 0
        p.batches_yielded, p.in_progress = skip, True
        self.end_of_dataloader = False
        return self._iterate(consume)

    def _iterate(self, consume: int) -> Iterator[Any]:
        p, state = self.progress, self.gradient_state
        if state is not None:
            state.enter(self)
        try:
            batches = itertools.islice(super().__iter__(), consume, None)
            for batch, last in _with_last(batches):
                self.end_of_dataloader = last
                if self.device is not None:
                    batch = send_to_device(batch, self.device, self.non_blocking)
                p.batches_yielded += 1  # counted before the step runs: a checkpoint taken
                yield batch  # inside the step resumes *after* this batch
            p.in_progress = False
        finally:
            if state is not None:
                state.exit(self)

    def with_skip(self, num_batches: int) -> PreparedDataLoader:
        """A view whose next iteration skips ``num_batches`` (shares epoch/seed progress)."""
        return PreparedDataLoader(progress=self.progress, skip_once=num_batches, **self._rebuild)


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if getattr(loader, "pin_memory_device", ""):
        kwargs["pin_memory_device"] = loader.pin_memory_device
    if getattr(loader, "in_order", True) is False:
        kwargs["in_order"] = False
    return kwargs


def prepare_data_loader(
    dataloader: DataLoader,
    *,
    num_processes: int = 1,
    process_index: int = 0,
    split_batches: bool = False,
    even_batches: bool = True,
    device: torch.device | None = None,
    non_blocking: bool = False,
    gradient_state: Any = None,
    rng_types: Sequence[str] = ("generator",),
) -> PreparedDataLoader:
    """Return a :class:`PreparedDataLoader` reading this rank's share of ``dataloader``.

    A collective when ``num_processes > 1`` (the shuffle seed is agreed through the group).

    Raises:
        TypeError: ``dataloader`` is not a ``torch.utils.data.DataLoader``.
        ConfigError: ``split_batches`` with a batch size that is not a multiple of
            ``num_processes``, or with ``batch_size=None``.
    """
    if isinstance(dataloader, PreparedDataLoader):
        return dataloader
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"expected a torch DataLoader, got {type(dataloader).__name__}.")
    kwargs = _loader_kwargs(dataloader)
    collate = dataloader.collate_fn
    common = dict(
        device=device, non_blocking=non_blocking, gradient_state=gradient_state, rng_types=rng_types
    )
    dataset = dataloader.dataset
    if isinstance(dataset, IterableDataset):
        if dataloader.batch_size is None:
            raise ConfigError(
                "prepare() of an IterableDataset loader with batch_size=None is not supported: "
                "pass batch_size=... to the DataLoader (nbaccel shards by batches)."
            )
        shard: BatchSamplerShard | IterableDatasetShard = IterableDatasetShard(
            dataset,
            dataloader.batch_size,
            dataloader.drop_last,
            num_processes,
            process_index,
            split_batches,
            even_batches,
        )
        return PreparedDataLoader(dataset, shard=shard, collate_fn=collate, **common, **kwargs)
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:  # batch_size=None: one sample per "batch"
        if split_batches:
            raise ConfigError("split_batches=True needs a DataLoader with a batch_size.")
        batch_sampler = BatchSampler(dataloader.sampler, 1, False)
        collate = _FirstItem(collate)
    inner_sampler = getattr(batch_sampler, "sampler", dataloader.sampler)
    already_sharded = isinstance(inner_sampler, DistributedSampler)
    procs, index = (1, 0) if already_sharded else (num_processes, process_index)
    shard = BatchSamplerShard(batch_sampler, procs, index, split_batches, even_batches)
    seeded: list[Any] = []
    if "generator" in rng_types:
        for candidate in (batch_sampler, inner_sampler, dataloader.sampler):
            if hasattr(candidate, "generator") and all(candidate is not s for s in seeded):
                seeded.append(candidate)
    seed = None
    if seeded:
        user_generator = next((s.generator for s in seeded if s.generator is not None), None)
        seed = agree_on_seed(user_generator)
    return PreparedDataLoader(
        dataset,
        shard=shard,
        seeded=seeded,
        progress=LoaderProgress(seed=seed),
        collate_fn=collate,
        **common,
        **kwargs,
    )


class _SkipBatches(Sampler[list[int]]):
    def __init__(self, batch_sampler: Iterable[list[int]], skip: int) -> None:
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip, 0)  # type: ignore[arg-type]


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """A loader that skips the first ``num_batches`` batches (to resume mid-epoch).

    For a prepared loader the skip applies to its *next* iteration only and replaces
    any skip pending from ``load_state``; the epoch/seed progress is shared with the
    original, so keep iterating the original afterwards. A plain ``DataLoader`` gets a
    copy that skips on every iteration.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> [b.tolist() for b in skip_first_batches(DataLoader(range(6), batch_size=2), 2)]
        [[4, 5]]
    """
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise ValueError(f"skip_first_batches(num_batches={num_batches!r}): use an int >= 0.")
    if isinstance(dataloader, PreparedDataLoader):
        return dataloader.with_skip(num_batches)
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"skip_first_batches needs a DataLoader, got {type(dataloader).__name__}.")
    if isinstance(dataloader.dataset, IterableDataset) or dataloader.batch_sampler is None:
        raise TypeError(
            "skip_first_batches on an unprepared IterableDataset/batch_size=None loader is not "
            "supported: prepare() it first (accelerator.prepare(loader))."
        )
    return DataLoader(
        dataloader.dataset,
        batch_sampler=_SkipBatches(dataloader.batch_sampler, num_batches),
        collate_fn=dataloader.collate_fn,
        **_loader_kwargs(dataloader),
    )


__all__ = [
    "BatchSamplerShard",
    "IterableDatasetShard",
    "LoaderProgress",
    "PreparedDataLoader",
    "prepare_data_loader",
    "skip_first_batches",
]
