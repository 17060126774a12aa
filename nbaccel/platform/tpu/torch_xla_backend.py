"""torch_xla, the first TPU backend (PyTorch/XLA, ``PJRT_DEVICE=TPU``; ``CPU`` in tests).

Everything nbaccel does with torch_xla is here: finding it (``find_spec``, never an
import, until a process trains), setting up each process as ``xmp.spawn`` would, the XLA device, the runtime's ranks,
the ``"xla"`` process-group backend, ``torch_xla.sync()`` after each step, XLA tensor
ids and RNG state. torch_xla 2.9 is its last release; a successor gets a module of its
own next to this one (see :mod:`nbaccel.platform.tpu`).

Example:
    >>> backend = TorchXlaBackend()
    >>> backend.name, backend.device_type, backend.process_group_backend
    ('torch_xla', 'xla', 'xla')
    >>> backend.device_count({"TPU_ACCELERATOR_TYPE": "v5litepod-8"})
    8
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..hosts import tpu_devices
from .base import TpuWorld, tpu_present

if TYPE_CHECKING:  # pragma: no cover - torch is imported lazily
    import torch


class TorchXlaBackend:
    """The :class:`~nbaccel.platform.tpu.TpuBackend` of torch_xla."""

    name = "torch_xla"
    package = "torch_xla"
    device_type = "xla"
    process_group_backend = "xla"

    # ------------------------------------------------------------------ detection
    def available(self) -> bool:
        try:
            return importlib.util.find_spec("torch_xla") is not None
        except (ImportError, ValueError):
            return False

    def requested(self, environ: Mapping[str, str] | None = None) -> bool:
        # PJRT_DEVICE=CPU counts: it is how the XLA path runs without a TPU (tests).
        env = os.environ if environ is None else environ
        if not self.available():
            return False
        return bool(env.get("PJRT_DEVICE", "").strip()) or tpu_present(environ)

    def loaded(self) -> bool:
        return "torch_xla" in sys.modules

    def version(self) -> str | None:
        try:
            return importlib.metadata.version("torch_xla")
        except importlib.metadata.PackageNotFoundError:
            return None

    def runtime_initialized(self) -> bool:
        if not self.loaded():
            return False
        import torch_xla

        return bool(torch_xla._XLAC._xla_runtime_is_initialized())

    def device_count(self, environ: Mapping[str, str] | None = None) -> int | None:
        env = os.environ if environ is None else environ
        tpu = tpu_devices(env.get("TPU_ACCELERATOR_TYPE", ""))
        if tpu is not None:
            return tpu[1]
        if "COLAB_TPU_ADDR" in env:
            return 8  # the retired Colab TPU node (v2-8)
        value = env.get("TPU_NUM_DEVICES", "").strip()  # torch_xla's own limit
        if value.isdigit():
            return int(value)
        if env.get("PJRT_DEVICE", "").strip().upper() == "CPU":
            # the CPU runtime has CPU_NUM_DEVICES devices (torch_xla's default: 1); more
            # processes than that would each see a world of one: N separate trainings
            value = env.get("CPU_NUM_DEVICES", "").strip()
            return int(value) if value.isdigit() and int(value) > 0 else 1
        return None

    # ------------------------------------------------------------------ processes
    def setup_process(self, local_rank: int, local_world_size: int) -> None:
        # What xmp.spawn does first in each process it starts (torch_xla._internal.pjrt,
        # the names of 2.9, with 2.8's before): the local process variables, this
        # process's chips on a TPU, the replication; the runtime starts here, in the worker.
        from torch_xla._internal import pjrt

        if local_world_size == 1:
            one = getattr(pjrt, "initialize_singleprocess", None)
            if one is not None:
                one()
                return
        many = getattr(pjrt, "initialize_multiprocess", None) or pjrt._initialize_multiprocess
        many(local_rank, local_world_size)

    # ------------------------------------------------------------------ training
    def device(self) -> torch.device:
        import torch_xla
        import torch_xla.distributed.xla_backend  # registers the "xla" process-group backend

        device = getattr(torch_xla, "device", None)
        if device is not None:  # torch_xla >= 2.5
            return device()
        import torch_xla.core.xla_model as xm  # pragma: no cover - older torch_xla

        return xm.xla_device()  # pragma: no cover

    def world(self) -> TpuWorld:
        import torch_xla.runtime as xr

        world_size = int(xr.world_size())
        local = max(1, int(xr.local_process_count()) * int(xr.addressable_device_count()))
        rank = int(xr.global_ordinal()) if world_size > 1 else 0
        local_rank = int(xr.local_ordinal()) if world_size > 1 else 0
        return TpuWorld(rank, world_size, local_rank, min(local, world_size), int(xr.host_index()))

    def init_process_group_kwargs(self) -> dict[str, Any]:
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers "xla")

        return {"init_method": "xla://"}

    def after_step(self) -> None:
        if not self.loaded():
            return
        import torch_xla

        sync = getattr(torch_xla, "sync", None)
        if sync is not None:
            sync()
        else:  # pragma: no cover - torch_xla < 2.6
            import torch_xla.core.xla_model as xm

            xm.mark_step()

    def tensor_id(self, tensor: torch.Tensor) -> int:
        import torch_xla

        return int(torch_xla._XLAC._xla_get_tensor_id(tensor))

    def rng_state(self) -> Any:
        if not self.runtime_initialized():
            return None  # asking would start the runtime (and grab the TPU) for nothing
        import torch_xla.core.xla_model as xm

        return xm.get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(state)


__all__ = ["TorchXlaBackend"]
