"""nbaccel: run an ordinary PyTorch training function on every device from a notebook.

Importing this package is cheap and side-effect free: it does not import torch,
initialise CUDA, start threads or configure logging. Public names are resolved
lazily on first access.

Example:
    >>> from nbaccel import Accelerator, notebook_launcher  # doctest: +SKIP
    >>> def train():
    ...     accelerator = Accelerator()
    ...     ...
    >>> notebook_launcher(train, num_processes=2)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _cudatrace

__version__ = "0.1.0"

# Remember where CUDA is first initialised, so that a refused fork can quote the cell and
# line that did it. This wraps one torch.cuda function (or, when torch is not loaded yet,
# adds a one-shot import hook for torch.cuda): it imports nothing, initialises no CUDA and
# starts no thread.
_cudatrace.install()

# public name -> submodule that defines it (one source of truth for lazy loading)
_EXPORTS: dict[str, str] = {
    "Accelerator": "accelerator",
    "notebook_launcher": "launcher",
    "debug_launcher": "launcher",
    "LaunchHandle": "launcher",
    "DistributedType": "state",
    "ProcessState": "state",
    "LaunchConfig": "config",
    "AutocastKwargs": "options",
    "DataLoaderConfiguration": "options",
    "DistributedDataParallelKwargs": "options",
    "GradScalerKwargs": "options",
    "InitProcessGroupKwargs": "options",
    "ProjectConfiguration": "options",
    "set_seed": "rng",
    "skip_first_batches": "data",
    "load_checkpoint_in_model": "checkpoint",
    "tqdm": "progress",
    "GeneralTracker": "trackers",
    "NbaccelError": "errors",
    "ConfigError": "errors",
    "LaunchError": "errors",
    "CUDAInitializedError": "errors",
    "WorkerError": "errors",
}

__all__ = [*sorted(_EXPORTS), "__version__"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .accelerator import Accelerator as Accelerator
    from .checkpoint import load_checkpoint_in_model as load_checkpoint_in_model
    from .config import LaunchConfig as LaunchConfig
    from .data import skip_first_batches as skip_first_batches
    from .errors import ConfigError as ConfigError
    from .errors import CUDAInitializedError as CUDAInitializedError
    from .errors import LaunchError as LaunchError
    from .errors import NbaccelError as NbaccelError
    from .errors import WorkerError as WorkerError
    from .launcher import LaunchHandle as LaunchHandle
    from .launcher import debug_launcher as debug_launcher
    from .launcher import notebook_launcher as notebook_launcher
    from .options import AutocastKwargs as AutocastKwargs
    from .options import DataLoaderConfiguration as DataLoaderConfiguration
    from .options import DistributedDataParallelKwargs as DistributedDataParallelKwargs
    from .options import GradScalerKwargs as GradScalerKwargs
    from .options import InitProcessGroupKwargs as InitProcessGroupKwargs
    from .options import ProjectConfiguration as ProjectConfiguration
    from .progress import tqdm as tqdm
    from .rng import set_seed as set_seed
    from .state import DistributedType as DistributedType
    from .state import ProcessState as ProcessState
    from .trackers import GeneralTracker as GeneralTracker


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'nbaccel' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module_name}", __name__), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return __all__
