"""File names and lists scripts import from ``accelerate.utils.constants``.

The values are the names nbaccel's checkpoints and exports really use (the same as
Accelerate's for models, optimizers, schedulers, the scaler and the profiler traces).
Per-rank state is ``rank_{i}.pt`` here (Accelerate: ``random_states_{i}.pkl``).

Example:
    >>> SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME
    ('model.safetensors', 'model.safetensors.index.json')
"""

from __future__ import annotations

SCALER_NAME = "scaler.pt"
MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
RNG_STATE_NAME = "rank"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
CHECKPOINT_MANIFEST_NAME = "nbaccel_checkpoint.json"
FSDP_MODEL_NAME = "model.dcp"
FSDP_AUTO_WRAP_POLICY = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
FSDP2_STATE_DICT_TYPE = ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]
FSDP_STATE_DICT_TYPE = FSDP2_STATE_DICT_TYPE
TORCH_DYNAMO_MODES = ["default", "reduce-overhead", "max-autotune"]
STR_OPERATION_TO_FUNC_NAMES = [">", ">=", "==", "!=", "<=", "<"]
TORCH_DISTRIBUTED_OPERATION_TYPES = ["MULTI_GPU", "MULTI_CPU", "FSDP"]
CUDA_DISTRIBUTED_TYPES = ["MULTI_GPU", "FSDP"]

__all__ = [name for name in dir() if name.isupper()]
