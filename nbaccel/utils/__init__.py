"""The names scripts import from the best-known peer's ``accelerate.utils``.

Names only: every object is defined in :mod:`nbaccel.runtime`, :mod:`nbaccel.config` or
:mod:`nbaccel.tracking`, and is loaded on first access. The submodules scripts import
from (``accelerate.utils.constants``, ``.dataclasses``, ``.operations``, ``.imports``,
``.memory``, ``.random``, ``.other``, ``.modeling``, ``.versions``) are here too:
``constants`` holds nbaccel's file names, the others are views of this module.

Example:
    >>> from nbaccel.utils import ProjectConfiguration, set_seed
    >>> ProjectConfiguration(project_dir="runs/a").logging_dir
    'runs/a'
"""

from __future__ import annotations

import importlib
from typing import Any

from ..runtime import availability as _availability
from ..runtime import not_applicable as _not_applicable

# name -> module under nbaccel that defines it
_EXPORTS: dict[str, str] = {
    # option objects
    "AORecipeKwargs": "runtime.options",
    "AutocastKwargs": "runtime.options",
    "DataLoaderConfiguration": "runtime.options",
    "DistributedDataParallelKwargs": "runtime.options",
    "GradScalerKwargs": "runtime.options",
    "GradientAccumulationPlugin": "runtime.options",
    "InitProcessGroupKwargs": "runtime.options",
    "KwargsHandler": "runtime.options",
    "ProjectConfiguration": "runtime.options",
    "FullyShardedDataParallelPlugin": "runtime.fsdp_plugin",
    # enums
    "DistributedType": "runtime.state",
    "LoggerType": "tracking.trackers",
    "PrecisionType": "runtime.compat",
    "RNGType": "runtime.compat",
    # collectives and tensor trees
    "broadcast": "runtime.ops",
    "broadcast_object_list": "runtime.ops",
    "gather": "runtime.ops",
    "gather_object": "runtime.ops",
    "pad_across_processes": "runtime.ops",
    "reduce": "runtime.ops",
    "recursively_apply": "runtime.tree",
    "send_to_device": "runtime.tree",
    "concatenate": "runtime.dispatch",
    "convert_to_fp32": "runtime.wrappers",
    # randomness
    "set_seed": "runtime.rng",
    "synchronize_rng_states": "runtime.rng",
    # models, memory, checkpoints
    "extract_model_from_parallel": "runtime.compat",
    "load_checkpoint_in_model": "runtime.model_io",
    "release_memory": "runtime.compat",
    "find_executable_batch_size": "runtime.compat",
    "patch_environment": "runtime.compat",
    "wait_for_everyone": "runtime.compat",
    "write_basic_config": "config",
    # data
    "prepare_data_loader": "runtime.compat",
    "skip_first_batches": "runtime.data",
    # progress
    "tqdm": "tracking.progress",
    # more option objects and enums
    "DDPCommunicationHookType": "runtime.comm_hooks",
    "ProfileKwargs": "runtime.options",
    "TorchDynamoPlugin": "runtime.dynamo",
    "DynamoBackend": "runtime.dynamo",
    # launching
    "PrepareForLaunch": "runtime.compat",
    # DeepSpeed (the optional deepspeed extra)
    "DeepSpeedPlugin": "runtime.deepspeed_plugin",
    "DummyOptim": "runtime.deepspeed_plugin",
    "DummyScheduler": "runtime.deepspeed_plugin",
    # ParallelismConfig's handlers
    "TorchTensorParallelConfig": "runtime.parallel.config",
    "TorchContextParallelConfig": "runtime.parallel.config",
    "ParallelismConfig": "runtime.parallel.config",
    # building models without memory
    "init_empty_weights": "runtime.not_applicable",
    "init_on_device": "runtime.not_applicable",
    # small helpers
    "clear_environment": "runtime.helpers",
    "convert_outputs_to_fp32": "runtime.helpers",
    "get_max_memory": "runtime.helpers",
    "listify": "runtime.helpers",
    "load": "runtime.helpers",
    "save": "runtime.helpers",
    "slice_tensors": "runtime.helpers",
    "merge_fsdp_weights": "runtime.model_io",
    "synchronize_rng_state": "runtime.rng",
    "SeedableRandomSampler": "runtime._loader_parts",
    # versions and availability
    "compare_versions": "runtime.availability",
    "is_bf16_available": "runtime.availability",
    "is_compiled_module": "runtime.availability",
    "is_cuda_available": "runtime.availability",
    "is_fp8_available": "runtime.availability",
    "is_mps_available": "runtime.availability",
    "is_peft_model": "runtime.availability",
    "is_torch_version": "runtime.availability",
    "is_torch_xla_available": "runtime.availability",
    "is_tpu_available": "runtime.availability",
    **dict.fromkeys(_availability.HELPERS, "runtime.availability"),
    # what nbaccel does not do: importable, and an error naming the way when used
    **dict.fromkeys(_not_applicable.ALTERNATIVES, "runtime.not_applicable"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'nbaccel.utils' has no attribute {name!r}")
    module = importlib.import_module(f"nbaccel.{module_name}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
