"""Checkpoints and model export as ``Accelerator`` methods.

A mixin: ``save_state``/``load_state`` (:mod:`nbaccel.runtime.saving.checkpointing`),
``save_model``/``save`` (:mod:`nbaccel.runtime.saving.model_io`), the save/load pre-hooks,
``register_for_checkpointing`` and ``get_state_dict``. The class provides the prepared
objects (``_models``, ``_optimizers``...), ``strategy``, ``state`` and ``_hooks``.

Under replicated training (one process, DDP) each of these may be called on the main
process alone; under FSDP every rank must call them (an error names the ranks that did
not).

Example:
    >>> from nbaccel import Accelerator
    >>> import torch, tempfile
    >>> accelerator = Accelerator(cpu=True)
    >>> model = accelerator.prepare(torch.nn.Linear(2, 2))
    >>> path = accelerator.save_state(tempfile.mkdtemp())
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ..process import rank_check
from ..saving import checkpointing, model_io
from ..saving._checkpoint_collective import FIX
from ..saving.hooks import HookRegistry


class CheckpointAPI:
    """save_state, load_state, save_model, save, hooks, registered objects."""

    strategy: Any
    _custom_objects: list[Any]
    _hooks: HookRegistry

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> Any:
        """The model's full state dict (FSDP: gathered on the main process; call on every rank)."""
        if self.strategy.collective_state:
            rank_check.all_ranks_enter("get_state_dict", FIX)
        return self.strategy.model_state_dict(model)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include ``objects`` (each with ``state_dict``/``load_state_dict``) in save_state."""
        for i, obj in enumerate(objects):
            missing = [
                m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))
            ]
            if missing:
                raise TypeError(
                    f"register_for_checkpointing argument {i} ({type(obj).__name__}) lacks "
                    f"{' and '.join(missing)}(); give it state_dict() and load_state_dict(state)."
                )
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """Call ``hook(models, weights, output_dir)`` in :meth:`save_state` before weights are
        written (remove an entry of ``weights`` to skip it); returns a removable handle."""
        return self._hooks.add_save(hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """Call ``hook(models, input_dir)`` in :meth:`load_state` before weights are read
        (remove a model from ``models`` to skip it); returns a removable handle."""
        return self._hooks.add_load(hook)

    def save_state(self, output_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
        """Atomically save models, optimizers, schedulers, scaler, RNG and loader positions."""

        return checkpointing.save_state(self, output_dir, **kwargs)

    def load_state(self, input_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
        """Restore what :meth:`save_state` wrote (the latest checkpoint if ``input_dir`` is None)."""

        return checkpointing.load_state(self, input_dir, **kwargs)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> Any:
        """Write the unwrapped model's weights (main process), sharded when large."""

        return model_io.save_model(self, model, save_directory, max_shard_size, safe_serialization)

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> Any:
        """``torch.save`` once per machine (safetensors with ``safe_serialization``)."""

        return model_io.save(self, obj, f, safe_serialization=safe_serialization)


__all__ = ["CheckpointAPI"]
