"""Whether a TPU backend is here and wanted (TPUs, or ``PJRT_DEVICE=CPU`` for tests).

The names other modules have always used, answered by the TPU backend registry
(:mod:`nbaccel.platform.tpu`; torch_xla is its first backend). Pure detection: the
backend's package is located, never imported, so asking costs nothing and starts no
runtime.

Example:
    >>> xla_requested({})              # no PJRT_DEVICE, no TPU markers
    False
"""

from __future__ import annotations

from collections.abc import Mapping

from .tpu import TPU_ENV_MARKERS, active_backend, backends, loaded_backend, tpu_present


def xla_available() -> bool:
    """True when a TPU backend's package is installed (located, not imported)."""
    return any(b.available() for b in backends())


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


__all__ = [
    "TPU_ENV_MARKERS",
    "runtime_initialized",
    "tpu_present",
    "xla_available",
    "xla_requested",
]
