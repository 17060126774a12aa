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

from ..runtime.accelerate_utils import availability as _availability
from ..runtime.accelerate_utils import not_applicable as _not_applicable

# name -> module under nbaccel that defines it
_EXPORTS: dict[str, str] = {
    # option objects
    "AORecipeKwargs": "runtime.facade.options",
    "AutocastKwargs": "runtime.facade.options",
    "DataLoaderConfiguration": "runtime.facade.options",
    "DistributedDataParallelKwargs": "runtime.facade.options",
    "GradScalerKwargs": "runtime.facade.options",
    "GradientAccumulationPlugin": "runtime.facade.options",
    "InitProcessGroupKwargs": "runtime.facade.options",
    "KwargsHandler": "runtime.facade.options",
    "ProjectConfiguration": "runtime.facade.options",
    "FullyShardedDataParallelPlugin": "runtime.strategy.fsdp.fsdp_plugin",
    # enums
    "DistributedType": "runtime.process.state",
    "LoggerType": "tracking.trackers",
    "PrecisionType": "runtime.accelerate_utils.compat",
    "RNGType": "runtime.accelerate_utils.compat",
    # collectives and tensor trees
    "broadcast": "runtime.collectives.ops",
    "broadcast_object_list": "runtime.collectives.ops",
    "gather": "runtime.collectives.ops",
    "gather_object": "runtime.collectives.ops",
    "pad_across_processes": "runtime.collectives.ops",
    "reduce": "runtime.collectives.ops",
    "recursively_apply": "runtime.collectives.tree",
    "send_to_device": "runtime.collectives.tree",
    "concatenate": "runtime.loading.dispatch",
    "convert_to_fp32": "runtime.training.wrappers",
    # randomness
    "set_seed": "runtime.process.rng",
    "synchronize_rng_states": "runtime.process.rng",
    # models, memory, checkpoints
    "extract_model_from_parallel": "runtime.accelerate_utils.compat",
    "load_checkpoint_in_model": "runtime.saving.model_io",
    "release_memory": "runtime.accelerate_utils.compat",
    "find_executable_batch_size": "runtime.accelerate_utils.compat",
    "patch_environment": "runtime.accelerate_utils.compat",
    "wait_for_everyone": "runtime.accelerate_utils.compat",
    "write_basic_config": "config",
    # data
    "prepare_data_loader": "runtime.accelerate_utils.compat",
    "skip_first_batches": "runtime.loading.data",
    # progress
    "tqdm": "tracking.progress",
    # more option objects and enums
    "DDPCommunicationHookType": "runtime.strategy.ddp.comm_hooks",
    "ProfileKwargs": "runtime.facade.options",
    "TorchDynamoPlugin": "runtime.compute.dynamo",
    "DynamoBackend": "runtime.compute.dynamo",
    # launching
    "PrepareForLaunch": "runtime.accelerate_utils.compat",
    # DeepSpeed (the optional deepspeed extra)
    "DeepSpeedPlugin": "runtime.strategy.deepspeed.deepspeed_plugin",
    "DummyOptim": "runtime.strategy.deepspeed.deepspeed_plugin",
    "DummyScheduler": "runtime.strategy.deepspeed.deepspeed_plugin",
    # ParallelismConfig's handlers
    "TorchTensorParallelConfig": "runtime.parallel.config",
    "TorchContextParallelConfig": "runtime.parallel.config",
    "ParallelismConfig": "runtime.parallel.config",
    # building models without memory
    "init_empty_weights": "runtime.accelerate_utils.not_applicable",
    "init_on_device": "runtime.accelerate_utils.not_applicable",
    # small helpers
    "clear_environment": "runtime.accelerate_utils.helpers",
    "convert_outputs_to_fp32": "runtime.accelerate_utils.helpers",
    "get_max_memory": "runtime.accelerate_utils.helpers",
    "listify": "runtime.accelerate_utils.helpers",
    "load": "runtime.accelerate_utils.helpers",
    "save": "runtime.accelerate_utils.helpers",
    "slice_tensors": "runtime.accelerate_utils.helpers",
    "merge_fsdp_weights": "runtime.saving.model_io",
    "synchronize_rng_state": "runtime.process.rng",
    "SeedableRandomSampler": "runtime.loading._loader_parts",
    # versions and availability
    "compare_versions": "runtime.accelerate_utils.availability",
    "is_bf16_available": "runtime.accelerate_utils.availability",
    "is_compiled_module": "runtime.accelerate_utils.availability",
    "is_cuda_available": "runtime.accelerate_utils.availability",
    "is_fp8_available": "runtime.accelerate_utils.availability",
    "is_mps_available": "runtime.accelerate_utils.availability",
    "is_peft_model": "runtime.accelerate_utils.availability",
    "is_torch_version": "runtime.accelerate_utils.availability",
    "is_torch_xla_available": "runtime.accelerate_utils.availability",
    "is_tpu_available": "runtime.accelerate_utils.availability",
    **dict.fromkeys(_availability.HELPERS, "runtime.accelerate_utils.availability"),
    # what nbaccel does not do: importable, and an error naming the way when used
    **dict.fromkeys(_not_applicable.ALTERNATIVES, "runtime.accelerate_utils.not_applicable"),
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
