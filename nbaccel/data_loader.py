"""Dataloader names at the path scripts know from ``accelerate.data_loader``.

Names only: :func:`prepare_data_loader` (the peer's positional signature),
:func:`skip_first_batches`, the shard classes and ``SeedableRandomSampler``.
``DataLoaderShard`` and ``DataLoaderDispatcher`` are nbaccel's one prepared loader class,
:class:`~nbaccel.runtime.loading.data.PreparedDataLoader` (``isinstance`` checks work; build
loaders with ``prepare`` rather than with these constructors).

Example:
    >>> from torch.utils.data import DataLoader
    >>> [b.tolist() for b in prepare_data_loader(DataLoader(range(4), batch_size=2))]
    [[0, 1], [2, 3]]
"""

from .runtime.accelerate_utils.compat import prepare_data_loader
from .runtime.loading._loader_parts import SeedableRandomSampler
from .runtime.loading.data import PreparedDataLoader, skip_first_batches
from .runtime.loading.sharding import BatchSamplerShard, IterableDatasetShard

DataLoaderShard = PreparedDataLoader
DataLoaderDispatcher = PreparedDataLoader

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "IterableDatasetShard",
    "PreparedDataLoader",
    "SeedableRandomSampler",
    "prepare_data_loader",
    "skip_first_batches",
]
