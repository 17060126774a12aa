"""Hosted notebook services as they are today, from their environment markers.

* Google Colab's TPU runtime is a single-chip TPU v5e (``v5e-1``): one XLA device,
  so one process. Its GPU runtimes (T4, L4, A100) have one GPU.
* Kaggle's TPU runtime is a TPU v5e-8 VM: eight chips, one process per chip.
* Kaggle's "GPU T4 x2" image: two Tesla T4s, which have no bf16, so fp16 is the
  mixed precision that works, with one process per GPU.

Markers, read from the environment only (no device is touched): Colab sets
``COLAB_RELEASE_TAG`` (and imports ``google.colab`` in its kernel), Kaggle sets
``KAGGLE_KERNEL_RUN_TYPE``; TPU VMs set ``TPU_ACCELERATOR_TYPE`` (``v5litepod-1``,
``v5litepod-8``, ``v3-8``...); old Colab TPU nodes set ``COLAB_TPU_ADDR`` (a v2-8).
GPU names come from the caller (``nvidia-smi``, see :mod:`~nbaccel.platform.hardware`).

Example:
    >>> host = detect_host({"COLAB_RELEASE_TAG": "release-colab_20250101",
    ...                     "TPU_ACCELERATOR_TYPE": "v5litepod-1"})
    >>> host.label, host.defaults()
    ('Google Colab, TPU v5e-1', {'compute_device': 'tpu', 'num_processes': 1, 'mixed_precision': 'bf16'})
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# TPU generations whose "-N" in the accelerator type counts TensorCores, two per chip,
# with one XLA device per chip (megacore); elsewhere N is the number of XLA devices.
_CORES_PER_DEVICE = {"v4": 2, "v5p": 2}
_GENERATION_NAMES = {"v5litepod": "v5e", "v6litepod": "v6e"}
# The compute capability of the GPUs hosted notebooks hand out, by name: for when only
# the name is known (an nvidia-smi too old to report compute_cap, the host's defaults).
_CAPABILITIES: dict[str, tuple[int, int]] = {
    "T4": (7, 5),
    "P100": (6, 0),
    "V100": (7, 0),
    "K80": (3, 7),
    "L4": (8, 9),
    "A100": (8, 0),
    "H100": (9, 0),
}


@dataclass(frozen=True)
class NotebookHost:
    """Where this kernel runs and what a launch should default to there.

    Args:
        name: ``"colab"``, ``"kaggle"`` or ``"local"``.
        label: for people, e.g. ``"Kaggle, GPU T4 x2"``.
        accelerator: ``"tpu"``, ``"gpu"`` or ``"cpu"`` as far as the markers tell.
        devices: XLA devices or GPUs the markers reveal (None: unknown).
        mixed_precision: what works on this hardware (None: no opinion).
    """

    name: str
    label: str
    accelerator: str
    devices: int | None = None
    mixed_precision: str | None = None

    def defaults(self) -> dict[str, Any]:
        """``LaunchConfig`` fields this host suggests (empty on an unknown machine)."""
        if self.name == "local" or self.accelerator == "cpu":
            return {}
        out: dict[str, Any] = {"compute_device": self.accelerator}
        if self.devices:
            out["num_processes"] = self.devices
        if self.mixed_precision:
            out["mixed_precision"] = self.mixed_precision
        return out


def tpu_devices(accelerator_type: str) -> tuple[str, int] | None:
    """``"v5litepod-8"`` -> ``("v5e", 8)``: the generation and its XLA devices.

    Example:
        >>> tpu_devices("v5litepod-1"), tpu_devices("v4-8"), tpu_devices("gpu")
        (('v5e', 1), ('v4', 4), None)
    """
    match = re.fullmatch(r"\s*(v\d+[a-z]*)-(\d+)\s*", accelerator_type.lower())
    if match is None:
        return None
    generation, count = match.group(1), int(match.group(2))
    count = max(1, count // _CORES_PER_DEVICE.get(generation, 1))
    return _GENERATION_NAMES.get(generation, generation), count


def detect_host(
    environ: Mapping[str, str] | None = None, gpu_names: Sequence[str] = ()
) -> NotebookHost:
    """The hosted notebook service this kernel runs in, from environment markers.

    Args:
        environ: the environment to read (``os.environ`` by default).
        gpu_names: names of the visible GPUs (e.g. from ``nvidia-smi``), if any.
    """
    env = os.environ if environ is None else environ
    if "COLAB_RELEASE_TAG" in env or (environ is None and "google.colab" in sys.modules):
        name, service = "colab", "Google Colab"
    elif "KAGGLE_KERNEL_RUN_TYPE" in env:
        name, service = "kaggle", "Kaggle"
    else:
        name, service = "local", "this machine"
    tpu = tpu_devices(env.get("TPU_ACCELERATOR_TYPE", ""))
    if tpu is None and "COLAB_TPU_ADDR" in env:
        tpu = ("v2", 8)  # the retired Colab TPU node
    if tpu is not None:
        generation, devices = tpu
        return NotebookHost(name, f"{service}, TPU {generation}-{devices}", "tpu", devices, "bf16")
    if gpu_names:
        count = len(gpu_names)
        model = _short_gpu_name(gpu_names[0])
        precision = "fp16" if gpu_without_bf16(gpu_names[:1]) else "bf16"
        shape = f"{model} x{count}" if count > 1 else model
        return NotebookHost(name, f"{service}, GPU {shape}", "gpu", count, precision)
    return NotebookHost(name, f"{service}, CPU only" if name != "local" else service, "cpu")


#: the compute capability from which a GPU runs bf16 natively (Ampere); older ones emulate it
BF16_CAPABILITY = (8, 0)


def lacks_bf16(capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability has no native bf16 (runs it emulated, many
    times slower). The one place this is decided: by compute capability, as
    :func:`nbaccel.platform.gpufacts.gpu_facts` reads it; a GPU known by its name only is
    looked up first (:func:`name_capability`).

    Example:
        >>> lacks_bf16((7, 5)), lacks_bf16((8, 0))
        (True, False)
    """
    return tuple(capability) < BF16_CAPABILITY


