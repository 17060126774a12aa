"""Detect the local accelerator hardware without initialising CUDA.

Used by ``write_basic_config``, ``nbaccel env``, ``nbaccel config`` and the
widget panel's hardware summary. The counting itself lives in
:mod:`nbaccel.platform.environment` (NVML, never a CUDA context in this process); GPU
names come from ``nvidia-smi`` in a subprocess, so a later fork-based launch is safe.

Example:
    >>> from nbaccel.platform.hardware import detect_hardware
    >>> hw = detect_hardware()
    >>> hw.kind in ("cpu", "gpu", "tpu")
    True
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from . import environment, tpu
from .hosts import (
    NotebookHost,
    detect_host,
    precision_problem,
    supported_precisions,
    tpu_devices,
)


@dataclass(frozen=True)
class Hardware:
    """What this machine offers.

    Args:
        kind: "gpu", "tpu" or "cpu" (the device "auto" would pick).
        device_count: accelerators visible to this process (CPU cores for "cpu").
        device_names: accelerator names when known without initialising them.
        cpu_count: CPU cores this process may use.
    """

    kind: str
    device_count: int
    device_names: tuple[str, ...]
    cpu_count: int

    def summary(self) -> str:
        """One line for people, e.g. ``"2 x GPU (NVIDIA H200), 16 CPU cores"``.

        Example:
            >>> Hardware("cpu", 4, (), 4).summary()
            'CPU only, 4 CPU cores'
        """
        if self.kind == "cpu":
            return f"CPU only, {self.cpu_count} CPU cores"
        names = f" ({', '.join(sorted(set(self.device_names)))})" if self.device_names else ""
        return f"{self.device_count} x {self.kind.upper()}{names}, {self.cpu_count} CPU cores"


def cpu_count() -> int:
    """CPU cores available to this process (affinity mask and cgroup quota respected)."""
    return environment.cpu_count()


def cuda_device_count() -> int:
    """Visible CUDA GPUs, counted without initialising CUDA (NVML, else a subprocess)."""
    return environment.gpu_count()


def _gpu_names(count: int) -> tuple[str, ...]:
    smi = shutil.which("nvidia-smi")
    if smi is None or count == 0:
        return ()
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(line.strip() for line in out.splitlines() if line.strip())[:count]


def tpu_device_count() -> int:
    """TPU chips when a TPU backend (torch_xla) is installed and a TPU is attached (else 0)."""
    if not any(b.available() for b in tpu.backends()) or not environment.tpu_present():
        return 0
    return environment.tpu_core_count() or len(glob.glob("/dev/accel*")) or 1


def _tpu_names() -> tuple[str, ...]:
    """``("v5e, torch_xla 2.8.0",)``: the TPU generation (from the markers) and the backend."""
    backend = next((b for b in tpu.backends() if b.available()), None)
    if backend is None:
        return ()
    found = tpu_devices(os.environ.get("TPU_ACCELERATOR_TYPE", ""))
    what = f"{backend.name} {backend.version() or ''}".strip()
    return (f"{found[0]}, {what}" if found else what,)


def precision_choices(
    hardware: Hardware, choices: Sequence[str], current: str | None = None
) -> tuple[str, ...]:
    """The ``mixed_precision`` choices to offer on ``hardware`` (the panel's dropdown).

    On GPUs without bf16 (Kaggle's T4s): ``("no", "fp16")``; ``current`` stays listed if
    it is not one of them (a saved config), so it can be shown and flagged.

    Example:
        >>> precision_choices(Hardware("gpu", 2, ("Tesla T4",), 4), ("no", "fp16", "bf16"))
        ('no', 'fp16')
    """
    offered = supported_precisions(hardware.device_names, choices)
    if hardware.kind != "gpu":
        offered = tuple(choices)
    if current is not None and current in choices and current not in offered:
        offered += (current,)
    return offered


def hardware_precision_problem(
    hardware: Hardware, mixed_precision: str | None, compute_device: str = "auto"
) -> str | None:
    """Why ``mixed_precision`` does not run natively on ``hardware``'s GPUs (None if it does)."""
    if hardware.kind != "gpu" or compute_device in ("cpu", "tpu"):
        return None
    return precision_problem(mixed_precision, hardware.device_names)


def check_gpu_precision(mixed_precision: str | None, compute_device: str = "auto") -> None:
    """Before a launch: ``mixed_precision`` the visible GPUs do not run natively.

    bf16 on a GPU without it (Kaggle's T4s) runs emulated, many times slower: a
    ``RuntimeWarning`` naming fp16. fp8 there cannot run at all: a ``ConfigError``.
    Costs nothing unless bf16/fp8 is asked for on a machine with GPUs (names come from
    ``nvidia-smi`` in a subprocess; CUDA is never initialised here).

    Raises:
        ConfigError: fp8 on GPUs that have no fp8 (nor bf16).
    """
    if mixed_precision not in ("bf16", "fp8") or compute_device in ("cpu", "tpu"):
        return
    count = cuda_device_count()
    problem = precision_problem(mixed_precision, _gpu_names(count)) if count else None
    if problem is None:
        return
    if mixed_precision == "fp8":
        raise ConfigError(problem)
    warnings.warn(problem, RuntimeWarning, stacklevel=4)


def notebook_host() -> NotebookHost:
    """The hosted notebook service (Colab, Kaggle) or this machine, with its defaults."""
    return detect_host(gpu_names=_gpu_names(cuda_device_count()))


def detect_hardware() -> Hardware:
    """Return the :class:`Hardware` of this machine (GPUs first, then TPU, then CPU)."""
    cores = cpu_count()
    gpus = cuda_device_count()
    if gpus:
        return Hardware("gpu", gpus, _gpu_names(gpus), cores)
    tpus = tpu_device_count()
    if tpus:
        return Hardware("tpu", tpus, _tpu_names(), cores)
    return Hardware("cpu", cores, (), cores)


def default_num_processes(compute_device: str, gpu_ids: str | None = None) -> int:
    """Processes per node when none is configured: one per usable GPU, else 1.

    Example:
        >>> default_num_processes("cpu")
        1
    """
    if compute_device in ("cpu", "tpu"):
        return 1  # TPU: torch_xla's runtime starts one process per chip by itself
    gpus = cuda_device_count()
    if gpu_ids and gpu_ids.strip().lower() != "all":
        gpus = min(gpus, len([g for g in gpu_ids.split(",") if g.strip()]))
    return max(gpus, 1)


__all__ = [
    "Hardware",
    "check_gpu_precision",
    "cpu_count",
    "cuda_device_count",
    "default_num_processes",
    "detect_hardware",
    "hardware_precision_problem",
    "notebook_host",
    "precision_choices",
    "tpu_device_count",
]
