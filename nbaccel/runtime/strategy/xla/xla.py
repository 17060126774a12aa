"""torch_xla devices: DDP over the ``"xla"`` process-group backend, plus graph cuts.

XLA tensors are lazy graphs until cut, so every real optimizer step ends with
``torch_xla.sync()`` (:func:`nbaccel.platform.tpu.after_step`).

Example:
    >>> XLA.name
    'xla'
"""

from __future__ import annotations

from typing import Any

from ....platform import tpu
from ..ddp.ddp import DDP


class XLA(DDP):
    """DDP on XLA devices (one process may also run alone: then no wrapper is added)."""

    name = "xla"

    def wrap_model(self, model: Any, *, ddp_kwargs: Any = None) -> Any:
        if self.state.world_size == 1:
            return model
        return super().wrap_model(model, ddp_kwargs=ddp_kwargs)

    def after_optimizer_step(self, optimizer: Any) -> None:
        tpu.after_step()  # run the update now: XLA tensors are lazy graphs until cut


__all__ = ["XLA"]