def gpu_without_bf16(gpu_names: Sequence[str]) -> str | None:
    """The first of ``gpu_names`` with no native bf16 (compute capability < 8.0), or None.

    Example:
        >>> gpu_without_bf16(["Tesla T4", "Tesla T4"]), gpu_without_bf16(["NVIDIA A100"])
        ('Tesla T4', None)
    """
    return next((g for g in gpu_names if (c := name_capability(g)) and lacks_bf16(c)), None)


def name_capability(gpu_name: str) -> tuple[int, int] | None:
    """The compute capability of a GPU known by its name, or None for a name not listed.

    Example:
        >>> name_capability("Tesla T4"), name_capability("NVIDIA A100-SXM4-40GB")
        ((7, 5), (8, 0))
    """
    short = _short_gpu_name(gpu_name)
    return next((c for model, c in _CAPABILITIES.items() if short.startswith(model)), None)


def supported_precisions(gpu_names: Sequence[str], choices: Sequence[str]) -> tuple[str, ...]:
    """The ``mixed_precision`` choices these GPUs run natively (all of them when unknown).

    Without native bf16 (a T4) neither bf16 nor fp8 (which needs compute capability 8.9)
    runs natively: ``"no"`` and ``"fp16"`` remain.

    Example:
        >>> supported_precisions(["Tesla T4"], ("no", "fp16", "bf16", "fp8"))
        ('no', 'fp16')
    """
    if gpu_without_bf16(gpu_names) is None:
        return tuple(choices)
    return tuple(c for c in choices if c not in ("bf16", "fp8"))


def precision_problem(mixed_precision: str | None, gpu_names: Sequence[str]) -> str | None:
    """Why ``mixed_precision`` does not run natively on these GPUs, naming what does; or None.

    Example:
        >>> precision_problem("bf16", ["Tesla T4"]).split(":")[0]
        "mixed_precision='bf16' is not native on Tesla T4 (no bf16 before compute capability 8.0)"
    """
    gpu = gpu_without_bf16(gpu_names) if mixed_precision in ("bf16", "fp8") else None
    if gpu is None:
        return None
    why = "no bf16 before" if mixed_precision == "bf16" else "fp8 needs"
    need = "8.0" if mixed_precision == "bf16" else "8.9"
    return (
        f"mixed_precision={mixed_precision!r} is not native on {gpu} ({why} compute "
        f"capability {need}): use mixed_precision='fp16' (GradScaler; what this GPU runs "
        "fast), or 'no'."
    )


def _short_gpu_name(name: str) -> str:
    """``"Tesla T4"`` -> ``"T4"``, ``"NVIDIA A100-SXM4-40GB"`` -> ``"A100-SXM4-40GB"``."""
    return re.sub(r"^(NVIDIA|Tesla)\s+", "", name.strip()) or name


__all__ = [
    "BF16_CAPABILITY",
    "NotebookHost",
    "detect_host",
    "gpu_without_bf16",
    "lacks_bf16",
    "name_capability",
    "precision_problem",
    "supported_precisions",
    "tpu_devices",
]
