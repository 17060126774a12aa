"""Small pieces of rebuilding a ``DataLoader``: its keyword arguments, its samplers.

Example:
    >>> from torch.utils.data import BatchSampler, DataLoader, RandomSampler
    >>> inner = RandomSampler(range(4))
    >>> loader = DataLoader(range(4), sampler=BatchSampler(inner, 2, False), batch_size=None)
    >>> any(s is inner for s in samplers_of(loader.sampler))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler


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
    on every rank and in every run (``set_epoch(e)`` picks the epoch).

    Example:
        >>> a, b = SeedableRandomSampler(range(5)), SeedableRandomSampler(range(5))
        >>> list(a) == list(b)
        True
    """

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = 0
        self.initial_seed = 0 if data_seed is None else int(data_seed)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)


__all__ = ["FirstItem", "SeedableRandomSampler", "loader_kwargs", "samplers_of"]
