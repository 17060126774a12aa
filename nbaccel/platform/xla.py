"""Whether torch_xla is here and wanted (TPUs, or ``PJRT_DEVICE=CPU`` for tests).

Pure detection: torch_xla is located with ``find_spec``, never imported, so asking
costs nothing and starts no runtime. The device helpers live in
:mod:`nbaccel.runtime.xla`; launching through ``xmp.spawn`` in :mod:`nbaccel.launch._xla`.

Example:
    >>> xla_requested({})              # no PJRT_DEVICE, no TPU markers
    False
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping

#: Environment variables that mark a TPU host (Colab, Kaggle, Cloud TPU VMs).
TPU_ENV_MARKERS = ("COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID")
_TPU_DEVICE_FILES = ("/dev/accel0", "/dev/vfio/0")


def xla_available() -> bool:
    """True when torch_xla is installed (located with ``find_spec``, not imported)."""
    try:
        return importlib.util.find_spec("torch_xla") is not None
    except (ImportError, ValueError):
        return False


def xla_requested(environ: Mapping[str, str] | None = None) -> bool:
    """True when training should run on XLA: torch_xla installed and ``PJRT_DEVICE`` set
    (``CPU`` counts: it is how the XLA path runs without a TPU) or a TPU host.

    Args:
        environ: mapping to read; ``os.environ`` by default.
    """
    env = os.environ if environ is None else environ
    if not xla_available():
        return False
    return bool(env.get("PJRT_DEVICE", "").strip()) or tpu_present(environ)


def runtime_initialized() -> bool:
    """True when this process has already started the XLA runtime (used a device)."""
    if "torch_xla" not in sys.modules:
        return False
    import torch_xla

    return bool(torch_xla._XLAC._xla_runtime_is_initialized())


def tpu_present(environ: Mapping[str, str] | None = None) -> bool:
    """True on a TPU host: TPU environment markers or TPU device files."""
    env = os.environ if environ is None else environ
    if env.get("PJRT_DEVICE", "").upper() == "TPU":
        return True
    if any(name in env for name in TPU_ENV_MARKERS):
        return True
    return environ is None and any(os.path.exists(p) for p in _TPU_DEVICE_FILES)


__all__ = [
    "TPU_ENV_MARKERS",
    "runtime_initialized",
    "tpu_present",
    "xla_available",
    "xla_requested",
]
