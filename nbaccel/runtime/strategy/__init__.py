"""Strategies: how a model takes part in training across processes.

One object per ``Accelerator``, chosen from the process state by
:func:`select_strategy`: :class:`SingleProcess` (one process), :class:`DDP`
(several processes on CPU or GPU), :class:`FSDP` (several processes, an FSDP plugin
or ``strategy="fsdp"`` in the launch configuration), :class:`DeepSpeed` (a DeepSpeed
plugin or ``strategy="deepspeed"``) or :class:`XLA` (torch_xla devices). Each one
wraps the model, controls gradient sync, clips, and makes state dicts; the
facade calls them and never compares distributed types.

Example:
    >>> from nbaccel.runtime.process.state import get_state
    >>> select_strategy(get_state(cpu=True)).name
    'single'
"""

from __future__ import annotations

from typing import Any

from ...config import launch_config
from ..parallel.checks import check_strategy
from ..process.state import DistributedType, ProcessState
from .base import PrepareContext, Prepared, SingleProcess
from .ddp.comm_hooks import DDPCommunicationHookType, check_hook_options
from .ddp.ddp import DDP
from .deepspeed.deepspeed import DeepSpeed
from .deepspeed.deepspeed_plugin import DeepSpeedPlugin, check_deepspeed_argument
from .fsdp.fsdp import FSDP
from .fsdp.fsdp_plugin import FullyShardedDataParallelPlugin, check_fsdp_arguments
from .mesh.mesh import MeshParallel
from .xla.xla import XLA

Strategy = SingleProcess  # the interface every strategy implements


def _shards(parallelism: Any) -> bool:
    """Whether a ``ParallelismConfig`` needs the mesh strategy (pure replication is DDP)."""
    return parallelism is not None and bool(parallelism.tp_enabled or parallelism.fsdp_enabled)


_BY_TYPE: dict[DistributedType, type[SingleProcess]] = {
    DistributedType.NO: SingleProcess,
    DistributedType.MULTI_CPU: DDP,
    DistributedType.MULTI_GPU: DDP,
    DistributedType.XLA: XLA,
}


def select_strategy(
    state: ProcessState,
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
    deepspeed_plugin: DeepSpeedPlugin | None = None,
    *,
    mixed_precision: str = "no",
    parallelism: Any = None,
) -> Any:
    """The strategy for this process: the mesh strategy when ``parallelism`` (a checked
    ``ParallelismConfig`` whose mesh is built) shards or splits tensors, DeepSpeed or FSDP
    when a plugin is given (or the launch configuration says
    ``strategy="deepspeed"``/``"fsdp"``), else the one for the distributed type. The
    strategy's ``state`` is the state the Accelerator reports (``DistributedType.FSDP``
    under FSDP, ``DEEPSPEED`` under DeepSpeed).

    Raises:
        ConfigError: the launch configuration says ``strategy="deepspeed"`` while
            ``parallelism`` shards or splits the model.
    """
    from_config = fsdp_plugin is None and deepspeed_plugin is None
    if from_config and state.distributed_type is not DistributedType.XLA:
        cfg = launch_config()  # read once: the launcher's object in a worker
        if parallelism is not None:  # strategy="deepspeed" would silently not run: refused
            check_strategy(parallelism, strategy=cfg.strategy)
        if cfg.strategy == "deepspeed":  # also one process (ZeRO-Offload on one GPU)
            deepspeed_plugin = DeepSpeedPlugin.from_config(cfg)
        elif cfg.strategy == "fsdp" and state.world_size > 1:
            fsdp_plugin = FullyShardedDataParallelPlugin.from_config(cfg)
    if _shards(parallelism):
        plugin = fsdp_plugin if parallelism.fsdp_enabled else None
        return MeshParallel(state, parallelism, plugin, mixed_precision=mixed_precision)
    if deepspeed_plugin is not None:
        return DeepSpeed(state, deepspeed_plugin, mixed_precision=mixed_precision)
    if fsdp_plugin is not None:
        return FSDP(state, fsdp_plugin, mixed_precision=mixed_precision)
    return _BY_TYPE[state.distributed_type](state)


__all__ = [
    "DDP",
    "FSDP",
    "XLA",
    "DDPCommunicationHookType",
    "DeepSpeed",
    "DeepSpeedPlugin",
    "FullyShardedDataParallelPlugin",
    "MeshParallel",
    "PrepareContext",
    "Prepared",
    "SingleProcess",
    "Strategy",
    "check_deepspeed_argument",
    "check_fsdp_arguments",
    "check_hook_options",
    "select_strategy",
]
