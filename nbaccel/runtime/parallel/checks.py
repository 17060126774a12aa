"""Refusals before any work: sizes against the process count, context and sequence
parallel, asynchronous tensor parallel.

Run by the launcher before it starts processes (``parallelism_config_*`` launch fields)
and by ``Accelerator(parallelism_config=...)`` before any model exists.

Example:
    >>> from nbaccel.runtime.parallel.config import ParallelismConfig
    >>> check_runnable(ParallelismConfig(dp_shard_size=2), device_type="cpu", num_processes=2)
"""

from __future__ import annotations

from ...errors import ConfigError
from .config import ParallelismConfig

_CP_WHY = (
    "context parallel (cp_size > 1) splits attention over the sequence with torch's "
    "context_parallel, whose ring attention has kernels for CUDA's flash/efficient attention "
    "only (on the CPU torch stops at 'aten._scaled_dot_product_flash_attention_for_cpu does "
    "not have a sharding strategy'); set cp_size=1 here and shard with dp_shard_size/tp_size, "
    "or run on several CUDA GPUs"
)
_SP_WHY = (
    "sequence parallel (sp_size > 1) is Accelerate's ALST/Ulysses, run by DeepSpeed's "
    "sequence-parallel engine on GPUs, which nbaccel does not drive; set sp_size=1 and use "
    "tp_size/dp_shard_size (or cp_size on CUDA GPUs)"
)
_ASYNC_TP_WHY = (
    "asynchronous tensor parallel is a torch.compile pass (inductor's micro-pipeline TP, "
    "torch._inductor.config._micro_pipeline_tp, over CUDA symmetric memory) that only acts "
    "inside a compiled graph; nbaccel applies tensor parallel with parallelize_module and "
    "does not compile the model for it, so the setting would change nothing. Set "
    "enable_async_tp=False (tensor parallel runs with torch's ordinary collectives)"
)


def check_runnable(config: ParallelismConfig, *, device_type: str, num_processes: int) -> None:
    """Refuse, before anything starts, a layout this machine cannot run.

    Raises:
        ConfigError: sizes against ``num_processes``; context parallel off CUDA;
            sequence parallel; ``enable_async_tp=True`` on any device.
    """
    if config.total_size > 1:  # all sizes 1: replicate over however many there are
        config.check_world_size(num_processes, where="the launch")
    if config.sp_enabled:
        raise ConfigError(f"ParallelismConfig(sp_size={config.sp_size}): {_SP_WHY}.")
    if config.cp_enabled and device_type != "cuda":
        raise ConfigError(
            f"ParallelismConfig(cp_size={config.cp_size}) on {device_type!r}: {_CP_WHY}."
        )
    handler = config.tp_handler
    if handler is not None and handler.enable_async_tp:
        # refused everywhere, CUDA included: a setting nbaccel would silently ignore is worse
        # than an error before the first step
        raise ConfigError(f"TorchTensorParallelConfig(enable_async_tp=True): {_ASYNC_TP_WHY}.")


def check_strategy(config: ParallelismConfig, *, strategy: str) -> None:
    """Refuse a launch configuration's ``strategy="deepspeed"`` next to sizes that shard or
    split the model: the mesh strategy (FSDP2 / tensor parallel) would run and DeepSpeed,
    asked for by name, would not -- as ``Accelerator(deepspeed_plugin=...,
    parallelism_config=...)`` is refused.

    Raises:
        ConfigError: naming both settings and the two ways out.
    """
    if strategy == "deepspeed" and (config.tp_enabled or config.fsdp_enabled):
        raise ConfigError(
            f"the launch configuration says strategy='deepspeed', and {config!r} shards or "
            "splits the model (FSDP2 / tensor parallel over a DeviceMesh): DeepSpeed shards "
            "on its own, only one of them can run. To train with DeepSpeed drop the sizes "
            "(parallelism_config=None, the parallelism_config_* fields 1); to train on the mesh "
            "set strategy='fsdp' (or 'ddp')."
        )


__all__ = ["check_runnable", "check_strategy"]
