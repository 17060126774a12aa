"""Sharded, device-placing, resumable dataloaders.

``prepare_data_loader`` rebuilds a ``torch.utils.data.DataLoader`` so that every
process reads its own share. It wraps the loader's *batch sampler*, so any
sampler or batch sampler works (not only ``DistributedSampler``; the index
arithmetic lives in :mod:`nbaccel.runtime.sharding`):

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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    Sampler,
)

from ..errors import ConfigError
from ._loader_parts import FirstItem, loader_kwargs, samplers_of
from .dispatch import BatchDispatcher
from .rng import agree_on_seed, synchronize_generators, synchronize_rng_states
from .sharding import BatchSamplerShard, IterableDatasetShard, _with_last
from .tree import send_to_device


@dataclass
class LoaderProgress:
    """Epoch and position of a prepared loader; shared with its ``skip_first_batches`` views."""

    seed: int | None = None
    # the user generators' states at the start of the current iteration (to replay it)
    generator_states: list[torch.Tensor] | None = None
    epoch: int = 0  # epoch of the current (or last) iteration
    next_epoch: int = 0
    batches_yielded: int = 0
    in_progress: bool = False
    pending_skip: int = 0


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
        synced: Sequence[torch.Generator] = (),
        dispatcher: BatchDispatcher | None = None,
        progress: LoaderProgress | None = None,
        skip_once: int | None = None,
        use_stateful_dataloader: bool = False,
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
            synced=tuple(synced),
            dispatcher=dispatcher,
            use_stateful_dataloader=use_stateful_dataloader,
            **loader_kwargs,
        )
        # load_state restores the position inside the epoch only for stateful loaders
        self.use_stateful_dataloader = use_stateful_dataloader
        self.device = device
        self.non_blocking = non_blocking
        self.gradient_state = gradient_state
        self.rng_types = tuple(rng_types)
        self._seeded = tuple(seeded)  # samplers whose generator we seed per epoch
        # the user's own generators: left alone (so the order is the unprepared loader's),
        # but copied from rank 0 at every iteration so every rank draws the same order
        self._synced = tuple(synced)
        self._dispatcher = dispatcher  # dispatch_batches: rank 0 reads, the ranks get slices
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
        if self._dispatcher is not None:
            return self._dispatcher.remainder
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
        state: dict[str, Any]
        if p.in_progress:
            state = {"epoch": p.epoch, "batches_yielded": p.batches_yielded, "seed": p.seed}
            generators = p.generator_states
        else:
            state = {"epoch": p.next_epoch, "batches_yielded": 0, "seed": p.seed}
            generators = [g.get_state() for g in self._synced]
        if generators:
            state["generator_states"] = [g.clone() for g in generators]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration replays ``epoch``'s order and skips the seen batches."""
        p = self.progress
        p.next_epoch = int(state.get("epoch", 0))
        p.pending_skip = int(state.get("batches_yielded", 0))
        if state.get("seed") is not None:
            p.seed = int(state["seed"])
        for generator, saved in zip(
            self._synced, state.get("generator_states") or (), strict=False
        ):
            generator.set_state(saved)

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
        if self._dispatcher is not None:
            full = self._dispatcher.steps(full)
        return max(full - (self._skip_once or 0), 0)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        p = self.progress
        p.epoch, p.next_epoch = p.next_epoch, p.next_epoch + 1
        skip = p.pending_skip if self._skip_once is None else self._skip_once
        p.pending_skip, self._skip_once = 0, None
        self._seed_epoch(p.epoch)
        synchronize_generators(self._synced)
        p.generator_states = [g.get_state() for g in self._synced]
        synchronize_rng_states(self.rng_types)
        consume = skip
        if isinstance(self._shard, BatchSamplerShard) and self._dispatcher is None:
            # skip indices, not loaded batches
            self._shard.skip, consume = skip, 0
        p.batches_yielded, p.in_progress = skip, True
        self.end_of_dataloader = False
        return self._iterate(consume)

    def _iterate(self, consume: int) -> Iterator[Any]:
        p, state = self.progress, self.gradient_state
        if state is not None:
            state.enter(self)
        try:
            if self._dispatcher is not None:
                batches = self._dispatcher.stream(super().__iter__, consume)
            else:
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
    dispatch_batches: bool = False,
    data_seed: int | None = None,
    use_stateful_dataloader: bool = False,
) -> PreparedDataLoader:
    """Return a :class:`PreparedDataLoader` reading this rank's share of ``dataloader``.

    A collective when ``num_processes > 1`` (the shuffle seed is agreed through the group).
    With ``dispatch_batches`` only rank 0 reads the data and every rank gets its slice of
    each global batch (see :mod:`nbaccel.runtime.dispatch`).

    Raises:
        TypeError: ``dataloader`` is not a ``torch.utils.data.DataLoader``.
        ConfigError: ``split_batches`` with a batch size that is not a multiple of
            ``num_processes``, or with ``batch_size=None``.
    """
    if isinstance(dataloader, PreparedDataLoader):
        return dataloader
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"expected a torch DataLoader, got {type(dataloader).__name__}.")
    kwargs = loader_kwargs(dataloader)
    collate = dataloader.collate_fn
    common: dict[str, Any] = dict(
        device=device,
        non_blocking=non_blocking,
        gradient_state=gradient_state,
        rng_types=rng_types,
        use_stateful_dataloader=use_stateful_dataloader,
    )
    dataset = dataloader.dataset
    dispatcher = None
    if dispatch_batches and num_processes > 1:  # rank 0 reads everything, unsharded
        dispatcher = BatchDispatcher(num_processes, process_index, split_batches, even_batches)
        num_processes, process_index, split_batches, even_batches = 1, 0, False, False
    common["dispatcher"] = dispatcher
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
        collate = FirstItem(collate)
    inner_sampler = getattr(batch_sampler, "sampler", dataloader.sampler)
    already_sharded = isinstance(inner_sampler, DistributedSampler)
    procs, index = (1, 0) if already_sharded else (num_processes, process_index)
    shard = BatchSamplerShard(batch_sampler, procs, index, split_batches, even_batches)
    seeded: list[Any] = []  # samplers without a generator: we give them one, seeded per epoch
    synced: list[torch.Generator] = []  # the user's generators: synchronised from rank 0
    if "generator" in rng_types:
        for candidate in samplers_of(batch_sampler, dataloader.sampler):
            if not hasattr(candidate, "generator"):
                continue
            if candidate.generator is None:
                seeded.append(candidate)
            elif all(candidate.generator is not g for g in synced):
                synced.append(candidate.generator)
        if dataloader.generator is not None and all(dataloader.generator is not g for g in synced):
            synced.append(dataloader.generator)  # it draws the iterators' base seeds
    seed = None
    if seeded:  # an explicit data_seed, else one drawn on rank 0 and shared
        seed = data_seed if data_seed is not None else agree_on_seed()
    return PreparedDataLoader(
        dataset,
        shard=shard,
        seeded=seeded,
        synced=synced,
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
        **loader_kwargs(dataloader),
    )


__all__ = [
    "BatchSamplerShard",
    "IterableDatasetShard",
    "LoaderProgress",
    "PreparedDataLoader",
    "prepare_data_loader",
    "skip_first_batches",
]
