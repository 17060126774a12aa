"""Pure detection of the environment nbaccel runs in. Nothing here has side effects.

Every function answers one question without initialising CUDA or the XLA runtime
and without importing torch unless torch is already imported (or the answer
really needs it, as for counting GPUs, where NVML is used so that the CUDA
driver is not touched in the kernel).

Example:
    >>> from nbaccel.platform import environment
    >>> environment.cpu_count() >= 1
    True
    >>> isinstance(environment.cuda_initialized(), bool)
    True
"""

from __future__ import annotations

import importlib.util
import ipaddress
import linecache
import os
import socket
import subprocess
import sys
from collections.abc import Container
from typing import Any

from .hosts import tpu_devices
from .tpu import tpu_present, xla_requested

# Environment variables that indicate a TPU host (Colab, Kaggle, Cloud TPU VMs).


def in_notebook() -> bool:
    """True when running inside an IPython kernel (Jupyter, Colab, Kaggle, VS Code)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:
        return False
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def in_colab() -> bool:
    """True inside Google Colab."""
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


def in_kaggle() -> bool:
    """True inside a Kaggle notebook."""
    return "KAGGLE_KERNEL_RUN_TYPE" in os.environ


def in_kernel_process() -> bool:
    """True in the IPython kernel process itself, not in a worker forked from it.

    A forked worker still sees the kernel's shell object, but the ZMQ sockets behind
    it belong to the parent: ipykernel records the pid that owns them.
    """
    if not in_notebook():
        return False
    shell = sys.modules["IPython"].get_ipython()
    owner = getattr(
        getattr(getattr(shell, "kernel", None), "iopub_thread", None), "_master_pid", None
    )
    if owner is None:
        owner = getattr(sys.stdout, "_master_pid", os.getpid())
    return bool(owner == os.getpid())


def notebook_cell_sources(skip: Container[str] = ()) -> dict[str, tuple[Any, ...]]:
    """The notebook cells in ``linecache`` (no file on disk), for remote tracebacks.

    IPython 8 caches a cell with no modification time; IPython 7 (Colab ships 7.34) with
    the time of the cell and in ``linecache._ipython_cache`` too. Both are returned as
    entries without a time, which ``linecache.checkcache`` leaves alone in the worker.

    Args:
        skip: cell names to leave out (already sent).

    Example:
        >>> isinstance(notebook_cell_sources(), dict)
        True
    """
    ipython7 = getattr(linecache, "_ipython_cache", {})
    return {
        name: (entry[0], None, entry[2], entry[3])
        for name, entry in list(linecache.cache.items())
        if name not in skip and len(entry) == 4 and (entry[1] is None or name in ipython7)
    }


def cpu_count() -> int:
    """CPU cores this process may use (affinity mask and cgroup quota respected), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:  # cgroup v2 quota ("max 100000" means unlimited)
        with open("/sys/fs/cgroup/cpu.max") as fh:
            quota, period = fh.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def cuda_initialized() -> bool:
    """True when CUDA has been initialised in *this* process.

    Only asks torch when torch is already imported: a process that never imported
    torch cannot have initialised CUDA through it, and importing torch here would
    be a side effect.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:
        return False


def fork_preferred() -> bool:
    """True where start_method="auto" should fork: ``os.fork`` exists and the OS is Linux.

    (macOS system frameworks are not fork-safe, so "auto" spawns there.)
    """
    return hasattr(os, "fork") and sys.platform.startswith("linux")


def gpu_count() -> int:
    """Number of visible CUDA GPUs, counted without initialising CUDA in this process.

    Uses NVML (through torch's own helper, honouring ``CUDA_VISIBLE_DEVICES``);
    when NVML is unavailable the count is taken in a short-lived subprocess so
    that the driver is never loaded into the kernel.
    """
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return 0
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    if not torch.cuda._is_compiled():
        return 0
    if torch.cuda.is_initialized():
        return int(torch.cuda.device_count())
    counter = getattr(torch.cuda, "_device_count_nvml", None)
    if counter is not None and not getattr(torch.version, "hip", None):
        try:
            count = int(counter())
        except Exception:
            count = -1
        if count >= 0:
            return count
    if not _gpu_driver_may_exist(torch):
        return 0
    return _gpu_count_in_subprocess()


# Linux device files of an NVIDIA driver: native (/dev/nvidiactl, /proc/driver/nvidia) and
# WSL2 (/dev/dxg). Without any of them no CUDA device can exist.
_NVIDIA_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg")


def _gpu_driver_may_exist(torch: Any) -> bool:
    """False when this is Linux, torch is a CUDA build and no NVIDIA driver is installed.

    The CUDA wheel of torch (PyPI's default on Linux) on a machine without a GPU has no
    NVML either; without this check every launch would pay seconds for the subprocess
    count (seen in CI's torch matrix), only to learn that there is no GPU.
    """
    if not sys.platform.startswith("linux") or getattr(torch.version, "hip", None):
        return True
    return any(os.path.exists(path) for path in _NVIDIA_DRIVER_FILES)


def _gpu_count_in_subprocess() -> int:
    code = "import torch; print(torch.cuda.device_count())"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
        )
        return int(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0


def tpu_core_count() -> int | None:
    """TPU cores on this host when knowable without touching XLA, else None."""
    value = os.environ.get("TPU_NUM_DEVICES")
    if value and value.isdigit():
        return int(value)
    # TPU VMs: "v5litepod-1" (Colab's TPU runtime today), "v5litepod-8" (Kaggle's), ...
    tpu = tpu_devices(os.environ.get("TPU_ACCELERATOR_TYPE", ""))
    if tpu is not None:
        return tpu[1]
    if "COLAB_TPU_ADDR" in os.environ:
        return 8  # the retired Colab TPU node (v2-8)
    return None


def is_loopback(address: str) -> bool:
    """True when ``address`` (IP literal or host name) resolves to a loopback address."""
    try:
        infos = socket.getaddrinfo(address, None)
    except OSError:
        return False
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)
    except ValueError:
        return False


def loopback_interface() -> str | None:
    """Name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        return "lo"  # the kernel's own loopback device; psutil (tens of ms to import) not needed
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
                return name
    except Exception:
        pass
    return "lo" if sys.platform.startswith("linux") else None


def summary() -> dict[str, Any]:
    """A dict describing this machine, for ``nbaccel env`` and bug reports."""
    return {
        "python": sys.version.split()[0],
        "platform": sys.platform,
        "cpu_count": cpu_count(),
        "gpu_count": gpu_count(),
        "tpu_present": tpu_present(),
        "xla_requested": xla_requested(),
        "in_notebook": in_notebook(),
        "in_colab": in_colab(),
        "in_kaggle": in_kaggle(),
        "cuda_initialized": cuda_initialized(),
        "fork_preferred": fork_preferred(),
    }


def package_dir() -> str:
    """The ``nbaccel`` package's folder, found from the package itself (never from this
    module's depth, which a move changes: issue 50's moves broke two such computations).

    Example:
        >>> os.path.basename(package_dir())
        'nbaccel'
    """
    top = sys.modules[__name__.partition(".")[0]]
    return os.path.dirname(os.path.abspath(str(top.__file__)))


def package_root() -> str:
    """The folder that holds the ``nbaccel`` package, for a worker's ``PYTHONPATH`` (not the
    package itself: on the path, that one would shadow the standard library with
    ``nbaccel/logging.py``)."""
    return os.path.dirname(package_dir())


__all__ = [
    "cpu_count",
    "cuda_initialized",
    "fork_preferred",
    "gpu_count",
    "in_colab",
    "in_kaggle",
    "in_kernel_process",
    "in_notebook",
    "is_loopback",
    "loopback_interface",
    "notebook_cell_sources",
    "package_dir",
    "package_root",
    "summary",
    "tpu_core_count",
    "tpu_present",
    "xla_requested",
]
