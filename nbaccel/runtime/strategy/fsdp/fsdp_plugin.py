"""``FullyShardedDataParallelPlugin``: how FSDP2 (``torch.distributed.fsdp.fully_shard``) shards.

The field names are the documented ones of the best-known peer, where they apply to
FSDP2. Fields that only made sense for the legacy ``FullyShardedDataParallel`` wrapper
(``sharding_strategy``, ``backward_prefetch``, ``use_orig_params``, ...) are accepted
as ``None`` only; any other value raises a ``ConfigError`` that names the FSDP2
equivalent. Without an explicit plugin, ``Accelerator()`` builds one from the launch
configuration (``LaunchConfig(strategy="fsdp", fsdp_...)``, ``NBACCEL_STRATEGY=fsdp``,
the YAML file), see :func:`fsdp_from_launch_config`.

Example:
    >>> plugin = FullyShardedDataParallelPlugin(
    ...     auto_wrap_policy="size_based_wrap", min_num_params=1_000_000
    ... )
    >>> plugin.auto_wrap_policy, plugin.state_dict_type
    ('size_based_wrap', 'SHARDED_STATE_DICT')
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ....config import LaunchConfig, launch_config
from ....config.choices import FSDP_STATE_DICT_TYPES, FSDP_WRAP_POLICIES
from ....errors import ConfigError

# legacy-wrapper field -> what to use with FSDP2 instead
_FSDP1_ONLY: dict[str, str] = {
    "sharding_strategy": "reshard_after_forward=True (FULL_SHARD) or False (SHARD_GRAD_OP); "
    "for NO_SHARD use DDP (strategy='ddp')",
    "backward_prefetch": "nothing: FSDP2 prefetches the next unit's all-gather implicitly",
    "forward_prefetch": "nothing: FSDP2 prefetches the next unit's all-gather implicitly",
    "use_orig_params": "nothing: FSDP2 always keeps the original parameters (as DTensors)",
    "sync_module_states": "cpu_ram_efficient_loading=True (rank 0's weights are sharded out)",
    "limit_all_gathers": "nothing: FSDP2 bounds in-flight all-gathers itself",
    "param_init_fn": "build the model on the meta device; prepare() materialises each shard "
    "with the modules' reset_parameters()",
    "state_dict_config": "state_dict_type='SHARDED_STATE_DICT' or 'FULL_STATE_DICT'",
    "optim_state_dict_config": "state_dict_type='SHARDED_STATE_DICT' or 'FULL_STATE_DICT'",
}


@dataclass
class FullyShardedDataParallelPlugin:
    """Settings of the FSDP2 strategy; pass it as ``Accelerator(fsdp_plugin=...)``.

    Args:
        fsdp_version: 2 (the only version nbaccel implements: ``fully_shard``).
        reshard_after_forward: free the gathered parameters after forward (``True``,
            ZeRO-3-like), keep them until backward (``False``, ZeRO-2-like), or an int:
            reshard to that many ranks. Under ``True`` the root module keeps its
            parameters gathered until backward, which needs them first (torch's own
            default for ``fully_shard``; Accelerate reshards the root too, at the cost of
            one more all-gather per step).
        auto_wrap_policy: which submodules become their own sharding unit (gathered and
            freed one at a time): ``"transformer_based_wrap"`` (the classes named in
            ``transformer_cls_names_to_wrap``, else the model's ``_no_split_modules``),
            ``"size_based_wrap"`` (submodules with >= ``min_num_params`` parameters),
            ``"no_wrap"`` (only the root), or a callable ``module -> bool``.
        transformer_cls_names_to_wrap: block class names (a list or a comma-separated str).
        min_num_params: threshold of ``"size_based_wrap"``.
        cpu_offload: keep shards, gradients and optimizer state on the CPU (a bool or a
            ``torch.distributed.fsdp.CPUOffloadPolicy``).
        mixed_precision_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy``, a dict
            of its fields (dtypes or names like ``"bfloat16"``), or ``None``: derived from
            ``mixed_precision`` ("bf16"/"fp16": parameters and gradient reduction in that
            dtype).
        activation_checkpointing: recompute the wrapped blocks' activations in backward.
        state_dict_type: ``"SHARDED_STATE_DICT"`` (save_state writes a shard per rank
            with ``torch.distributed.checkpoint``) or ``"FULL_STATE_DICT"`` (rank 0 writes
            full files).
        cpu_ram_efficient_loading: only rank 0 holds real weights; the other ranks build
            the model on the ``meta`` device and receive their shards from rank 0 in
            ``prepare``.
        ignored_modules: modules (or a regular expression matched against module names)
            whose parameters FSDP leaves alone: not sharded, and their gradients not
            reduced (``fully_shard(ignored_params=...)``; keep them frozen, or synchronise
            them yourself).

    Raises:
        ConfigError: an unknown wrap policy or state-dict type, ``fsdp_version=1``, or a
            legacy-only field (the message names the FSDP2 equivalent).
    """

    fsdp_version: int = 2
    reshard_after_forward: bool | int = True
    auto_wrap_policy: str | Callable[[torch.nn.Module], bool] | None = None
    transformer_cls_names_to_wrap: list[str] | str | None = None
    min_num_params: int | None = None
    cpu_offload: Any = False
    mixed_precision_policy: Any = None
    activation_checkpointing: bool = False
    state_dict_type: str = "SHARDED_STATE_DICT"
    cpu_ram_efficient_loading: bool = False
    ignored_modules: Any = None
    # legacy FullyShardedDataParallel-only settings: None, or a ConfigError naming the fix
    sharding_strategy: Any = field(default=None, repr=False)
    backward_prefetch: Any = field(default=None, repr=False)
    forward_prefetch: Any = field(default=None, repr=False)
    use_orig_params: Any = field(default=None, repr=False)
    sync_module_states: Any = field(default=None, repr=False)
    limit_all_gathers: Any = field(default=None, repr=False)
    param_init_fn: Any = field(default=None, repr=False)
    state_dict_config: Any = field(default=None, repr=False)
    optim_state_dict_config: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.fsdp_version != 2:
            raise ConfigError(
                f"fsdp_version={self.fsdp_version!r}: nbaccel implements FSDP2 "
                "(torch.distributed.fsdp.fully_shard) only; pass fsdp_version=2 or leave it out."
            )
        for name, instead in _FSDP1_ONLY.items():
            if getattr(self, name) is not None:
                raise ConfigError(
                    f"FullyShardedDataParallelPlugin({name}={getattr(self, name)!r}) belongs to "
                    f"the legacy FSDP wrapper; with FSDP2 use {instead}."
                )
        if isinstance(self.reshard_after_forward, str):
            raise ConfigError(
                f"reshard_after_forward={self.reshard_after_forward!r} must be True, False or "
                "an int; FULL_SHARD is True, SHARD_GRAD_OP is False."
            )
        self.auto_wrap_policy = _check_policy(self.auto_wrap_policy)
        if isinstance(self.transformer_cls_names_to_wrap, str):
            names = self.transformer_cls_names_to_wrap.split(",")
            self.transformer_cls_names_to_wrap = [n.strip() for n in names if n.strip()]
        if self.auto_wrap_policy == "size_based_wrap" and self.min_num_params is None:
            raise ConfigError(
                "auto_wrap_policy='size_based_wrap' needs min_num_params (parameters a "
                "submodule must hold to become its own sharding unit), e.g. 1_000_000."
            )
        kind = str(getattr(self.state_dict_type, "name", self.state_dict_type)).upper()
        if kind not in FSDP_STATE_DICT_TYPES:
            raise ConfigError(
                f"state_dict_type={self.state_dict_type!r} is unknown; use "
                f"{' or '.join(FSDP_STATE_DICT_TYPES)} (LOCAL_STATE_DICT is legacy-FSDP only)."
            )
        self.state_dict_type = kind

    @classmethod
    def from_config(cls, cfg: LaunchConfig) -> FullyShardedDataParallelPlugin:
        """The plugin a :class:`~nbaccel.LaunchConfig` with ``strategy="fsdp"`` describes.

        Example:
            >>> cfg = LaunchConfig(strategy="fsdp", fsdp_auto_wrap_policy="no_wrap")
            >>> FullyShardedDataParallelPlugin.from_config(cfg).auto_wrap_policy
            'no_wrap'
        """
        return cls(
            reshard_after_forward=cfg.fsdp_reshard_after_forward,
            auto_wrap_policy=cfg.fsdp_auto_wrap_policy,
            transformer_cls_names_to_wrap=cfg.fsdp_transformer_cls_names_to_wrap,
            min_num_params=cfg.fsdp_min_num_params,
            cpu_offload=cfg.fsdp_cpu_offload,
            activation_checkpointing=cfg.fsdp_activation_checkpointing,
            state_dict_type=cfg.fsdp_state_dict_type,
            cpu_ram_efficient_loading=cfg.fsdp_cpu_ram_efficient_loading,
        )

    def mixed_precision_for(self, mixed_precision: str) -> Any:
        """The ``MixedPrecisionPolicy`` for ``fully_shard``, given the Accelerator's precision."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = self.mixed_precision_policy
        if isinstance(policy, MixedPrecisionPolicy):
            return policy
        if isinstance(policy, Mapping):
            return MixedPrecisionPolicy(**{k: _dtype(k, v) for k, v in policy.items()})
        if policy is not None:
            raise ConfigError(
                f"mixed_precision_policy={policy!r} must be a torch.distributed.fsdp."
                "MixedPrecisionPolicy, a dict of its fields, or None."
            )
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
        return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low)

    def ignored_params(self, model: torch.nn.Module) -> set[torch.nn.Parameter]:
        """The parameters of ``ignored_modules`` in ``model`` (a regex matches module names)."""
        spec = self.ignored_modules
        if spec is None:
            return set()
        if isinstance(spec, str):
            pattern = re.compile(spec)
            modules = [m for name, m in model.named_modules() if pattern.fullmatch(name)]
        else:
            modules = list(spec)
            wrong = [type(m).__name__ for m in modules if not isinstance(m, torch.nn.Module)]
            if wrong:
                raise ConfigError(
                    f"ignored_modules holds {wrong}: pass torch modules, or a regular "
                    "expression matching module names (e.g. 'lm_head|.*norm')."
                )
        return {p for m in modules for p in m.parameters()}

    def offload_policy(self) -> Any:
        """The ``OffloadPolicy`` for ``fully_shard`` (``CPUOffloadPolicy`` when offloading)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if isinstance(self.cpu_offload, OffloadPolicy):
            return self.cpu_offload
        return CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()


def _check_policy(policy: Any) -> Any:
    if policy is None or callable(policy):
        return policy
    text = str(policy).strip().lower()
    aliases = {"transformer_auto_wrap_policy": "transformer_based_wrap"}
    aliases["size_based_auto_wrap_policy"] = "size_based_wrap"
    text = aliases.get(text, text)
    if text not in FSDP_WRAP_POLICIES:
        raise ConfigError(
            f"auto_wrap_policy={policy!r} is unknown; use one of "
            f"{', '.join(FSDP_WRAP_POLICIES)}, or a callable module -> bool."
        )
    return text


def _dtype(name: str, value: Any) -> Any:
    if value is None or isinstance(value, torch.dtype) or name == "cast_forward_inputs":
        return value
    dtype = getattr(torch, str(value).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"mixed_precision_policy[{name!r}]={value!r} is not a torch dtype.")
    return dtype


def check_fsdp_arguments(
    plugin: Any, unexpected: Mapping[str, Any]
) -> FullyShardedDataParallelPlugin | None:
    """Validate ``Accelerator(fsdp_plugin=...)`` before anything else happens; return it.

    Raises:
        ConfigError: ``plugin`` is not a plugin, or ``deepspeed_plugins`` is given too.
    """
    if plugin is not None and not isinstance(plugin, FullyShardedDataParallelPlugin):
        raise ConfigError(
            f"fsdp_plugin={plugin!r} must be a nbaccel.FullyShardedDataParallelPlugin "
            "(from nbaccel import FullyShardedDataParallelPlugin)."
        )
    if plugin is not None and unexpected.get("deepspeed_plugins") is not None:
        raise ConfigError("fsdp_plugin and deepspeed_plugins were both given: choose one strategy.")
    return plugin


def fsdp_from_launch_config() -> FullyShardedDataParallelPlugin | None:
    """The plugin the launch configuration asks for (``strategy="fsdp"``), else ``None``.

    ``notebook_launcher(config=LaunchConfig(strategy="fsdp", ...))`` and the panel hand
    their configuration to the workers; elsewhere ``NBACCEL_STRATEGY``/``NBACCEL_FSDP_*``
    and the YAML file are read (see :func:`nbaccel.config.launch_config`).
    """
    cfg = launch_config()
    return FullyShardedDataParallelPlugin.from_config(cfg) if cfg.strategy == "fsdp" else None


__all__ = ["FullyShardedDataParallelPlugin", "check_fsdp_arguments", "fsdp_from_launch_config"]
