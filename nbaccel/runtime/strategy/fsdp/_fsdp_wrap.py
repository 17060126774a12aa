"""What FSDP2 shards as a unit, activation checkpointing, and materialising meta models.

* :func:`wrap_targets`: the submodules the plugin's wrap policy picks, children
  before their parents (``fully_shard`` must see inner units first);
* :func:`checkpoint_activations`: those blocks recompute their activations in backward;
* :func:`materialize`: after sharding, a model on the ``meta`` device gets real memory
  for its shard only, then values: rank 0's weights broadcast tensor by tensor
  (``cpu_ram_efficient_loading``) or the modules' own ``reset_parameters()``.

Example:
    >>> import torch
    >>> from nbaccel.runtime.strategy.fsdp.fsdp_plugin import FullyShardedDataParallelPlugin
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="size_based_wrap", min_num_params=16)
    >>> [type(m).__name__ for m in wrap_targets(model, plugin)]
    ['Linear']
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ....errors import ConfigError


def wrap_targets(model: torch.nn.Module, plugin: Any) -> list[torch.nn.Module]:
    """Submodules (never ``model`` itself) that become their own sharding unit, inner first.

    Raises:
        ConfigError: ``transformer_cls_names_to_wrap`` names a class the model lacks.
    """
    policy = plugin.auto_wrap_policy
    names = list(plugin.transformer_cls_names_to_wrap or [])
    if policy is None:  # nothing chosen: the named blocks, else by size, else the model's hint
        policy = (
            "size_based_wrap" if plugin.min_num_params and not names else "transformer_based_wrap"
        )
    if policy == "no_wrap":
        return []
    if policy == "size_based_wrap":
        found: list[torch.nn.Module] = []
        _by_size(model, model, int(plugin.min_num_params or 0), found)
        return found
    if callable(policy):
        pick: Callable[[torch.nn.Module], bool] = policy
    else:  # transformer_based_wrap
        names = names or list(getattr(model, "_no_split_modules", None) or [])
        present = {type(m).__name__ for m in model.modules()}
        missing = sorted(set(names) - present)
        if missing:
            raise ConfigError(
                f"transformer_cls_names_to_wrap names {missing}, which this model does not "
                f"contain; its module classes are {sorted(present)}."
            )
        wanted = set(names)

        def pick(module: torch.nn.Module) -> bool:
            return type(module).__name__ in wanted

    # reversed pre-order: every module comes after all of its descendants
    return [m for m in reversed(list(model.modules())) if m is not model and pick(m)]


def _by_size(root: torch.nn.Module, module: torch.nn.Module, minimum: int, found: list[Any]) -> int:
    """Bottom-up: a module becomes a unit once the parameters not yet in a unit reach
    ``minimum``; returns the count it leaves to its parent."""
    left = sum(p.numel() for p in module.parameters(recurse=False))
    for child in module.children():
        left += _by_size(root, child, minimum, found)
    if module is not root and minimum > 0 and left >= minimum:
        found.append(module)
        return 0
    return left


class CheckpointedForward:
    """A block's ``forward`` under ``torch.utils.checkpoint`` (activations recomputed)."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        functools.update_wrapper(self, forward)
        self.__wrapped__ = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.__wrapped__, *args, use_reentrant=False, **kwargs)


def checkpoint_activations(blocks: list[torch.nn.Module]) -> None:
    """Recompute each block's activations in backward (the instance ``forward`` is
    replaced, so parameter names -- and checkpoints -- stay as they were)."""
    if not blocks:
        raise ConfigError(
            "activation_checkpointing=True needs blocks to checkpoint, but the wrap policy "
            "picked none: set auto_wrap_policy/transformer_cls_names_to_wrap (or min_num_params)."
        )
    for block in blocks:
        if not isinstance(block.__dict__.get("forward"), CheckpointedForward):
            block.forward = CheckpointedForward(block.forward)


def materialize(
    model: torch.nn.Module, device: torch.device, rank0_weights: dict[str, torch.Tensor] | None
) -> None:
    """Give a sharded model that is (partly) on ``meta`` real memory and values, per shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    if rank0_weights is not None:  # every rank takes part in the broadcast
        if on_meta:
            model.to_empty(device=device)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, dict[str, Any](rank0_weights), options=options)
        return
    if not on_meta:
        return
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


__all__ = ["CheckpointedForward", "checkpoint_activations", "materialize", "wrap_targets"]
