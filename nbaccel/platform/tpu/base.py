"""The TPU backend protocol, and the TPU host markers every backend shares.

:class:`TpuBackend` is what nbaccel needs from a TPU runtime (``torch_xla``:
:mod:`~nbaccel.platform.tpu.torch_xla_backend`). Detection never imports the runtime.

Example:
    >>> tpu_present({"TPU_ACCELERATOR_TYPE": "v5litepod-8"}), tpu_present({})
    (True, False)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover - torch is imported lazily
    import torch

#: Environment variables that mark a TPU host (Colab, Kaggle, Cloud TPU VMs).
TPU_ENV_MARKERS = ("COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID")
_TPU_DEVICE_FILES = ("/dev/accel0", "/dev/vfio/0")


def tpu_present(environ: Mapping[str, str] | None = None) -> bool:
    """True on a TPU host: TPU environment markers or TPU device files.

    Args:
        environ: mapping to read; ``os.environ`` (and the device files) by default.
    """
    env = os.environ if environ is None else environ
    if env.get("PJRT_DEVICE", "").upper() == "TPU":
        return True
    if any(name in env for name in TPU_ENV_MARKERS):
        return True
    return environ is None and any(os.path.exists(p) for p in _TPU_DEVICE_FILES)


class TpuWorld(NamedTuple):
    """Where this process stands among the TPU workers (from the backend's runtime)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int


@runtime_checkable
class TpuBackend(Protocol):
    """What nbaccel needs from a TPU runtime. One module per implementation.

    Attributes:
        name: for people and error messages, e.g. ``"torch_xla"``.
        package: the distribution to ``pip install`` (``importlib`` finds it by this name).
        device_type: the ``torch.device`` type of its tensors, e.g. ``"xla"``.
        process_group_backend: the ``torch.distributed`` backend it registers (collectives
            go through ``torch.distributed`` with it: DDP and nbaccel's ops need nothing
            backend-specific).
    """

    name: str
    package: str
    device_type: str
    process_group_backend: str

    # ---- detection (pure: never imports the runtime)
    def available(self) -> bool:
        """True when the backend's package is installed."""
        ...

    def requested(self, environ: Mapping[str, str] | None = None) -> bool:
        """True when training should run on this backend here (installed and wanted)."""
        ...

    def loaded(self) -> bool:
        """True when the backend's package is imported in this process."""
        ...

    def version(self) -> str | None:
        """The installed package's version (None when not installed)."""
        ...

    def runtime_initialized(self) -> bool:
        """True when this process has started the runtime (then no workers can be started)."""
        ...

    def device_count(self, environ: Mapping[str, str] | None = None) -> int | None:
        """Local devices, from the host's markers without starting the runtime (None: unknown)."""
        ...

    # ---- processes (nbaccel's engine starts them: its worker loop, channel, supervisor)
    def setup_process(self, local_rank: int, local_world_size: int) -> None:
        """In a worker nbaccel started, before the runtime starts: make it the runtime's
        local process ``local_rank`` of ``local_world_size`` (its environment, its chips)."""
        ...

    # ---- in the process that trains
    def device(self) -> torch.device:
        """This process's device (starts the runtime; registers the process-group backend)."""
        ...

    def world(self) -> TpuWorld:
        """Rank, world size, local rank/size and host index from the runtime."""
        ...

    def init_process_group_kwargs(self) -> dict[str, Any]:
        """``init_process_group`` arguments for :attr:`process_group_backend`."""
        ...

    def after_step(self) -> None:
        """Run what the step recorded (lazy tensors), after every real optimizer step."""
        ...

    def tensor_id(self, tensor: torch.Tensor) -> int:
        """What identifies a device tensor's data (for tied weights in saved files)."""
        ...

    def rng_state(self) -> Any:
        """The device RNG state, for ``save_state`` (None when the runtime is not in use)."""
        ...

    def set_rng_state(self, state: Any) -> None:
        """Restore what :meth:`rng_state` returned, for ``load_state``."""
        ...


__all__ = ["TPU_ENV_MARKERS", "TpuBackend", "TpuWorld", "tpu_present"]
