"""``ParallelismConfig`` at the path scripts know from ``accelerate.parallelism_config``.

Names only (see :mod:`nbaccel.runtime.parallel`).

Example:
    >>> ParallelismConfig(dp_shard_size=2, tp_size=2).total_size
    4
"""

from .runtime.parallel.config import (
    ParallelismConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)

__all__ = ["ParallelismConfig", "TorchContextParallelConfig", "TorchTensorParallelConfig"]
