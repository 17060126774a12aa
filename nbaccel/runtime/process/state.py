"""Immutable process state: who am I, how many are we, which device, which backend.

The environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` and nbaccel's ``NBACCEL_USE_CPU``,
``NBACCEL_TIMEOUT``, ``NBACCEL_DEBUG_MODE``) is read exactly once, here, by
:func:`nbaccel.platform.process_env.read_environment`. :func:`get_state` turns it into a frozen
:class:`ProcessState`, initialising the ``torch.distributed`` process group when
more than one process takes part (gloo on CPU, nccl on CUDA), or adopting one that the
caller (torchrun user code, a test) already initialised; cached per process.

Example:
    >>> from nbaccel.runtime.process.state import get_state, reset_state
    >>> reset_state()
    >>> state = get_state(cpu=True)   # no RANK/WORLD_SIZE: one process
    >>> (state.world_size, state.distributed_type.value, state.device.type)
    (1, 'NO', 'cpu')
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...errors import ConfigError, LaunchError, too_few_gpus_error
from ...platform import torchcompat, tpu
from ...platform.process_env import EnvironmentSnapshot, read_environment
from . import rank_check


class DistributedType(str, enum.Enum):
    """How this process takes part in training."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    XLA = "XLA"
    FSDP = "FSDP"  # several processes (CPU or GPU) sharding the model with FSDP2
    TPU = "XLA"  # the peer's older name of XLA: an alias, ``DistributedType.TPU is XLA``
    # the peer's types nbaccel never runs as; scripts compare against them
    DEEPSPEED = "DEEPSPEED"
    MEGATRON_LM = "MEGATRON_LM"
    TP = "TP"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


