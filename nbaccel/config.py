"""The one launch configuration: choices, validation and (later) YAML storage.

Every choice (precision modes, start methods, compute devices) is defined here
once; the launcher, the CLI and the widget panel derive their options from these
tuples so they can never drift apart.

Example:
    >>> from nbaccel.config import LaunchConfig
    >>> cfg = LaunchConfig(num_processes=2, mixed_precision="bf16")
    >>> cfg.mixed_precision
    'bf16'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from .errors import ConfigError

PrecisionType = Literal["no", "fp16", "bf16", "fp8"]
StartMethodType = Literal["auto", "fork", "spawn"]
ComputeDeviceType = Literal["auto", "cpu", "gpu", "tpu"]

PRECISIONS: tuple[str, ...] = get_args(PrecisionType)
START_METHODS: tuple[str, ...] = get_args(StartMethodType)
COMPUTE_DEVICES: tuple[str, ...] = get_args(ComputeDeviceType)


def normalize_precision(value: object, *, argument: str = "mixed_precision") -> str:
    """Return the canonical precision name, or raise a ``ConfigError`` naming ``argument``.

    ``None`` and ``"fp32"`` mean ``"no"``; matching is case-insensitive.

    Example:
        >>> normalize_precision("BF16")
        'bf16'
    """
    if value is None:
        return "no"
    if not isinstance(value, str):
        raise ConfigError(
            f"{argument}={value!r} is not a string; use one of {', '.join(PRECISIONS)}."
        )
    lowered = value.strip().lower()
    if lowered in ("fp32", "no", "none", ""):
        return "no"
    if lowered not in PRECISIONS:
        raise ConfigError(f"{argument}={value!r} is unknown; use one of {', '.join(PRECISIONS)}.")
    return lowered


def _check_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True as a process count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}.")
    if value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}.")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is unknown; use one of {', '.join(choices)}.")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How to launch a training function. Validated on construction.

    Args:
        compute_device: "auto" (GPUs, else TPU, else CPU), "cpu", "gpu" or "tpu".
        num_processes: processes per node; ``None`` means one per visible device.
        mixed_precision: "no", "fp16", "bf16" or "fp8".
        gradient_accumulation_steps: micro-steps per optimizer update (>= 1).
        num_nodes: machines taking part (>= 1).
        node_rank: this machine's index, ``0 <= node_rank < num_nodes``.
        master_addr: address of node 0's rendezvous.
        master_port: rendezvous port; ``None`` picks a free one (single node only).
        start_method: "auto" (fork when safe, else spawn), "fork" or "spawn".
        gpu_ids: GPUs to use, e.g. ``"0,1"`` or ``"all"``; ``None`` means all.
        max_restarts: how often a failed worker group is restarted (>= 0).
        timeout: seconds a collective may block before the run is declared hung.
        debug: record CUDA-initialisation stacks and worker stacks on hangs.

    Example:
        >>> LaunchConfig(num_nodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500)
        ... # doctest: +ELLIPSIS
        LaunchConfig(...)
    """

    compute_device: ComputeDeviceType = "auto"
    num_processes: int | None = None
    mixed_precision: PrecisionType = "no"
    gradient_accumulation_steps: int = 1
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    start_method: StartMethodType = "auto"
    gpu_ids: str | None = None
    max_restarts: int = 0
    timeout: float | None = None
    debug: bool = False

    def __post_init__(self) -> None:
        _check_choice("compute_device", self.compute_device, COMPUTE_DEVICES)
        if self.num_processes is not None:
            _check_int("num_processes", self.num_processes, 1)
        # Normalise aliases ("fp32", None, "BF16") in place; frozen needs object.__setattr__.
        object.__setattr__(self, "mixed_precision", normalize_precision(self.mixed_precision))
        _check_int("gradient_accumulation_steps", self.gradient_accumulation_steps, 1)
        _check_int("num_nodes", self.num_nodes, 1)
        _check_int("node_rank", self.node_rank, 0)
        if self.node_rank >= self.num_nodes:
            raise ConfigError(
                f"node_rank={self.node_rank} must be < num_nodes={self.num_nodes}; "
                "number machines 0..num_nodes-1 and give each its own node_rank."
            )
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ConfigError(f"master_addr={self.master_addr!r} must be a host name or IP.")
        if self.master_port is not None:
            _check_int("master_port", self.master_port, 1)
            if self.master_port > 65535:
                raise ConfigError(f"master_port={self.master_port} must be <= 65535.")
        if self.num_nodes > 1 and self.master_port is None:
            raise ConfigError(
                "master_port=None with num_nodes > 1: every node must agree on one port; "
                "pass the same master_port (use_port) on each machine, e.g. 29500."
            )
        _check_choice("start_method", self.start_method, START_METHODS)
        if self.gpu_ids is not None and not isinstance(self.gpu_ids, str):
            raise ConfigError(f"gpu_ids={self.gpu_ids!r} must be a string such as '0,1' or 'all'.")
        _check_int("max_restarts", self.max_restarts, 0)
        if self.timeout is not None and (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, int | float)
            or self.timeout <= 0
        ):
            raise ConfigError(f"timeout={self.timeout!r} must be a number of seconds > 0.")
        if not isinstance(self.debug, bool):
            raise ConfigError(f"debug={self.debug!r} must be True or False.")

    def replace(self, **changes: object) -> LaunchConfig:
        """Return a copy with ``changes`` applied (and validated).

        Example:
            >>> LaunchConfig().replace(num_processes=4).num_processes
            4
        """
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise ConfigError(
                f"unknown LaunchConfig field(s) {unknown}; valid fields: {sorted(fields)}."
            )
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


__all__ = [
    "COMPUTE_DEVICES",
    "PRECISIONS",
    "START_METHODS",
    "ComputeDeviceType",
    "LaunchConfig",
    "PrecisionType",
    "StartMethodType",
    "normalize_precision",
]
