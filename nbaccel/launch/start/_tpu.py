"""How many workers a TPU launch starts, checked before any starts.

The workers themselves start as local ones do (the engine's fork or spawn); the backend
(:mod:`nbaccel.platform.tpu`) sets each one up.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ...config import LaunchConfig
from ...errors import ConfigError
from ...platform import tpu
from ...platform.hosts import detect_host


def check_process_count(
    num_processes: int | None,
    environ: Mapping[str, str] | None = None,
    *,
    runtime: str | None = None,
) -> int | None:
    """The number of TPU processes to start, checked against the host's devices.

    Args:
        num_processes: what was asked for (``None``: one per local device).
        environ: the environment to read markers from (``os.environ`` by default).
        runtime: how to name the host in the error (default: from its markers, e.g.
            ``"Google Colab, TPU v5e-1"``).

    Returns:
        ``num_processes``, or the device count when it is ``None`` and known.

    Raises:
        ConfigError: a count the backend cannot start here: neither 1 nor one process
            per device (e.g. 4 or 16 on a v5e-8), before any process starts.

    Example:
        >>> check_process_count(None, {"TPU_ACCELERATOR_TYPE": "v5litepod-8"})
        8
    """
    backend = tpu.active_backend(environ) or tpu.backends()[0]
    devices = backend.device_count(environ)
    if devices is None:
        return num_processes
    env = os.environ if environ is None else environ
    cpu_runtime = env.get("PJRT_DEVICE", "").strip().upper() == "CPU" and not tpu.tpu_present(env)
    if num_processes is None:
        return None if cpu_runtime else devices  # the CPU runtime: one process, as always
    if num_processes not in (1, devices):  # the backend starts 1, or one per device
        if cpu_runtime:
            raise ConfigError(
                f"num_processes={num_processes}, but PJRT_DEVICE=CPU gives {devices} XLA CPU "
                f"device(s) (CPU_NUM_DEVICES, default 1), and each process needs one of its "
                f"own: use num_processes={devices} or set CPU_NUM_DEVICES={num_processes} "
                "(or unset PJRT_DEVICE to train on the CPU without XLA)."
            )
        runtime = runtime or detect_host(environ).label
        other = " or num_processes=1 (in this process)" if devices != 1 else ""
        raise ConfigError(
            f"num_processes={num_processes}, but {runtime} has {devices} TPU device(s) and "
            f"{backend.name} runs one process per device (or one alone): use num_processes="
            f"{devices} (or None for one per device){other}."
        )
    return num_processes


def tpu_processes(cfg: LaunchConfig) -> int:
    """TPU: the backend's processes, started and served by the one engine (never in the
    kernel, whose XLA runtime must stay unstarted for the workers to own the chips)."""
    if cfg.strategy in ("fsdp", "deepspeed"):  # a config error first, with or without torch_xla
        raise ConfigError(
            f"strategy={cfg.strategy!r} is not available on TPU (torch_xla); use 'ddp'."
        )
    backend = tpu.require_backend()
    nproc = check_process_count(cfg.num_processes) or 1  # e.g. 4 on a v5e-8: refused
    if backend.runtime_initialized():
        raise ConfigError(
            f"the {backend.name} runtime is already started in this kernel (an XLA device or "
            "tensor was used before launching), so no worker can own the TPU. Restart the "
            "kernel and launch before touching the device."
        )
    return nproc


__all__ = ["check_process_count", "tpu_processes"]
