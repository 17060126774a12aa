"""FSDP2: parameters, gradients and optimizer state sharded across processes.

Built on torch's own ``torch.distributed.fsdp.fully_shard`` over a one-dimensional
``DeviceMesh`` (gloo on CPU, NCCL on GPU); state dicts go through
``torch.distributed.checkpoint.state_dict``. The settings are a
:class:`~nbaccel.runtime.strategy.fsdp.fsdp_plugin.FullyShardedDataParallelPlugin`.

``prepare`` shards the submodules the wrap policy picks (bottom-up), then the root.
A model built on the ``meta`` device is materialised shard by shard: each rank
allocates only its shard (``to_empty``) and fills it with the modules'
``reset_parameters()`` -- or, with ``cpu_ram_efficient_loading``, with rank 0's real
weights, broadcast tensor by tensor. The optimizer the user created before ``prepare``
is pointed at the new (sharded) parameters by the facade, as for fp8.

Example:
    >>> FSDP.name
    'fsdp'
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ....errors import ConfigError
from ....platform import torchcompat
from ...process.state import DistributedType, ProcessState
from ...saving.sharded_state import owner_model
from ..base import SingleProcess
from ._fsdp_wrap import checkpoint_activations, materialize, wrap_targets
from .fsdp_plugin import FullyShardedDataParallelPlugin


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def _inner(optimizer: Any) -> Any:
    # PreparedOptimizer.step would skip/count steps; torch's state-dict helpers may step
    return getattr(optimizer, "optimizer", optimizer)


class FSDP(SingleProcess):
    """Shard trainable models with ``fully_shard`` (one shard per process).

    Raises:
        ConfigError: one process (nothing to shard), XLA devices, or fp8.
    """

    name = "fsdp"
    #: save_state writes one shard per rank (torch.distributed.checkpoint) when True
    sharded_checkpoints = True
    #: state dicts are gathered or written shard by shard: every rank takes part
    collective_state = True

    def __init__(
        self,
        state: ProcessState,
        plugin: FullyShardedDataParallelPlugin | None = None,
        *,
        mixed_precision: str = "no",
    ) -> None:
        if not torchcompat.fsdp_supported():
            major, minor = torchcompat.FSDP_MIN_TORCH
            raise ConfigError(
                f"strategy='fsdp' needs torch>={major}.{minor}; this is torch {torch.__version__}, "
                "where FSDP2 (fully_shard) on these devices is missing or gives different "
                f"results. Upgrade torch (pip install 'torch>={major}.{minor}') or use "
                "strategy='ddp'."
            )
        if state.world_size < 2:
            raise ConfigError(
                "FSDP shards the model across processes, but this is a single process: "
                "launch with several (notebook_launcher(fn, num_processes=2, ...) or "
                "LaunchConfig(strategy='fsdp', num_processes=2)), or drop fsdp_plugin."
            )
        if state.distributed_type is DistributedType.XLA:
            raise ConfigError(
                "FSDP is not available on XLA devices in nbaccel; use strategy='ddp' there."
            )
        if mixed_precision == "fp8":
            raise ConfigError(
                "mixed_precision='fp8' cannot be combined with FSDP in nbaccel; use 'bf16'."
            )
        super().__init__(dataclasses.replace(state, distributed_type=DistributedType.FSDP))
        self.plugin = plugin or FullyShardedDataParallelPlugin()
        self.sharded_checkpoints = self.plugin.state_dict_type == "SHARDED_STATE_DICT"
        self.mp_policy = self.plugin.mixed_precision_for(mixed_precision)
        self._mesh: Any = None
        self._models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    @property
    def mesh(self) -> Any:
        """The one-dimensional ``DeviceMesh`` over all processes (created on first use)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.state.device.type, (self.state.world_size,))
        return self._mesh

    def place_model(self, model: torch.nn.Module) -> torch.nn.Module:
        # fully_shard moves each shard to the mesh's device; a full .to() first would
        # allocate the whole model there (and fails on the meta device)
        return model

    def wrap_model(
        self, model: torch.nn.Module, *, ddp_kwargs: Mapping[str, Any] | None = None
    ) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(model, DistributedDataParallel):
            raise ConfigError(
                "this model is already wrapped in DistributedDataParallel, which cannot be "
                "sharded: pass the plain module (model.module) to prepare() with FSDP."
            )
        if isinstance(model, FSDPModule):  # the user called fully_shard already
            self._models.add(model)
            return model
        if not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to train (a frozen teacher): left as it is
        ignored = self.plugin.ignored_params(model)
        # a unit whose parameters are all ignored has nothing to shard
        targets = [
            t
            for t in wrap_targets(model, self.plugin)
            if not ignored or any(p not in ignored for p in t.parameters())
        ]
        if self.plugin.activation_checkpointing:
            checkpoint_activations(targets)
        before = {n: p for n, p in model.named_parameters() if p not in ignored}
        full = self._rank0_weights(model)
        kwargs: dict[str, Any] = {
            "mesh": self.mesh,
            "reshard_after_forward": self.plugin.reshard_after_forward,
            "mp_policy": self.mp_policy,
            "offload_policy": self.plugin.offload_policy(),
        }
        if ignored:  # left alone by FSDP: not sharded, gradients not reduced
            kwargs["ignored_params"] = ignored
        for module in targets:  # bottom-up: a unit is sharded before the unit around it
            fully_shard(module, **kwargs)
        fully_shard(model, **{**kwargs, "reshard_after_forward": self._root_reshard()})
        device = torch.device("cpu") if self.plugin.cpu_offload else self.state.device
        materialize(model, device, full)
        for param in ignored:  # FSDP does not place them: they stay whole, on this device
            if not param.is_meta:
                param.data = param.data.to(self.state.device)
        for old in before.values():  # the optimizer still points here until prepared:
            if not old.is_meta:  # keep the objects (ids), drop the unsharded storage
                old.data = torch.empty(0, dtype=old.dtype, device=old.device)
        self._models.add(model)
        from ...parallel.export import route_save_pretrained

        route_save_pretrained(model, strategy=self)  # its own would die on the shards
        return model

    def _root_reshard(self) -> bool | int | None:
        """``reshard_after_forward`` for the root: torch's own rule under the default
        ``True`` (FULL_SHARD).

        Backward needs the root's parameters first, so torch's default (``None``: ``True``
        for inner units, ``False`` for the root) keeps them gathered between forward and
        backward; an explicit ``True`` on the root frees them and all-gathers them again at
        the start of backward -- one more all-gather per step than the same model sharded by
        hand (measured: bench/RESULTS_MESH.md). ``False`` or an int is passed as given."""
        value = self.plugin.reshard_after_forward
        if value is not True:
            return value
        import inspect

        from torch.distributed.fsdp import fully_shard

        try:  # torch's None picks per module; a torch without it gets the root's value
            default = inspect.signature(fully_shard).parameters["reshard_after_forward"].default
        except (KeyError, TypeError, ValueError):
            default = True
        return None if default is None else False

    def _rank0_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """With cpu_ram_efficient_loading: rank 0's real weights, to be broadcast; else None."""
        if not self.plugin.cpu_ram_efficient_loading:
            return None
        real = [not any(t.is_meta for t in model.state_dict().values())]
        dist.broadcast_object_list(real, src=0)
        if not real[0]:
            return None  # rank 0 is on meta too: every rank initialises its own shard
        return model.state_dict() if self.state.is_main_process else {}

    def no_sync(self, model: Any) -> contextlib.AbstractContextManager[Any]:
        return _no_gradient_sync(model)

    def clip_grad_norm_(
        self, parameters: list[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        # on DTensor gradients torch computes the norm of the whole (unsharded) gradient
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        full_tensor = getattr(norm, "full_tensor", None)
        return full_tensor() if callable(full_tensor) else norm

    # -- state dicts: full on rank 0 (collectives: call on every rank) ---------------------

    def holds_dtensors(self, module: torch.nn.Module) -> bool:
        """Whether ``module``'s parameters are DTensors (its state dicts go through torch's
        DTensor-aware helpers); here: sharded by ``fully_shard``."""
        return _is_sharded(module)

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full state dict on the main process (``{}`` elsewhere); call on every rank."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        module = self.unwrap_model(model)
        if not self.holds_dtensors(module):
            return module.state_dict() if self.state.is_main_process else {}
        options = _options(full_state_dict=True, cpu_offload=True)
        state: Any = get_model_state_dict(module, options=options)  # tensors on rank 0 only
        return dict(state)

    def load_model_state_dict(
        self, model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True
    ) -> Any:
        """Load a full state dict (every rank passes it) into the sharded model."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        module = self.unwrap_model(model)
        if not self.holds_dtensors(module):
            return module.load_state_dict(state, strict=strict)
        options = _options(full_state_dict=True, strict=strict)
        return set_model_state_dict(module, dict(state), options=options)

    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any]:
        """The full optimizer state (parameter names as keys) on the main process."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        model = owner_model(self._models, optimizer)
        options = _options(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(model, _inner(optimizer), options=options)

    def load_optimizer_state_dict(self, optimizer: Any, state: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        model = owner_model(self._models, optimizer)
        set_optimizer_state_dict(
            model, _inner(optimizer), dict(state), options=_options(full_state_dict=True)
        )

    def __repr__(self) -> str:
        return f"FSDP(world_size={self.state.world_size}, plugin={self.plugin!r})"


def _is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def _no_gradient_sync(model: Any) -> Iterator[None]:
    """Accumulate unsharded gradients locally; the next synchronising backward reduces them."""
    from torch.distributed.fsdp import FSDPModule

    sharded = isinstance(model, FSDPModule)
    if sharded:
        model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        if sharded:
            model.set_requires_gradient_sync(True)


__all__ = ["FSDP"]
