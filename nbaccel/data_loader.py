"""Dataloader helpers at the path scripts know from ``accelerate.data_loader``.

Names only: :func:`prepare_data_loader` (the peer's positional signature) and
:func:`skip_first_batches`; nbaccel's own prepared loader is
:class:`~nbaccel.runtime.data.PreparedDataLoader`.

Example:
    >>> from torch.utils.data import DataLoader
    >>> [b.tolist() for b in prepare_data_loader(DataLoader(range(4), batch_size=2))]
    [[0, 1], [2, 3]]
"""

from .runtime.compat import prepare_data_loader
from .runtime.data import PreparedDataLoader, skip_first_batches

__all__ = ["PreparedDataLoader", "prepare_data_loader", "skip_first_batches"]