@dataclass(frozen=True)
class ProcessState:
    """Where this process stands in the job. Immutable; build it with :func:`get_state`.

    Example:
        >>> s = ProcessState(0, 1, 0, 1, 0, torch.device("cpu"), None, DistributedType.NO)
        >>> s.is_main_process, s.use_distributed
        (True, False)
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str | None
    distributed_type: DistributedType
    debug: bool = False

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0 (the process that writes shared files and logs)."""
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on local rank 0 (one process per machine)."""
        return self.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        """True on the highest global rank."""
        return self.rank == self.world_size - 1

    @property
    def use_distributed(self) -> bool:
        """True when more than one process takes part."""
        return self.world_size > 1

    @property
    def multi_device(self) -> bool:
        """True with several processes on GPUs (Accelerate's ``multi_device``)."""
        return self.use_distributed and self.distributed_type is DistributedType.MULTI_GPU

    @property
    def data_parallel(self) -> bool:
        """True when several processes each train a whole (DDP) model, on CPUs or GPUs."""
        return self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)

    @property
    def shards_model(self) -> bool:
        """True when several processes shard the model with FSDP2."""
        return self.distributed_type is DistributedType.FSDP

    @property
    def num_nodes(self) -> int:
        """Machines taking part (world size / processes per machine)."""
        return max(1, self.world_size // max(1, self.local_world_size))


def _uses_nccl(backend: str | None) -> bool:
    """True for nccl, the CUDA default (None), and mixed backends such as 'cpu:gloo,cuda:nccl'."""
    return backend is None or "nccl" in backend


def barrier_kwargs(backend: str) -> dict[str, Any]:
    """``dist.barrier`` arguments: NCCL gets this process's GPU (``device_ids``).

    Without it NCCL guesses the device from the rank ("using GPU N to perform barrier as
    devices used by this process are currently unknown"), which can be another GPU than
    the one this rank trains on (an extra CUDA context there, or a hang). Other backends
    take no ``device_ids``.

    Example:
        >>> barrier_kwargs("gloo")
        {}
    """
    if "nccl" in backend:
        return {"device_ids": [torch.cuda.current_device()]}
    return {}


def _select_device_and_backend(
    env: EnvironmentSnapshot, *, cpu: bool, backend: str | None = None
) -> tuple[torch.device, str | None, DistributedType]:
    """Choose (device, process-group backend, distributed type) for this process.

    The single place where hardware decides the set-up (an XLA branch goes here too).
    ``backend`` is an explicit request (``InitProcessGroupKwargs.backend``) or the
    backend of a process group that is already initialised.
    """
    tpu_group = tpu.process_group_backend()  # the TPU backend's ("xla" for torch_xla)
    if not (cpu or env.use_cpu) and backend in (None, tpu_group) and tpu.xla_requested():
        device = (
            tpu.require_backend().device()
        )  # TPU, or PJRT_DEVICE=CPU; ranks come from the XLA runtime
        chosen = tpu_group if tpu.training_backend().world().world_size > 1 else None
        return device, chosen, DistributedType.XLA
    distributed = env.world_size > 1
    # The backend picks the collective library, not the device: gloo moves CUDA tensors
    # through host memory and DDP works over it, so an explicit or adopted gloo group keeps
    # the GPU (as Lightning does with process_group_backend="gloo"). Training silently on the
    # CPU because of a communication choice would be 10-100x slower without a word; cpu=True
    # is how to ask for the CPU.
    use_cuda = not (cpu or env.use_cpu) and torch.cuda.is_available()
    if backend == "nccl" and not use_cuda:
        raise ConfigError(
            "backend='nccl' needs a CUDA GPU, but this process runs on the CPU "
            "(cpu=True, NBACCEL_USE_CPU=1 or no GPU visible). Use backend='gloo' or drop cpu=True."
        )
    if use_cuda:
        count = torch.cuda.device_count()
        if distributed and _uses_nccl(backend) and count < env.local_world_size:
            raise too_few_gpus_error(env.local_world_size, count)
        # gloo tolerates ranks sharing a GPU (round-robin); nccl was checked above
        index = env.local_rank % count
        device = torch.device("cuda", index)
        chosen = (backend or "nccl") if distributed else backend
        kind = DistributedType.MULTI_GPU if distributed else DistributedType.NO
        return device, chosen, kind
    chosen = (backend or "gloo") if distributed else backend
    kind = DistributedType.MULTI_CPU if distributed else DistributedType.NO
    return torch.device("cpu"), chosen, kind


def _xla_environment(env: EnvironmentSnapshot) -> EnvironmentSnapshot:
    """Rank and world size on XLA come from the torch_xla runtime, not from RANK/WORLD_SIZE."""
    world = tpu.training_backend().world()
    return dataclasses.replace(
        env,
        rank=world.rank,
        world_size=world.world_size,
        local_rank=world.local_rank,
        local_world_size=world.local_world_size,
        node_rank=world.node_rank,
    )


def _timeout_for(
    env: EnvironmentSnapshot, timeout: datetime.timedelta | None
) -> datetime.timedelta | None:
    if timeout is not None:
        return timeout
    if env.timeout is not None:
        return datetime.timedelta(seconds=env.timeout)
    return None


def _init_kwargs(
    backend: str,
    device: torch.device,
    timeout: datetime.timedelta | None,
    init_kwargs: Mapping[str, Any],
) -> dict[str, Any]:
    """The keyword arguments for ``dist.init_process_group`` (besides backend/rank/world).

    On CUDA with nccl the group is bound to this process's GPU (``device_id``, torch >=
    2.3): NCCL then knows the device from the start instead of guessing it at the first
    barrier ("devices used by this process are currently unknown"), and connects eagerly.

    Example:
        >>> _init_kwargs("nccl", torch.device("cuda", 1), None, {})["device_id"]
        device(type='cuda', index=1)
        >>> "device_id" in _init_kwargs("gloo", torch.device("cpu"), None, {})
        False
    """
    kwargs: dict[str, Any] = {k: v for k, v in init_kwargs.items() if v is not None}
    kwargs.pop("backend", None)
    if backend == tpu.process_group_backend():
        kwargs = {**tpu.training_backend().init_process_group_kwargs(), **kwargs}
    kwargs.setdefault("init_method", "env://")
    if timeout is not None:
        kwargs["timeout"] = timeout
    if device.type == "cuda" and _uses_nccl(backend):
        kwargs.setdefault("device_id", device)
    return kwargs


def _init_process_group(
    env: EnvironmentSnapshot,
    backend: str,
    device: torch.device,
    timeout: datetime.timedelta | None,
    init_kwargs: Mapping[str, Any],
) -> None:
    kwargs = _init_kwargs(backend, device, timeout, init_kwargs)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not getattr(env, name.lower())]
    if kwargs["init_method"] == "env://" and missing:
        raise LaunchError(
            f"WORLD_SIZE={env.world_size} but {' and '.join(missing)} is not set: the processes "
            "cannot find each other. Launch with nbaccel.notebook_launcher or torchrun, or set "
            "MASTER_ADDR/MASTER_PORT to rank 0's address and a free port."
        )
    try:
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, **kwargs)
        # torch aborts at interpreter exit (status 134, about 1 run in 3) when a script
        # leaves the group open; destroy the group we created. Registered once per process.
        if _CACHE.get("atexit_pid") != os.getpid():
            atexit.register(_destroy_group_at_exit)
            _CACHE["atexit_pid"] = os.getpid()
    except Exception as err:
        seconds = timeout.total_seconds() if timeout is not None else 1800.0
        raise LaunchError(
            f"rank {env.rank} of {env.world_size} could not join the process group at "
            f"MASTER_ADDR:MASTER_PORT={env.master_addr}:{env.master_port} (backend {backend!r}, "
            f"timeout {seconds:g}s): {type(err).__name__}: {err}. Fix: start all "
            f"{env.world_size} processes with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, "
            "make sure rank 0 is running and reachable at that address and the port is free "
            "(pass another use_port=...), or raise the timeout (NBACCEL_TIMEOUT=seconds)."
        ) from err


def _destroy_group_at_exit() -> None:
    torchcompat.destroy_process_group_at_exit()  # never raises: at exit nobody is told


