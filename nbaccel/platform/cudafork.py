"""Whether a fork from this process would hand its children a broken CUDA.

CUDA does not survive a fork once the driver has been initialised (``cuInit``) in the
parent: a forked child's first CUDA call fails (torch: "Cannot re-initialize CUDA in
forked subprocess"; CuPy, Numba: ``cuInit`` error 3). Far more than
``torch.cuda.is_initialized()`` initialises the driver: ``torch.cuda.is_available()``
and ``get_device_capability()``, ``import torchao``, transformers' ``TrainingArguments``,
CuPy's and Numba's device queries... And a mapped driver says nothing: torch's CUDA 13
build maps ``libcuda.so`` at ``import torch`` already, and its children work.

So the driver itself is asked, without being initialised or loaded: every driver call
but ``cuInit`` returns ``CUDA_ERROR_NOT_INITIALIZED`` (3) until someone in the process
has called ``cuInit``, and ``cuDeviceGetCount`` is such a call. The library is opened
with ``RTLD_NOLOAD`` from the path already mapped; a process without it (every CPU-only
machine) pays one read of ``/proc/self/maps`` and nothing else.

Example:
    >>> from nbaccel.platform import cudafork
    >>> cudafork.fork_state().broken in (True, False)
    True
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from . import environment

_NOT_INITIALIZED = 3  # CUDA_ERROR_NOT_INITIALIZED
_DRIVER = "libcuda.so"


def mapped_driver() -> str | None:
    """Path of the CUDA driver library mapped into this process, or None (Linux only)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            text = maps.read()
    except OSError:
        return None
    at = text.find(_DRIVER)  # one C-level search over ~2,000 lines
    if at == -1:
        return None
    start, end = text.rfind("\n", 0, at) + 1, text.find("\n", at)
    path = text[start : end if end != -1 else len(text)].split(None, 5)[-1].strip()
    return path if path.startswith("/") else None


def driver_initialized() -> bool:
    """True when someone in this process has initialised the CUDA driver (``cuInit``).

    Never loads nor initialises the driver: a process where it is not mapped returns
    False at once.

    Example:
        >>> driver_initialized() in (True, False)
        True
    """
    path = mapped_driver()
    if path is None:
        return False
    try:  # RTLD_NOLOAD: a handle to the library already mapped, never a fresh load
        driver = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        count = ctypes.c_int(0)
        code = driver.cuDeviceGetCount(ctypes.byref(count))
    except (OSError, AttributeError):
        return False
    return int(code) == 0


@dataclass(frozen=True)
class CudaForkState:
    """What a fork from this process would hand its children.

    Attributes:
        context: torch's CUDA context exists here (``torch.cuda.is_initialized()``).
        driver: the CUDA driver is initialised here (by torch or anyone else).
    """

    context: bool = False
    driver: bool = False

    @property
    def broken(self) -> bool:
        """True when a forked child's first CUDA call would fail."""
        return self.context or self.driver

    def what(self) -> str:
        """The state in words, for messages."""
        if self.context:
            return "CUDA is already initialised in this kernel"
        return (
            "the CUDA driver is already initialised in this kernel (torch.cuda.is_available(), "
            "get_device_capability(), `import torchao`, CuPy or Numba device queries do that "
            "without torch.cuda.is_initialized() saying so)"
        )


def fork_state() -> CudaForkState:
    """Whether forking now would break CUDA in the children, asked without touching CUDA.

    Example:
        >>> fork_state().broken in (True, False)
        True
    """
    context = environment.cuda_initialized()  # torch already imported: never imports it
    return CudaForkState(context=context, driver=context or driver_initialized())


__all__ = ["CudaForkState", "driver_initialized", "fork_state", "mapped_driver"]
