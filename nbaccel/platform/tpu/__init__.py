"""The TPU backend: one small protocol, one module per implementation, and which one is used.

* :mod:`.base` -- the :class:`TpuBackend` protocol (detect, count devices, start the
  processes, the device and world, the after-step hook, save/load) and the TPU host markers;
* :mod:`.torch_xla_backend` -- torch_xla, the implementation today (its successor is a new
  module here and one :func:`register_backend` call);
* here -- which backends exist, which one is used, and the answers the layers above ask
  (``xla_requested``, ``process_group_backend``, ``after_step``); how many processes a TPU
  launch starts is the launcher's (``nbaccel.launch.start._tpu``).

Backends are tried in registration order; torch_xla is registered first, on first use (no
import-time side effects). Detection is pure: a backend's package is located, never
imported, so asking costs nothing and starts no runtime. Layers: this package is part of
``platform/`` and imports only ``errors`` and ``platform``; ``runtime`` (device, world,
process group, after-step hook, RNG state), ``checkpoint`` (tensor ids) and ``launch``
(start) call it, each for its part.

Example:
    >>> [b.name for b in backends()]
    ['torch_xla']
    >>> active_backend({}) is None, xla_requested({})     # no PJRT_DEVICE, no TPU markers
    (True, False)
"""

from __future__ import annotations

from collections.abc import Mapping

from ...errors import LaunchError
from .base import TPU_ENV_MARKERS, TpuBackend, TpuWorld, tpu_present

_BACKENDS: list[TpuBackend] = []


def _ensure_builtin() -> None:
    if not _BACKENDS:
        from .torch_xla_backend import TorchXlaBackend

        _BACKENDS.append(TorchXlaBackend())


def register_backend(backend: TpuBackend, *, first: bool = False) -> None:
    """Make ``backend`` one of the TPU backends nbaccel tries.

    Args:
        backend: an object implementing :class:`~nbaccel.platform.tpu.TpuBackend`.
        first: try it before the ones already registered (e.g. a successor of torch_xla).

    Raises:
        TypeError: ``backend`` does not implement the protocol.
    """
    if not isinstance(backend, TpuBackend):
        raise TypeError(
            f"register_backend({backend!r}): not a TpuBackend (see nbaccel.platform.tpu.base)."
        )
    _ensure_builtin()
    _BACKENDS[:] = [b for b in _BACKENDS if b.name != backend.name]
    _BACKENDS.insert(0 if first else len(_BACKENDS), backend)


def unregister_backend(name: str) -> None:
    """Forget the backend called ``name`` (the built-in one comes back when none is left)."""
    _BACKENDS[:] = [b for b in _BACKENDS if b.name != name]


def backends() -> tuple[TpuBackend, ...]:
    """The registered backends, in the order they are tried."""
    _ensure_builtin()
    return tuple(_BACKENDS)


def active_backend(environ: Mapping[str, str] | None = None) -> TpuBackend | None:
    """The backend training should run on here (installed and requested), or None."""
    return next((b for b in backends() if b.requested(environ)), None)


def loaded_backend() -> TpuBackend | None:
    """The backend whose runtime is imported in this process (for hooks that must be
    no-ops otherwise: the after-step hook, RNG state), or None."""
    return next((b for b in backends() if b.loaded()), None)


def backend_for(device_type: str) -> TpuBackend | None:
    """The backend whose tensors have ``device_type`` (e.g. ``"xla"``), or None."""
    return next((b for b in backends() if b.device_type == device_type), None)


def require_backend(environ: Mapping[str, str] | None = None) -> TpuBackend:
    """The active backend, or a ``LaunchError`` that says what to install.

    Raises:
        LaunchError: no backend is installed (or none is requested here).
    """
    backend = active_backend(environ)
    if backend is not None:
        return backend
    names = " or ".join(b.package for b in backends())
    raise LaunchError(
        f"TPU/XLA launch requested (PJRT_DEVICE or a TPU host) but {names} is not "
        f"installed: pip install {names} matching your torch version, or unset "
        "PJRT_DEVICE / pass compute_device='cpu'."
    )


def xla_requested(environ: Mapping[str, str] | None = None) -> bool:
    """True when training should run on a TPU backend: installed and ``PJRT_DEVICE`` set
    (``CPU`` counts: it is how the XLA path runs without a TPU) or a TPU host.

    Args:
        environ: mapping to read; ``os.environ`` by default.
    """
    return active_backend(environ) is not None


def runtime_initialized() -> bool:
    """True when this process has already started a TPU backend's runtime."""
    backend = loaded_backend()
    return backend is not None and backend.runtime_initialized()


def training_backend() -> TpuBackend:
    """In the process that trains: the backend whose runtime is loaded, else the active one
    (or the ``LaunchError`` of :func:`require_backend`)."""
    return loaded_backend() or require_backend()


def process_group_backend() -> str:
    """The ``torch.distributed`` backend of the TPU backend in use (``"xla"``: torch_xla's)."""
    backend = loaded_backend() or active_backend()
    return backend.process_group_backend if backend is not None else "xla"


def after_step() -> None:
    """Run what the step recorded (lazy tensors); a no-op when no TPU runtime is loaded."""
    backend = loaded_backend()
    if backend is not None:
        backend.after_step()


__all__ = [
    "TPU_ENV_MARKERS",
    "TpuBackend",
    "TpuWorld",
    "active_backend",
    "after_step",
    "backend_for",
    "backends",
    "loaded_backend",
    "process_group_backend",
    "register_backend",
    "require_backend",
    "runtime_initialized",
    "tpu_present",
    "training_backend",
    "unregister_backend",
    "xla_requested",
]
