"""The TPU backend in the process that trains (imports its runtime on first use).

Thin: every call goes to the active backend of :mod:`nbaccel.platform.tpu` (torch_xla
today). With several workers, :mod:`nbaccel.runtime.process.state` joins them in a
``torch.distributed`` group with the backend's process-group backend (``"xla"``), so DDP
and :mod:`nbaccel.runtime.collectives.ops` need no TPU-specific collectives.

Example:
    >>> import torch
    >>> is_xla(torch.device("cpu"))
    False
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..platform.tpu import (
    TpuBackend,
    TpuWorld,
    active_backend,
    backend_for,
    loaded_backend,
    require_backend,
)

if TYPE_CHECKING:  # pragma: no cover - torch is imported lazily
    import torch

#: The ``torch.distributed`` backend name torch_xla registers.
XLA_BACKEND = "xla"
XlaWorld = TpuWorld  # the name this module has always used


def _backend() -> TpuBackend:
    return loaded_backend() or require_backend()


def process_group_backend() -> str:
    """The ``torch.distributed`` backend of the TPU backend in use (``"xla"``: torch_xla)."""
    backend = loaded_backend() or active_backend()
    return backend.process_group_backend if backend is not None else XLA_BACKEND


def xla_device() -> torch.device:
    """This process's TPU device (starts the runtime); registers the process-group backend."""
    return require_backend().device()


def xla_world() -> TpuWorld:
    """Rank, world size, local rank/size and host index from the backend's runtime."""
    return _backend().world()


def init_process_group_kwargs() -> dict[str, Any]:
    """``init_process_group`` arguments for the backend's process-group backend."""
    return _backend().init_process_group_kwargs()


def mark_step() -> None:
    """The after-step hook: run the lazy graph; a no-op when no TPU runtime is loaded."""
    backend = loaded_backend()
    if backend is not None:
        backend.after_step()


def is_xla(obj: Any) -> bool:
    """True for a TPU ``torch.device``, tensor, or an optimizer/module with TPU parameters."""
    device = getattr(obj, "device", obj)
    if backend_for(getattr(device, "type", None) or "") is not None:
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
    """What identifies a TPU tensor's data (TPU tensors have no storage pointer)."""
    backend = backend_for(tensor.device.type)
    assert backend is not None, tensor.device
    return backend.tensor_id(tensor)


__all__ = [
    "XLA_BACKEND",
    "XlaWorld",
    "init_process_group_kwargs",
    "is_xla",
    "mark_step",
    "process_group_backend",
    "storage_id",
    "xla_device",
    "xla_world",
]
