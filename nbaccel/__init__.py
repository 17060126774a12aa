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

from ._version import __version__

# public name -> submodule that defines it (one source of truth for lazy loading)
_EXPORTS: dict[str, str] = {
    "Accelerator": "runtime.accelerator",
    "AcceleratorState": "runtime.partial_state",
    "PartialState": "runtime.partial_state",
    "GradientAccumulationPlugin": "runtime.options",
    "find_executable_batch_size": "runtime.compat",
    "prepare_data_loader": "runtime.compat",
    "notebook_launcher": "launch.launcher",
    "debug_launcher": "launch.launcher",
    "debug": "launch.debugger",
    "LaunchHandle": "launch.launcher",
    "start_workers": "launch.pool",
    "WorkerPool": "launch.pool",
    "DistributedType": "runtime.state",
    "ProcessState": "runtime.state",
    "LaunchConfig": "config",
    "AutocastKwargs": "runtime.options",
    "DataLoaderConfiguration": "runtime.options",
    "DistributedDataParallelKwargs": "runtime.options",
    "GradScalerKwargs": "runtime.options",
    "InitProcessGroupKwargs": "runtime.options",
    "ProjectConfiguration": "runtime.options",
    "FullyShardedDataParallelPlugin": "runtime.fsdp_plugin",
    "ParallelismConfig": "runtime.parallel.config",
    "set_seed": "runtime.rng",
    "skip_first_batches": "runtime.data",
    "load_checkpoint_in_model": "runtime.model_io",
    "tqdm": "tracking.progress",
    "GeneralTracker": "tracking.base",
    "NbaccelError": "errors",
    "ConfigError": "errors",
    "LaunchError": "errors",
    "CUDAInitializedError": "errors",
    "WorkerError": "errors",
    "RanksMissingError": "errors",
    "WorkerTimeoutError": "errors",
    # more of Accelerate's top-level names (issue 25)
    "DDPCommunicationHookType": "runtime.comm_hooks",
    "ProfileKwargs": "runtime.options",
    "synchronize_rng_states": "runtime.rng",
    "init_empty_weights": "runtime.not_applicable",
    "init_on_device": "runtime.not_applicable",
    "DeepSpeedPlugin": "runtime.deepspeed_plugin",
    "dispatch_model": "runtime.not_applicable",
    "infer_auto_device_map": "runtime.not_applicable",
    "load_checkpoint_and_dispatch": "runtime.not_applicable",
    "cpu_offload": "runtime.not_applicable",
    "cpu_offload_with_hook": "runtime.not_applicable",
    "disk_offload": "runtime.not_applicable",
    "prepare_pippy": "runtime.not_applicable",
}

__all__ = [*sorted(_EXPORTS), "__version__", "load_ipython_extension"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .config import LaunchConfig as LaunchConfig
    from .errors import ConfigError as ConfigError
    from .errors import CUDAInitializedError as CUDAInitializedError
    from .errors import LaunchError as LaunchError
    from .errors import NbaccelError as NbaccelError
    from .errors import WorkerError as WorkerError
    from .errors import WorkerTimeoutError as WorkerTimeoutError
    from .launch.debugger import debug as debug
    from .launch.launcher import LaunchHandle as LaunchHandle
    from .launch.launcher import debug_launcher as debug_launcher
    from .launch.launcher import notebook_launcher as notebook_launcher
    from .launch.pool import WorkerPool as WorkerPool
    from .launch.pool import start_workers as start_workers
    from .runtime.accelerator import Accelerator as Accelerator
    from .runtime.compat import find_executable_batch_size as find_executable_batch_size
    from .runtime.compat import prepare_data_loader as prepare_data_loader
    from .runtime.data import skip_first_batches as skip_first_batches
    from .runtime.deepspeed_plugin import DeepSpeedPlugin as DeepSpeedPlugin
    from .runtime.fsdp_plugin import (
        FullyShardedDataParallelPlugin as FullyShardedDataParallelPlugin,
    )
    from .runtime.model_io import load_checkpoint_in_model as load_checkpoint_in_model
    from .runtime.options import AutocastKwargs as AutocastKwargs
    from .runtime.options import DataLoaderConfiguration as DataLoaderConfiguration
    from .runtime.options import DistributedDataParallelKwargs as DistributedDataParallelKwargs
    from .runtime.options import GradientAccumulationPlugin as GradientAccumulationPlugin
    from .runtime.options import GradScalerKwargs as GradScalerKwargs
    from .runtime.options import InitProcessGroupKwargs as InitProcessGroupKwargs
    from .runtime.options import ProjectConfiguration as ProjectConfiguration
    from .runtime.partial_state import AcceleratorState as AcceleratorState
    from .runtime.partial_state import PartialState as PartialState
    from .runtime.rng import set_seed as set_seed
    from .runtime.state import DistributedType as DistributedType
    from .runtime.state import ProcessState as ProcessState
    from .tracking.base import GeneralTracker as GeneralTracker
    from .tracking.progress import tqdm as tqdm


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'nbaccel' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module_name}", __name__), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbaccel``: register the ``%%distributed`` cell magic (see nbaccel.launch.magic)."""
    from .launch.magic import load_ipython_extension as load

    load(ipython)


def __dir__() -> list[str]:
    return __all__
