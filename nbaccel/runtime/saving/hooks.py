"""Hooks run by ``save_state`` / ``load_state`` before the models are written or read.

``register_save_state_pre_hook(hook)``: ``hook(models, weights, output_dir)`` runs before
the model weights are written (``models``: the user's modules, unwrapped from DDP); ``weights`` holds one state dict per prepared model and a
hook may remove entries (it saved that model itself, e.g. with ``save_pretrained``) or
edit them. ``register_load_state_pre_hook(hook)``: ``hook(models, input_dir)`` runs before
the weights are read; removing a model from ``models`` skips loading it (the hook loaded
it). Both return a ``torch.utils.hooks.RemovableHandle``.

In nbaccel ``output_dir`` is the checkpoint's temporary directory: files a hook writes
there become part of the checkpoint, which then appears atomically under its final name.

Example:
    >>> calls = []
    >>> registry = HookRegistry()
    >>> handle = registry.add_save(lambda models, weights, out: calls.append(len(weights)))
    >>> registry.run_save([], [{"w": 1}], "ckpt"); calls
    [1]
    >>> handle.remove(); registry.run_save([], [], "ckpt"); calls
    [1]
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch.utils.hooks import RemovableHandle

SaveHook = Callable[[list[Any], list[dict[str, Any]], str], None]
LoadHook = Callable[[list[Any], str], None]


class HookRegistry:
    """The save/load pre-hooks of one Accelerator, in registration order."""

    def __init__(self) -> None:
        self.save: OrderedDict[int, SaveHook] = OrderedDict()
        self.load: OrderedDict[int, LoadHook] = OrderedDict()

    @staticmethod
    def _add(hooks: OrderedDict[int, Any], hook: Any, name: str) -> RemovableHandle:
        if not callable(hook):
            raise TypeError(f"{name}(hook) needs a callable, got {type(hook).__name__}.")
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def add_save(self, hook: SaveHook) -> RemovableHandle:
        """Register ``hook(models, weights, output_dir)``."""
        return self._add(self.save, hook, "register_save_state_pre_hook")

    def add_load(self, hook: LoadHook) -> RemovableHandle:
        """Register ``hook(models, input_dir)``."""
        return self._add(self.load, hook, "register_load_state_pre_hook")

    def run_save(self, models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
        for hook in list(self.save.values()):
            hook(models, weights, output_dir)

    def run_load(self, models: list[Any], input_dir: str) -> None:
        for hook in list(self.load.values()):
            hook(models, input_dir)


def _user_models(acc: Any) -> list[Any]:
    # As in Accelerate, hooks get the user's modules, not the DDP wrappers around them
    # (diffusers' hooks call model.save_pretrained / register_to_config on them).
    return [acc.strategy.unwrap_model(model) for model in acc._models]


def weights_to_save(acc: Any, output_dir: Any) -> list[dict[str, Any]]:
    """The models' state dicts after the save pre-hooks had their say."""
    weights = [acc.strategy.model_state_dict(model) for model in acc._models]
    registry = getattr(acc, "_hooks", None)
    if registry is not None:
        registry.run_save(_user_models(acc), weights, str(output_dir))
    return weights


def models_to_load(acc: Any, input_dir: Any) -> list[Any]:
    """The models (the user's modules) still to load after the load pre-hooks had their say."""
    models = _user_models(acc)
    registry = getattr(acc, "_hooks", None)
    if registry is not None:
        registry.run_load(models, str(input_dir))
    return models


__all__ = ["HookRegistry", "models_to_load", "weights_to_save"]
