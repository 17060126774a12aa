"""Sharded, device-placing, resumable dataloaders.

``prepare_data_loader`` rebuilds a ``torch.utils.data.DataLoader`` so that every
process reads its own share. It wraps the loader's *batch sampler*, so any
sampler or batch sampler works (not only ``DistributedSampler``; the index
arithmetic lives in :mod:`nbaccel.runtime.loading.sharding`):

* ``split_batches=False``: batch ``i`` of the original loader goes to rank
  ``i % num_processes`` (the global batch is ``num_processes x batch_size``).
* ``split_batches=True``: every original batch is cut into ``num_processes`` slices.
* ``even_batches=True``: the last round is completed with samples from the start of
  the epoch so every rank sees the same number (and size) of batches; the loader
  records how many samples of that round are real so ``gather_for_metrics`` can
  drop the duplicates.
* Random numbers follow Accelerate's, draw for draw (see :mod:`._epoch_rng`): on more
  than one process a generator-less sampler gets a generator seeded once at prepare
  from the global stream, copied from rank 0 at every iteration and running on across
  epochs; with ``use_seedable_sampler`` a ``RandomSampler`` is shuffled by
  ``seed + epoch``; each iteration draws its base seed from the global stream (or the
  loader's ``generator``). The epoch advances when an iteration ends.
* Resume is exact: a state saved mid-epoch holds the generators' states and the global
  RNG state of the epoch's start, and the resumed iteration replays that start from them.

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
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
)

from ...errors import ConfigError
from ..collectives.tree import send_to_device
from ..process.rng import synchronize_generators, synchronize_rng_states
from ._epoch_rng import FetchLog, LoaderProgress, plan_epoch_draws
from ._loader_parts import FirstItem, SeedableRandomSampler, SkipBatches, loader_kwargs, sampler_rng
from ._loader_state import ResumableLoader
from .dispatch import BatchDispatcher
from .sharding import BatchSamplerShard, IterableDatasetShard

_END = object()


class PreparedDataLoader(ResumableLoader, DataLoader):
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
        synced: Sequence[torch.Generator] = (),
        global_seeded: Sequence[RandomSampler] = (),
        seedable: SeedableRandomSampler | None = None,
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
            synced=tuple(synced),
            global_seeded=tuple(global_seeded),
            seedable=seedable,
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
        # the samplers' generators (the user's, or the one prepare gave a generator-less
        # sampler on several processes): copied from rank 0 at every iteration when
        # rng_types has "generator", and saved with the loader's state
        self._synced = tuple(synced)
        # generator-less RandomSamplers left to draw their seed from the global stream
        # (one process, or dispatch_batches): nbaccel makes that draw for them
        self._global_seeded = tuple(global_seeded)
        self._seedable = seedable  # use_seedable_sampler: shuffled by (initial seed + epoch)
        self._dispatcher = dispatcher  # dispatch_batches: rank 0 reads, the ranks get slices
        self.progress = progress if progress is not None else LoaderProgress()
        self._skip_once = skip_once
        self.end_of_dataloader = False
        self._base_generator: torch.Generator | None = None  # this iteration's base seed

    # -- epochs, RNG and resume ----------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.progress.epoch

    @property
    def iteration(self) -> int:
        """Accelerate's name: the epoch the next iteration uses."""
        return self.progress.next_epoch

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

    def _set_epoch_everywhere(self, epoch: int) -> None:
        shard = self._shard
        inner = getattr(shard, "batch_sampler", None)
        seen: set[int] = set()
        for target in (inner, getattr(inner, "sampler", None), self._seedable, self.dataset):
            if target is not None and id(target) not in seen and hasattr(target, "set_epoch"):
                seen.add(id(target))
                target.set_epoch(epoch)

    def _start_epoch(self) -> None:
        """What Accelerate's loader does when an iteration starts, draw for draw."""
        p = self.progress
        if "generator" in self.rng_types:
            synchronize_generators(self._synced)
        synchronize_rng_states(self.rng_types)
        self._set_epoch_everywhere(p.epoch)
        p.generator_states = [g.get_state() for g in self._synced]
        replay, p.replay_rng = p.replay_rng, None
        reads = self._dispatcher is None or self._dispatcher.process_index == 0
        # persistent workers keep their iterator (and its base seed) across epochs
        reuses = self.persistent_workers and self.num_workers > 0 and self._iterator is not None
        base = self.generator is None and not reuses
        # the samplers draw at the first batch: on the reading rank, or while prefetching
        samplers = len(self._global_seeded) if reads or self.num_workers > 0 else 0
        self._base_generator, seeds, p.rng_at_start = plan_epoch_draws(
            base=base, samplers=samplers, replay=replay
        )
        for sampler, seed in zip(self._global_seeded, seeds, strict=False):
            sampler.generator = torch.Generator()
            sampler.generator.manual_seed(seed)

    def _open(self) -> Iterator[Any]:
        """The plain loader's iterator, its base seed drawn as the epoch's plan says."""
        base, self._base_generator = self._base_generator, None
        if base is None:
            return DataLoader.__iter__(self)
        own, self.generator = self.generator, base
        try:
            return DataLoader.__iter__(self)
        finally:
            self.generator = own

    # -- iteration ------------------------------------------------------------------------

    def __len__(self) -> int:
        full = super().__len__()
        if self._dispatcher is not None:
            full = self._dispatcher.steps(full)
        return max(full - (self._skip_once or 0), 0)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        p = self.progress
        p.epoch = p.next_epoch
        skip = p.pending_skip if self._skip_once is None else self._skip_once
        p.pending_skip, self._skip_once = 0, None
        p.batches_yielded, p.in_progress, p.at_end = skip, True, False
        self.end_of_dataloader = False
        return self._iterate(skip)

    def _iterate(self, skip: int) -> Iterator[Any]:
        # a generator: like Accelerate's, nothing is drawn or synchronised before next()
        p, state = self.progress, self.gradient_state
        self._start_epoch()
        consume = skip
        if isinstance(self._shard, BatchSamplerShard) and self._dispatcher is None:
            self._shard.skip, consume = skip, 0  # skip indices, not loaded batches
        replay, p.replay_fetch, p.lookahead = p.replay_fetch, None, None
        feeds: list[FetchLog] = []

        def feed() -> FetchLog:
            feeds.append(FetchLog(self._open(), start=skip - consume, replay=replay))
            return feeds[0]

        if state is not None:
            state.enter(self)
        try:
            if self._dispatcher is not None:
                batches = iter(self._dispatcher.stream(feed, consume))
            else:
                batches = itertools.islice(feed(), consume, None)
            last, batch = False, next(batches, _END)
            while batch is not _END:
                mark = feeds[0].count if feeds else 0
                ahead = next(batches, _END)  # read one ahead, to know the last batch
                last = self.end_of_dataloader = p.at_end = ahead is _END
                if feeds:
                    p.lookahead = None if last else feeds[0].lookahead(mark)
                if self.device is not None:
                    batch = send_to_device(batch, self.device, self.non_blocking)
                p.batches_yielded += 1  # counted before the step runs: a checkpoint taken
                yield batch  # inside the step resumes *after* this batch
                batch = ahead
            p.in_progress = False
            p.next_epoch += 1
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
    use_seedable_sampler: bool = False,
) -> PreparedDataLoader:
    """Return a :class:`PreparedDataLoader` reading this rank's share of ``dataloader``.

    Random numbers as Accelerate's ``prepare_data_loader``: on several processes (without
    ``dispatch_batches``) a generator-less sampler gets a generator seeded with one draw
    from the global stream, copied from rank 0 at every iteration; ``use_seedable_sampler``
    shuffles a ``RandomSampler`` by ``data_seed`` (default ``torch.initial_seed()``) +
    epoch. With ``dispatch_batches`` only rank 0 reads the data and every rank gets its
    slice of each global batch (see :mod:`nbaccel.runtime.loading.dispatch`).

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
            even_batches and num_processes > 1,  # one process: a plain loader's last batch
            seed_generator=num_processes > 1,
        )
        own = getattr(dataset, "generator", None)  # Accelerate keeps it in step across ranks
        synced = [own] if isinstance(own, torch.Generator) and num_processes > 1 else []
        return PreparedDataLoader(
            dataset, shard=shard, synced=synced, collate_fn=collate, **common, **kwargs
        )
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
    seedable, global_seeded, synced = sampler_rng(
        dataloader,
        batch_sampler,
        several=num_processes > 1 and dispatcher is None,
        use_seedable_sampler=use_seedable_sampler,
        data_seed=data_seed,
    )
    return PreparedDataLoader(
        dataset,
        shard=shard,
        synced=synced,
        global_seeded=global_seeded,
        seedable=seedable,
        progress=LoaderProgress(seed=None if seedable is None else seedable.initial_seed),
        collate_fn=collate,
        **common,
        **kwargs,
    )


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
        batch_sampler=SkipBatches(dataloader.batch_sampler, num_batches),
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
