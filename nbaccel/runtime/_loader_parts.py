"""Small pieces of rebuilding a ``DataLoader``: its keyword arguments, its samplers.

Example:
    >>> from torch.utils.data import BatchSampler, DataLoader, RandomSampler
    >>> inner = RandomSampler(range(4))
    >>> loader = DataLoader(range(4), sampler=BatchSampler(inner, 2, False), batch_size=None)
    >>> any(s is inner for s in samplers_of(loader.sampler))
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader


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


__all__ = ["FirstItem", "loader_kwargs", "samplers_of"]
