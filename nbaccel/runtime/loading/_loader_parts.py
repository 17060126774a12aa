"""Small pieces of rebuilding a ``DataLoader``: its keyword arguments, its samplers.

Example:
    >>> from torch.utils.data import BatchSampler, DataLoader, RandomSampler
    >>> inner = RandomSampler(range(4))
    >>> loader = DataLoader(range(4), sampler=BatchSampler(inner, 2, False), batch_size=None)
    >>> any(s is inner for s in samplers_of(loader.sampler))
    True
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler

from ._epoch_rng import draw_seed


class FirstItem:
    """collate for ``batch_size=None`` loaders: every 'batch' holds exactly one sample."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, batch: list[Any]) -> Any:
        return self.collate(batch[0])


def loader_kwargs(loader: DataLoader) -> dict[str, Any]:
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


def samplers_of(*roots: Any) -> list[Any]:
    """Every sampler reachable through ``.batch_sampler`` / ``.sampler`` (e.g. the
    ``RandomSampler`` inside a ``BatchSampler`` passed as ``sampler=``), each once."""
    found: list[Any] = []
    pending = list(roots)
    while pending and len(found) < 32:
        obj = pending.pop(0)
        if obj is None or any(obj is f for f in found):
            continue
        found.append(obj)
        pending += [getattr(obj, "batch_sampler", None), getattr(obj, "sampler", None)]
    return found


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order depends only on ``(initial_seed, epoch)``: the same
    on every rank and in every run (``set_epoch(e)`` picks the epoch). ``initial_seed`` is
    ``data_seed``, else ``torch.initial_seed()`` (what ``set_seed`` set), as in Accelerate.

    Example:
        >>> a, b = SeedableRandomSampler(range(5)), SeedableRandomSampler(range(5))
        >>> list(a) == list(b)
        True
    """

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = 0
        self.initial_seed = torch.initial_seed() if data_seed is None else int(data_seed)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)


def sampler_rng(
    dataloader: DataLoader,
    batch_sampler: Any,
    *,
    several: bool,
    use_seedable_sampler: bool,
    data_seed: int | None,
) -> tuple[SeedableRandomSampler | None, list[RandomSampler], list[torch.Generator]]:
    """Give the loader's sampler the random numbers Accelerate's ``prepare`` gives it.

    ``several``: more than one process reads its own shard. Returns the seedable sampler
    put in place (``use_seedable_sampler``), the generator-less ``RandomSampler`` samplers
    left to draw their seed from the global stream every epoch, and the generators to keep
    in step across ranks (and in checkpoints).
    """
    # the sampler Accelerate's get_sampler finds: the one inside the (batch) sampler
    holder: Any = dataloader.sampler
    if not isinstance(holder, BatchSampler):
        holder = dataloader.batch_sampler
    main: Any = getattr(holder, "sampler", None)
    seedable = None
    global_seeded: list[RandomSampler] = []
    if use_seedable_sampler and isinstance(main, RandomSampler):
        seedable = SeedableRandomSampler(
            main.data_source,
            replacement=main.replacement,
            num_samples=main._num_samples,
            generator=main.generator,
            data_seed=data_seed,
        )
        holder.sampler = main = seedable
    elif hasattr(main, "generator") and main.generator is None:
        if several:  # seeded once from the global stream, runs on across epochs
            main.generator = torch.Generator()
            main.generator.manual_seed(draw_seed(None))
        elif type(main).__iter__ is RandomSampler.__iter__:  # draws its seed every epoch
            global_seeded.append(main)
    synced: list[torch.Generator] = []  # the samplers' generators: synchronised from rank 0
    for candidate in samplers_of(batch_sampler, dataloader.sampler):
        gen = getattr(candidate, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in synced):
            synced.append(gen)
    if dataloader.generator is not None and all(dataloader.generator is not g for g in synced):
        synced.append(dataloader.generator)  # it draws the iterators' base seeds
    return seedable, global_seeded, synced


class SkipBatches(Sampler[list[int]]):
    def __init__(self, batch_sampler: Iterable[list[int]], skip: int) -> None:
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip, 0)  # type: ignore[arg-type]


__all__ = [
    "FirstItem",
    "SeedableRandomSampler",
    "SkipBatches",
    "loader_kwargs",
    "sampler_rng",
    "samplers_of",
]
