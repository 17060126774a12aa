"""``ParallelismConfig``: the sizes of the data, tensor, context and sequence parallel dimensions.

The same object Accelerate (>= 1.10) takes as ``Accelerator(parallelism_config=...)``,
with its meaning: ``dp_replicate_size`` replicas x ``dp_shard_size`` shards
(FSDP when only sharding, HSDP when both) x ``tp_size`` tensor-parallel ranks x
``cp_size`` context-parallel ranks (x ``sp_size``, Accelerate 1.12's sequence parallel).
The product must equal the number of processes. :meth:`ParallelismConfig.build_device_mesh`
builds torch's ``DeviceMesh`` with Accelerate's dimension names -- ``dp_replicate``,
``dp_shard``, ``cp``, ``tp`` and the flattened ``dp``, ``dp_shard_cp`` and ``dp_cp`` --
with ``init_device_mesh`` and ``DeviceMesh._flatten`` (torch's own; nothing is invented).

Ranks are laid out in the order ``dp_replicate, dp_shard, cp, sp, tp`` (tensor parallel
innermost, as Accelerate and torchtitan do): neighbouring ranks share a layer's shards.

Example:
    >>> config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    >>> config.total_size, config.dp_dim_names, config.non_dp_dim_names
    (4, ['dp_shard'], ['tp'])
    >>> config.data_parallel_size, config.non_data_parallel_size
    (2, 2)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError

#: Accelerate's mesh order: tensor parallel innermost (ranks next to each other)
MESH_ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
#: the environment variables Accelerate's launcher sets (and its ParallelismConfig reads)
ENV_PREFIX = "PARALLELISM_CONFIG_"
SIZE_FIELDS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")


@dataclasses.dataclass
class TorchTensorParallelConfig:
    """Tensor-parallel settings (Accelerate's ``tp_handler``).

    Args:
        enable_async_tp: Accelerate's asynchronous TP (a torch.compile pass over CUDA
            symmetric memory): refused on every device, before any model exists, because
            nbaccel does not compile the model for it (it would change nothing).
        plan: nbaccel's addition: ``{submodule name: torch ParallelStyle}`` applied with
            ``torch.distributed.tensor.parallel.parallelize_module`` on the ``tp`` mesh when
            ``prepare`` sees a module that is not parallelised yet; ``"auto"``: a
            transformers model's own plan (``model._tp_plan``) in torch's styles.

    Example:
        >>> TorchTensorParallelConfig().enable_async_tp
        False
    """

    enable_async_tp: bool = False
    plan: Mapping[str, Any] | str | None = None


@dataclasses.dataclass
class TorchContextParallelConfig:
    """Context-parallel settings (Accelerate's ``cp_handler``): how shards exchange
    keys/values (``"allgather"`` or ``"alltoall"``).

    Example:
        >>> TorchContextParallelConfig().cp_comm_strategy
        'allgather'
    """

    cp_comm_strategy: str = "allgather"

    def __post_init__(self) -> None:
        if self.cp_comm_strategy not in ("allgather", "alltoall"):
            raise ConfigError(
                f"TorchContextParallelConfig(cp_comm_strategy={self.cp_comm_strategy!r}): "
                "use 'allgather' or 'alltoall'."
            )


def _env_size(name: str) -> int:
    raw = os.environ.get(ENV_PREFIX + name.upper(), "1")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"{ENV_PREFIX}{name.upper()}={raw!r} is not an integer; set it to a size >= 1."
        ) from None


@dataclasses.dataclass
class ParallelismConfig:
    """How the processes are arranged: data (replicate x shard), tensor, context, sequence.

    Args:
        dp_replicate_size: model replicas (each holds the whole model, or its shards).
        dp_shard_size: processes a model's parameters are sharded over (FSDP2).
            Replicate > 1 with shard > 1 is HSDP; replicate > 1 alone is DDP.
        tp_size: tensor-parallel ranks (a layer's weight split across them).
        cp_size: context-parallel ranks (the sequence split; needs CUDA attention).
        sp_size: sequence-parallel ranks (Accelerate's ALST/Ulysses through DeepSpeed).
        sp_backend: Accelerate's sequence-parallel engine name (``"deepspeed"``).
        tp_handler: a :class:`TorchTensorParallelConfig` (created when ``tp_size > 1``).
        cp_handler: a :class:`TorchContextParallelConfig` (created when ``cp_size > 1``).
        sp_handler: Accelerate's DeepSpeed sequence-parallel settings (kept, unused).

    A size left ``None`` reads ``PARALLELISM_CONFIG_<FIELD>`` (what Accelerate's launcher
    sets), else 1.

    Raises:
        ConfigError: a size < 1, or tensor/context parallel over pure replication.

    Example:
        >>> ParallelismConfig(dp_replicate_size=2, dp_shard_size=2).fsdp_dim_names
        ['dp_replicate', 'dp_shard_cp']
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    sp_size: int | None = None
    sp_backend: str = "deepspeed"
    tp_handler: TorchTensorParallelConfig | None = None
    cp_handler: TorchContextParallelConfig | None = None
    sp_handler: Any = None

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if value is None:
                value = _env_size(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"ParallelismConfig({name}={value!r}): use an int >= 1 (1 = not used)."
                )
            setattr(self, name, value)
        sizes = self._sizes
        if sizes["tp"] > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        if sizes["cp"] > 1 and self.cp_handler is None:
            self.cp_handler = TorchContextParallelConfig()
        if (
            (sizes["tp"] > 1 or sizes["cp"] > 1)
            and sizes["dp_replicate"] > 1
            and sizes["dp_shard"] == 1
        ):
            raise ConfigError(
                f"ParallelismConfig(dp_replicate_size={self.dp_replicate_size}, dp_shard_size=1, "
                f"tp_size={self.tp_size}, cp_size={self.cp_size}): tensor/context parallel does "
                "not compose with pure replication (DDP). Shard instead: dp_shard_size="
                f"{self.dp_replicate_size} (FSDP2 x TP), or dp_replicate_size and "
                "dp_shard_size both > 1 (HSDP x TP)."
            )
        self.device_mesh: Any = None

    # -- sizes ------------------------------------------------------------------------------

    @property
    def _sizes(self) -> dict[str, int]:
        return {dim: int(getattr(self, f"{dim}_size") or 1) for dim in MESH_ORDER}

    @property
    def total_size(self) -> int:
        """The product of all sizes: the number of processes this layout needs."""
        total = 1
        for size in self._sizes.values():
            total *= size
        return total

    @property
    def data_parallel_size(self) -> int:
        """Replicas x shards: how many different batches one step reads."""
        return int(self.dp_replicate_size or 1) * int(self.dp_shard_size or 1)

    @property
    def non_data_parallel_size(self) -> int:
        """Tensor x context x sequence parallel: ranks that read the same batch."""
        return int(self.tp_size or 1) * int(self.cp_size or 1) * int(self.sp_size or 1)

    dp_replicate_enabled = property(lambda self: self.dp_replicate_size > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard_size > 1)
    tp_enabled = property(lambda self: self.tp_size > 1)
    cp_enabled = property(lambda self: self.cp_size > 1)
    sp_enabled = property(lambda self: self.sp_size > 1)

    @property
    def fsdp_enabled(self) -> bool:
        """Whether FSDP2 shards parameters (over ``dp_shard`` and ``cp`` together)."""
        return bool(self.dp_shard_enabled or self.cp_enabled)

    # -- dimension names (Accelerate's) ----------------------------------------------------

    def _enabled(self, *dims: str) -> list[str]:
        return [d for d in dims if self._sizes[d] > 1]

    @property
    def dp_dim_names(self) -> list[str]:
        """Enabled data-parallel dimensions (each rank along them reads another batch)."""
        return self._enabled("dp_replicate", "dp_shard")

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Enabled dimensions whose ranks read the same batch."""
        return self._enabled("tp", "cp", "sp")

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """Dimensions flattened into ``dp_shard_cp``: what FSDP shards over."""
        return self._enabled("dp_shard", "cp")

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """Dimensions flattened into ``dp_cp``: over which the loss is averaged."""
        return self._enabled("dp_replicate", "dp_shard", "cp")

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The mesh dimensions ``fully_shard`` gets (replicate first: HSDP)."""
        return ["dp_replicate", "dp_shard_cp"] if self.dp_replicate_enabled else ["dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        """All enabled dimensions, in mesh order."""
        return [d for d in MESH_ORDER if self._sizes[d] > 1]

    # -- ranks and the mesh -----------------------------------------------------------------

    def check_world_size(self, world_size: int, *, where: str = "the process group") -> None:
        """Raise unless the sizes multiply to ``world_size`` (the number of processes).

        Raises:
            ConfigError: naming the sizes, their product and the fix.
        """
        if self.total_size != world_size:
            sizes = ", ".join(f"{n}={getattr(self, n)}" for n in SIZE_FIELDS)
            raise ConfigError(
                f"ParallelismConfig({sizes}) multiplies to {self.total_size}, but {where} has "
                f"{world_size} process(es): make the sizes multiply to {world_size}, or launch "
                f"{self.total_size} processes (num_processes={self.total_size})."
            )

    def build_device_mesh(self, device_type: str) -> Any:
        """torch's ``DeviceMesh`` over these dimensions (all ranks call it), with the
        flattened ``dp``, ``dp_shard_cp`` and ``dp_cp`` dimensions; ``None`` if all sizes are 1."""
        from torch.distributed.device_mesh import init_device_mesh

        dims = self.active_mesh_dims
        if not dims:
            return None
        shape = tuple(self._sizes[d] for d in dims)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=tuple(dims))
        for flat, names in (
            ("dp", self.dp_dim_names),
            ("dp_shard_cp", self.dp_shard_cp_dim_names),
            ("dp_cp", self.dp_cp_dim_names),
        ):
            if names:
                # a one-dimension "flattening" names that dimension once more
                mesh[tuple(names)]._flatten(flat)
        return mesh

    def get_device_mesh(self, device_type: str | None = None) -> Any:
        """The mesh built for this config (built now if ``device_type`` is given)."""
        if self.device_mesh is None:
            if device_type is None:
                raise ConfigError(
                    "get_device_mesh(): no mesh built yet; pass device_type ('cpu' or 'cuda')."
                )
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ConfigError(
                f"get_device_mesh(device_type={device_type!r}): the mesh was built for "
                f"{self.device_mesh.device_type!r}."
            )
        return self.device_mesh

    def __repr__(self) -> str:
        sizes = ", ".join(f"{n}={getattr(self, n)}" for n in SIZE_FIELDS)
        return f"ParallelismConfig({sizes}, total_size={self.total_size})"


def data_parallel_share(mesh: Any) -> tuple[int, int]:
    """(data-parallel size, this rank's index) along a mesh's ``dp_replicate``/``dp_shard``
    dimensions (ranks that differ only along ``tp``/``cp`` share an index): what
    ``prepare_data_loader(torch_device_mesh=...)`` shards by.

    Example:
        >>> data_parallel_share(None)
        (1, 0)
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    size, index = 1, 0
    for dim in ("dp_replicate", "dp_shard"):
        if dim in names:
            sub = mesh[dim]
            size, index = size * sub.size(), index * sub.size() + int(sub.get_local_rank())
    return size, index


def leads_its_group(mesh: Any) -> bool:
    """Whether this rank is the first of its tensor/context/sequence-parallel group on
    ``mesh`` (the ranks of one group read the same batch; one of them speaks for it).

    Example:
        >>> leads_its_group(None)
        True
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    return all(int(mesh[dim].get_local_rank()) == 0 for dim in ("cp", "sp", "tp") if dim in names)


__all__ = [
    "ENV_PREFIX",
    "MESH_ORDER",
    "SIZE_FIELDS",
    "ParallelismConfig",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
    "data_parallel_share",
    "leads_its_group",
]
