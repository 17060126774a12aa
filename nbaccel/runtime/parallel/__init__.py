"""Accelerate's ``ParallelismConfig``: HSDP, tensor parallel and their ``DeviceMesh``.

* :mod:`.config`: the sizes, their validation, the mesh with Accelerate's names;
* :mod:`.tensor_parallel`: a plan applied on the ``tp`` mesh (torch's parallel styles);
* the strategy (``runtime/strategy/mesh``: ``MeshParallel``), TP then FSDP2 over the data dimensions;
* :mod:`.api`: ``Accelerator(parallelism_config=...)`` checks and attributes.

Example:
    >>> ParallelismConfig(dp_replicate_size=2, dp_shard_size=2).total_size
    4
"""

from __future__ import annotations

from .config import ParallelismConfig, TorchContextParallelConfig, TorchTensorParallelConfig

__all__ = ["ParallelismConfig", "TorchContextParallelConfig", "TorchTensorParallelConfig"]
