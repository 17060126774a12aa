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
    "Accelerator": "runtime.facade.accelerator",
    "AcceleratorState": "runtime.facade.partial_state",
    "PartialState": "runtime.facade.partial_state",
    "GradientAccumulationPlugin": "runtime.facade.options",
    "find_executable_batch_size": "runtime.accelerate_utils.compat",
    "prepare_data_loader": "runtime.accelerate_utils.compat",
    "notebook_launcher": "launch.launcher",
    "debug_launcher": "launch.launcher",
    "debug": "launch.debugger",
    "LaunchHandle": "launch.launcher",
    "start_workers": "launch.pool",
    "WorkerPool": "launch.pool",
    "DistributedType": "runtime.process.state",
    "ProcessState": "runtime.process.state",
    "LaunchConfig": "config",
    "AutocastKwargs": "runtime.facade.options",
    "DataLoaderConfiguration": "runtime.facade.options",
    "DistributedDataParallelKwargs": "runtime.facade.options",
    "GradScalerKwargs": "runtime.facade.options",
    "InitProcessGroupKwargs": "runtime.facade.options",
    "ProjectConfiguration": "runtime.facade.options",
    "FullyShardedDataParallelPlugin": "runtime.strategy.fsdp.fsdp_plugin",
    "set_seed": "runtime.process.rng",
    "skip_first_batches": "runtime.loading.data",
    "load_checkpoint_in_model": "runtime.saving.model_io",
    "ParallelismConfig": "runtime.parallel.config",
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
    "DDPCommunicationHookType": "runtime.strategy.ddp.comm_hooks",
    "ProfileKwargs": "runtime.facade.options",
    "synchronize_rng_states": "runtime.process.rng",
    "init_empty_weights": "runtime.accelerate_utils.not_applicable",
    "init_on_device": "runtime.accelerate_utils.not_applicable",
    "DeepSpeedPlugin": "runtime.strategy.deepspeed.deepspeed_plugin",
    "dispatch_model": "runtime.accelerate_utils.not_applicable",
    "infer_auto_device_map": "runtime.accelerate_utils.not_applicable",
    "load_checkpoint_and_dispatch": "runtime.accelerate_utils.not_applicable",
    "cpu_offload": "runtime.accelerate_utils.not_applicable",
    "cpu_offload_with_hook": "runtime.accelerate_utils.not_applicable",
    "disk_offload": "runtime.accelerate_utils.not_applicable",
    "prepare_pippy": "runtime.accelerate_utils.not_applicable",
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
    from .runtime.accelerate_utils.compat import (
        find_executable_batch_size as find_executable_batch_size,
    )
    from .runtime.accelerate_utils.compat import prepare_data_loader as prepare_data_loader
    from .runtime.facade.accelerator import Accelerator as Accelerator
    from .runtime.facade.options import AutocastKwargs as AutocastKwargs
    from .runtime.facade.options import DataLoaderConfiguration as DataLoaderConfiguration
    from .runtime.facade.options import (
        DistributedDataParallelKwargs as DistributedDataParallelKwargs,
    )
    from .runtime.facade.options import GradientAccumulationPlugin as GradientAccumulationPlugin
    from .runtime.facade.options import GradScalerKwargs as GradScalerKwargs
    from .runtime.facade.options import InitProcessGroupKwargs as InitProcessGroupKwargs
    from .runtime.facade.options import ProjectConfiguration as ProjectConfiguration
    from .runtime.facade.partial_state import AcceleratorState as AcceleratorState
    from .runtime.facade.partial_state import PartialState as PartialState
    from .runtime.loading.data import skip_first_batches as skip_first_batches
    from .runtime.process.rng import set_seed as set_seed
    from .runtime.process.state import DistributedType as DistributedType
    from .runtime.process.state import ProcessState as ProcessState
    from .runtime.saving.model_io import load_checkpoint_in_model as load_checkpoint_in_model
    from .runtime.strategy.deepspeed.deepspeed_plugin import DeepSpeedPlugin as DeepSpeedPlugin
    from .runtime.strategy.fsdp.fsdp_plugin import (
        FullyShardedDataParallelPlugin as FullyShardedDataParallelPlugin,
    )
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
