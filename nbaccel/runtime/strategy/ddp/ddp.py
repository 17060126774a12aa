"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced.

Example:
    >>> from nbaccel.runtime.strategy import select_strategy  # doctest: +SKIP
    >>> select_strategy(state)  # several processes on CPU or GPU  # doctest: +SKIP
    DDP(world_size=2)
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ....platform import torchcompat
from ..base import SingleProcess
from .comm_hooks import register_comm_hook


class DDP(SingleProcess):
    """Wrap trainable models in ``DistributedDataParallel`` (one device per process)."""

    name = "ddp"

    def wrap_model(
        self, model: torch.nn.Module, *, ddp_kwargs: Mapping[str, Any] | None = None
    ) -> torch.nn.Module:
        if isinstance(model, DistributedDataParallel):  # the user wrapped it already
            return model
        if not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronise (a frozen teacher, a metric module)
        torchcompat.check_ddp_debug_level()  # an error, not torch's crash
        kwargs = dict(ddp_kwargs or {})
        hook = [kwargs.pop(k, None) for k in ("comm_hook", "comm_wrapper", "comm_state_option")]
        device = self.state.device
        if device.type == "cuda":
            kwargs.setdefault("device_ids", [device.index])
            kwargs.setdefault("output_device", device.index)
        wrapped = DistributedDataParallel(model, **kwargs)
        if hook[0] is not None:  # torch's own gradient communication hook
            register_comm_hook(wrapped, hook[0], hook[1] or "no", hook[2])
        return wrapped

    def no_sync(self, model: Any) -> contextlib.AbstractContextManager[Any]:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()


__all__ = ["DDP"]