def _adopted_environment(env: EnvironmentSnapshot) -> EnvironmentSnapshot:
    """Rank/world size of a process group that someone else initialised."""
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    local_world_size = env.local_world_size if env.world_size == world_size else world_size
    local_rank = env.local_rank if env.world_size == world_size else rank % local_world_size
    return EnvironmentSnapshot(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=rank // local_world_size,
        master_addr=env.master_addr,
        master_port=env.master_port,
        use_cpu=env.use_cpu,
        timeout=env.timeout,
        debug=env.debug,
    )


_CACHE: dict[str, Any] = {}


def current_state() -> ProcessState | None:
    """The cached state of this process, or ``None`` (no side effects)."""
    if _CACHE.get("pid") != os.getpid():
        return None
    return _CACHE.get("state")


def reset_state() -> None:
    """Forget the cached state (call right after fork, and between tests)."""
    atexit_pid = _CACHE.get("atexit_pid")
    _CACHE.clear()
    if atexit_pid is not None:
        _CACHE["atexit_pid"] = atexit_pid


def _check_conflict(state: ProcessState, cpu: bool, init_kwargs: Mapping[str, Any]) -> None:
    requested_backend = init_kwargs.get("backend")
    if requested_backend and requested_backend != state.backend:
        raise ConfigError(
            f"InitProcessGroupKwargs(backend={requested_backend!r}) conflicts with the running "
            f"process group (backend {state.backend!r}) created by an earlier Accelerator. "
            "A process group cannot change backend: drop the backend argument, or restart the "
            "kernel / relaunch."
        )
    if cpu and state.device.type != "cpu":
        raise ConfigError(
            f"cpu=True conflicts with the running process group on {state.device} (backend "
            f"{state.backend!r}) created by an earlier Accelerator in this process. Use the "
            "same cpu= setting for every Accelerator, or relaunch with NBACCEL_USE_CPU=1."
        )


def get_state(
    *,
    cpu: bool = False,
    timeout: datetime.timedelta | None = None,
    init_kwargs: Mapping[str, Any] | None = None,
) -> ProcessState:
    """Return this process's :class:`ProcessState`, creating the process group if needed.

    The first call reads the environment, picks device and backend and, when
    ``WORLD_SIZE > 1``, initialises ``torch.distributed`` (or adopts a group that is
    already initialised). Later calls return the cached state; a request that truly
    conflicts with the running group (another backend, CPU instead of GPU) raises.

    Args:
        cpu: force the CPU even when a GPU is visible.
        timeout: process-group timeout; default ``NBACCEL_TIMEOUT`` seconds, else torch's.
        init_kwargs: extra ``init_process_group`` arguments (``backend``, ``init_method``,
            ``timeout``), e.g. from ``InitProcessGroupKwargs``.

    Raises:
        LaunchError: the rendezvous at ``MASTER_ADDR:MASTER_PORT`` failed or timed out.
        ConfigError: malformed environment, or a request that conflicts with the cache.
    """
    init_kwargs = dict(init_kwargs or {})
    if init_kwargs.get("timeout") is not None and timeout is None:
        timeout = init_kwargs["timeout"]
    cached = current_state()
    if cached is not None and cached.use_distributed and dist.is_initialized():
        _check_conflict(cached, cpu, init_kwargs)
        return cached
    # One process (or a group that was torn down since): re-derive the device from the
    # environment read earlier, so an evaluation Accelerator may pick another device.
    env = _CACHE.get("env") if _CACHE.get("pid") == os.getpid() else None
    if env is None:
        env = read_environment()
        _CACHE.update(env=env, pid=os.getpid())
    backend = init_kwargs.get("backend")
    adopt = dist.is_available() and dist.is_initialized()
    if adopt:
        env = _adopted_environment(env)
        backend = dist.get_backend()
    device, backend, kind = _select_device_and_backend(env, cpu=cpu, backend=backend)
    if kind is DistributedType.XLA and not adopt:
        env = _xla_environment(env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.world_size > 1 and not adopt:
        if not dist.is_available():
            raise LaunchError(
                f"WORLD_SIZE={env.world_size} but this torch build has no torch.distributed; "
                "install a standard torch wheel."
            )
        assert backend is not None
        _init_process_group(env, backend, device, _timeout_for(env, timeout), init_kwargs)
    if env.world_size > 1:  # every rank is here now: form the group that checks entries
        rank_check.form(_timeout_for(env, timeout))
    state = ProcessState(
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.local_rank,
        local_world_size=env.local_world_size,
        node_rank=env.node_rank,
        device=device,
        backend=backend,
        distributed_type=kind,
        debug=env.debug,
    )
    cached = _CACHE.get("state")
    if cached == state:
        return cached  # keep the identity: the same facts, the same object
    _CACHE["state"] = state
    return state


__all__ = [
    "DistributedType",
    "EnvironmentSnapshot",
    "ProcessState",
    "barrier_kwargs",
    "current_state",
    "get_state",
    "read_environment",
    "reset_state",
]
