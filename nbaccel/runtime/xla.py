"""torch_xla device helpers for the process that trains (imports torch_xla on first use).

With several workers, :mod:`nbaccel.runtime.state` joins them in a
``torch.distributed`` group with torch_xla's ``"xla"`` backend, so DDP and
:mod:`nbaccel.runtime.ops` need no XLA-specific collectives.

Example:
    >>> import torch
    >>> is_xla(torch.device("cpu"))
    False
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # pragma: no cover - torch is imported lazily
    import torch

#: The ``torch.distributed`` backend name torch_xla registers.
XLA_BACKEND = "xla"


class XlaWorld(NamedTuple):
    """Where this process stands among the XLA workers (from the torch_xla runtime)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int


def xla_device() -> torch.device:
    """This process's XLA device (starts the runtime); registers the ``"xla"`` backend."""
    import torch_xla
    import torch_xla.distributed.xla_backend  # registers the "xla" process-group backend

    device = getattr(torch_xla, "device", None)
    if device is not None:  # torch_xla >= 2.5
        return device()
    import torch_xla.core.xla_model as xm  # pragma: no cover - older torch_xla

    return xm.xla_device()  # pragma: no cover


def xla_world() -> XlaWorld:
    """Rank, world size, local rank/size and host index from the torch_xla runtime."""
    import torch_xla.runtime as xr

    world_size = int(xr.world_size())
    local_world_size = max(1, int(xr.local_process_count()) * int(xr.addressable_device_count()))
    local_world_size = min(local_world_size, world_size)
    rank = int(xr.global_ordinal()) if world_size > 1 else 0
    local_rank = int(xr.local_ordinal()) if world_size > 1 else 0
    return XlaWorld(rank, world_size, local_rank, local_world_size, int(xr.host_index()))


def init_process_group_kwargs() -> dict[str, Any]:
    """``init_process_group`` arguments for the ``"xla"`` backend (registers it first)."""
    import torch_xla.distributed.xla_backend  # noqa: F401

    return {"init_method": "xla://"}


def mark_step() -> None:
    """Cut the lazy graph and run it (``torch_xla.sync``); a no-op without torch_xla."""
    if "torch_xla" not in sys.modules:
        return
    import torch_xla

    sync = getattr(torch_xla, "sync", None)
    if sync is not None:
        sync()
    else:  # pragma: no cover - torch_xla < 2.6
        import torch_xla.core.xla_model as xm

        xm.mark_step()


def is_xla(obj: Any) -> bool:
    """True for an XLA ``torch.device``, tensor, or an optimizer/module with XLA parameters."""
    device = getattr(obj, "device", obj)
    if getattr(device, "type", None) == "xla":
        return True
    groups = getattr(obj, "param_groups", None)
    if groups:
        return any(is_xla(p) for g in groups for p in g["params"][:1])
    params = getattr(obj, "parameters", None)
    if callable(params):
        first = next(iter(params()), None)
        return first is not None and is_xla(first)
    return False


def storage_id(tensor: torch.Tensor) -> int:
    """What identifies an XLA tensor's data (XLA tensors have no storage pointer)."""
    import torch_xla

    return int(torch_xla._XLAC._xla_get_tensor_id(tensor))


__all__ = [
    "XLA_BACKEND",
    "XlaWorld",
    "init_process_group_kwargs",
    "is_xla",
    "mark_step",
    "storage_id",
    "xla_device",
    "xla_world",
]
