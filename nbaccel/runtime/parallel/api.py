"""``Accelerator(parallelism_config=...)``: checking it against the process group, choosing
building its mesh, and Accelerate's attributes that read it.

:func:`resolve_parallelism` runs in ``Accelerator.__init__`` on every rank, before any
model exists: it refuses what cannot run here (sizes that do not multiply to the number
of processes, context parallel without CUDA attention, sequence parallel, DeepSpeed
together with a mesh) and builds the ``DeviceMesh``. :class:`ParallelAPI` is the mixin
the facade inherits: ``parallelism_config``, ``torch_device_mesh``,
``maybe_context_parallel``, and the data-parallel share of the data loaders.

Example:
    >>> from nbaccel.runtime.process.state import get_state
    >>> resolve_parallelism(ParallelismConfig(), get_state(cpu=True)).total_size
    1
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from ...errors import ConfigError
from ..process.state import ProcessState
from .checks import check_runnable
from .config import ParallelismConfig, data_parallel_share, leads_its_group


def resolve_parallelism(
    config: Any,
    state: ProcessState,
    *,
    fsdp_plugin: Any = None,
    deepspeed_plugin: Any = None,
) -> ParallelismConfig | None:
    """A checked copy of ``config`` for this process (``None``: none given), its sizes
    completed and its mesh built; ``config`` itself is left as the caller made it.

    ``runtime.strategy.select_strategy`` then picks the mesh strategy when it shards or
    splits tensors (pure replication is DDP).

    Raises:
        TypeError: ``config`` is not a :class:`ParallelismConfig`.
        ConfigError: see :func:`check_runnable`; DeepSpeed with a mesh; ``fsdp_plugin``
            without a dimension to shard over.
    """
    if config is None:  # the launch configuration's sizes (config file, CLI, panel)
        from ...config import launch_config
        from .from_launch import parallelism_from_launch

        cfg = launch_config()
        config = parallelism_from_launch(cfg)
        if config is None:
            return None
    if not isinstance(config, ParallelismConfig):
        raise TypeError(
            f"parallelism_config={config!r}: pass a ParallelismConfig(dp_shard_size=..., "
            "tp_size=...) from nbaccel (or accelerate.parallelism_config under nbaccel)."
        )
    # a copy: the caller's object may serve another Accelerator or launch, with other sizes;
    # it must not carry this one's completed sizes or its mesh (the copy has no mesh yet)
    config = dataclasses.replace(config)
    if state.world_size == 1 and config.total_size == 1:
        return config  # nothing to arrange
    if config.total_size == 1:  # Accelerate's rule: all 1 on many processes = replicate
        config.dp_replicate_size = state.world_size
    check_runnable(config, device_type=state.device.type, num_processes=state.world_size)
    from ...platform import torchcompat

    if not torchcompat.fsdp_supported():  # DeviceMesh._flatten, FSDP2 with DTensor TP
        major, minor = torchcompat.FSDP_MIN_TORCH
        raise ConfigError(
            f"parallelism_config needs torch>={major}.{minor} (DeviceMesh._flatten, FSDP2 over "
            f"a mesh); this is torch {torch_version()}. Upgrade torch (pip install "
            f"'torch>={major}.{minor}'), or drop parallelism_config and train with DDP."
        )
    if deepspeed_plugin is not None:
        raise ConfigError(
            "parallelism_config together with deepspeed_plugin: DeepSpeed shards on its own; "
            "use one of them (ParallelismConfig's sharding runs on FSDP2)."
        )
    if fsdp_plugin is not None and not config.fsdp_enabled:
        raise ConfigError(
            f"fsdp_plugin with {config!r}: no dimension to shard over (dp_shard_size and "
            "cp_size are 1). Set dp_shard_size > 1, or drop fsdp_plugin."
        )
    config.get_device_mesh(state.device.type)  # every rank, now: a collective
    return config


def torch_version() -> str:
    import torch

    return str(torch.__version__)


class ParallelAPI:
    """Accelerate's attributes for a ``ParallelismConfig`` (mixin of the Accelerator)."""

    _parallelism: ParallelismConfig | None
    _process: ProcessState

    @property
    def parallelism_config(self) -> ParallelismConfig | None:
        """A copy of the ``ParallelismConfig`` given to the Accelerator, its sizes completed
        and its mesh built (the caller's object is left untouched), else None."""
        return self._parallelism

    @property
    def torch_device_mesh(self) -> Any:
        """torch's ``DeviceMesh`` with Accelerate's dimension names (``dp_replicate``,
        ``dp_shard``, ``tp``, ``cp``, flattened ``dp``, ``dp_shard_cp``, ``dp_cp``);
        None without a ``parallelism_config`` or on one process."""
        config = self._parallelism
        return None if config is None else config.device_mesh

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        """Whether a mesh (tensor parallel or sharding) arranges the processes."""
        config = self._parallelism
        return bool(config is not None and (config.tp_enabled or config.fsdp_enabled))

    def _data_parallel(self) -> tuple[int, int]:
        """(data-parallel size, this rank's share): ranks of one tensor/context-parallel
        group read the same batches."""
        config, state = self._parallelism, self._process
        if config is None or config.device_mesh is None:
            return state.world_size, state.rank
        # read from the mesh, as prepare_data_loader(torch_device_mesh=...) reads it: one
        # computation, so both ways of sharding data always agree
        return data_parallel_share(config.device_mesh)

    def _reads_own_share(self) -> bool:
        """Whether this rank's data is its group's: the first rank of its tensor/context
        group (``gather_for_metrics`` keeps one copy per data-parallel share)."""
        config = self._parallelism
        if config is None or config.device_mesh is None:
            return True
        return leads_its_group(config.device_mesh)

    @property
    def context_parallel_rank(self) -> int:
        """This rank's position along ``cp`` (0 without context parallel)."""
        config = self._parallelism
        if config is None or not config.cp_enabled:
            return 0
        return int(config.device_mesh["cp"].get_local_rank())

    def maybe_context_parallel(
        self,
        buffers: list[Any] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[Any] | None = None,
    ) -> contextlib.AbstractContextManager[Any]:
        """torch's ``context_parallel`` over ``cp`` when ``cp_size > 1`` (CUDA only: refused
        at start elsewhere), else a context that does nothing."""
        config = self._parallelism
        if config is None or not config.cp_enabled:
            return contextlib.nullcontext()
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        handler = config.cp_handler
        set_rotate_method(handler.cp_comm_strategy if handler else "allgather")
        return context_parallel(
            config.device_mesh["cp"],
            buffers=buffers,
            buffer_seq_dims=buffer_seq_dims,
            no_restore_buffers=no_restore_buffers,
        )


__all__ = ["ParallelAPI", "resolve_parallelism"]
