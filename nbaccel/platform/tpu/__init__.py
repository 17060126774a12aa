"""The TPU backend: one small protocol, one module per implementation, a registry.

* :mod:`.base` -- the :class:`TpuBackend` protocol (detect, count devices, start the
  processes, the device and world, the collectives' mapping, the after-step hook,
  save/load) and the TPU host markers;
* :mod:`.torch_xla_backend` -- torch_xla, the first implementation;
* :mod:`.registry` -- which backends exist and which one is used here.

Layers: this package is part of ``platform/`` and imports only ``errors`` and
``platform``; the layers above call it, each for its part (``runtime``: device, world,
process group, after-step hook, RNG state; ``checkpoint``: tensor ids; ``launch``:
start). A second TPU backend is a new module here and one :func:`register_backend` call.

Example:
    >>> from nbaccel.platform import tpu
    >>> tpu.backends()[0].name
    'torch_xla'
"""

from __future__ import annotations

from .base import TPU_ENV_MARKERS, TpuBackend, TpuWorld, tpu_present
from .registry import (
    active_backend,
    backend_for,
    backends,
    check_process_count,
    loaded_backend,
    register_backend,
    require_backend,
    unregister_backend,
)

__all__ = [
    "TPU_ENV_MARKERS",
    "TpuBackend",
    "TpuWorld",
    "active_backend",
    "backend_for",
    "backends",
    "check_process_count",
    "loaded_backend",
    "register_backend",
    "require_backend",
    "tpu_present",
    "unregister_backend",
]
