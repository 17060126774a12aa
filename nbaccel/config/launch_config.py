"""The one launch configuration: :class:`LaunchConfig`, its validation and field facts.

Each field carries its help text in ``dataclasses.field(metadata={"help": ...})``;
the CLI flags, the questionnaire and the widget panel read names, types, choices
and help from the fields, so they can never drift apart. Where settings come from
is :mod:`nbaccel.config.precedence`; the YAML file is :mod:`nbaccel.config.store`.

Example:
    >>> cfg = LaunchConfig(num_processes=2, mixed_precision="bf16")
    >>> cfg.mixed_precision
    'bf16'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..errors import ConfigError
from .choices import (
    COMPUTE_DEVICES,
    DEEPSPEED_OFFLOAD_DEVICES,
    DEEPSPEED_ZERO_STAGES,
    FSDP_STATE_DICT_TYPES,
    FSDP_WRAP_POLICIES,
    ON_HANG,
    PRECISIONS,
    START_METHODS,
    STRATEGIES,
    ComputeDeviceType,
    DeepSpeedOffloadType,
    FsdpStateDictType,
    FsdpWrapPolicyType,
    OnHangType,
    PrecisionType,
    StartMethodType,
    StrategyType,
    normalize_precision,
)

#: smallest valid value of each int field (the widget's lower bounds come from here too)
INT_MINIMUMS: dict[str, int] = {
    "num_processes": 1,
    "gradient_accumulation_steps": 1,
    "num_nodes": 1,
    "node_rank": 0,
    "master_port": 1,
    "max_restarts": 0,
    "cpus_per_rank": 1,
    "fsdp_min_num_params": 0,
    "deepspeed_zero_stage": 0,
}
MAX_PORT = 65535


#: what to do about a count below its minimum (the launch functions' arguments too)
_FIXES: dict[str, str] = {
    "num_processes": " Use None for one process per device, or a positive int.",
    "num_nodes": " Pass the number of machines taking part.",
    "node_rank": " Number the machines 0..num_nodes-1.",
    "max_restarts": " Pass 0 to never restart.",
    "cpus_per_rank": " Use None for each node's usable cores / its ranks, or a positive int.",
}


def _check_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True as a process count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}.{_FIXES.get(name, '')}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is unknown; use one of {', '.join(choices)}.")


def _check_cluster(value: object) -> None:
    # Only the shape here (no import of ray): reaching the cluster is the launch's first step.
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(
            f"cluster={value!r} must be None (this machine), 'ray' (the Ray cluster this "
            "kernel is connected to) or a Ray address such as 'ray://head:10001'."
        )


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How to launch a training function. Validated on construction.

    Every field's description is in its ``metadata["help"]`` (see :func:`field_help`):
    the CLI, the questionnaire and the widget panel show that text.

    Example:
        >>> LaunchConfig(num_nodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500)
        ... # doctest: +ELLIPSIS
        LaunchConfig(...)
    """

    compute_device: ComputeDeviceType = field(
        default="auto",
        metadata={"help": '"auto" (GPUs, else TPU, else CPU), "cpu", "gpu" or "tpu".'},
    )
    num_processes: int | None = field(
        default=None,
        metadata={"help": "processes per node; ``None`` means one per visible device."},
    )
    mixed_precision: PrecisionType = field(
        default="no",
        metadata={
            "help": '"no", "fp16", "bf16" or "fp8": what the Accelerator() created inside '
            "the launched function uses."
        },
    )
    gradient_accumulation_steps: int = field(
        default=1,
        metadata={"help": "micro-steps per optimizer update (>= 1)."},
    )
    num_nodes: int = field(
        default=1,
        metadata={"help": "machines taking part (>= 1)."},
    )
    node_rank: int = field(
        default=0,
        metadata={"help": "this machine's index, ``0 <= node_rank < num_nodes``."},
    )
    master_addr: str = field(
        default="127.0.0.1",
        metadata={"help": "address of node 0's rendezvous (one machine: it listens there only)."},
    )
    master_port: int | None = field(
        default=None,
        metadata={"help": "rendezvous port; ``None`` picks a free one (single node only)."},
    )
    cluster: str | None = field(
        default=None,
        metadata={
            "help": 'where the ranks run: ``None`` this machine; "ray" the Ray cluster this '
            'kernel is connected to (else RAY_ADDRESS, else "auto"), or a Ray address such '
            'as "ray://head:10001"; num_nodes machines x num_processes ranks each.'
        },
    )
    cpus_per_rank: int | None = field(
        default=None,
        metadata={
            "help": "with ``cluster``: CPUs each rank's Ray actor reserves and compute threads "
            "it runs (``OMP_NUM_THREADS``); ``None`` means each node's usable cores divided by "
            "its ranks, read on that node."
        },
    )
    start_method: StartMethodType = field(
        default="auto",
        metadata={"help": '"auto" (fork when safe, else spawn), "fork" or "spawn".'},
    )
    gpu_ids: str | None = field(
        default=None,
        metadata={"help": 'GPUs to use, e.g. ``"0,1"`` or ``"all"``; ``None`` means all.'},
    )
    max_restarts: int = field(
        default=0,
        metadata={"help": "how often a failed worker group is restarted (>= 0)."},
    )
    replace_timeout: float = field(
        default=600.0,
        metadata={
            "help": "cluster launches with max_restarts: seconds a restart after a lost "
            "node waits for the cluster to hold the group again (a node that joins, by "
            "hand or through Ray's autoscaler) before the launch ends."
        },
    )
    timeout: float | None = field(
        default=None,
        metadata={
            "help": "seconds a collective may block (the process group's timeout); ranks "
            "still running that long after a peer finished are reported as stuck "
            "(WorkerTimeoutError, with their stacks)."
        },
    )
    debug: bool = field(
        default=False,
        metadata={"help": "record CUDA-initialisation stacks and worker stacks on hangs."},
    )
    # -- hangs: nbaccel.launch.debug._watchdog ------------------------------------------------
    # 5 minutes: longer than a real step, a checkpoint save or an evaluation on one rank
    # usually keeps the others waiting, shorter than torch's own collective timeouts (NCCL's
    # 10 min, gloo's 30 min), which end the job without saying where each rank was.
    hang_after: float = field(
        default=300.0,
        metadata={
            "help": "seconds without progress (no collective issued, nothing logged) while "
            "ranks wait on each other before they are reported with stacks; 0: never."
        },
    )
    on_hang: OnHangType = field(
        default="report",
        metadata={
            "help": '"report" (and keep waiting; reported again after 2x, 4x ... as long) '
            'or "raise" (end the job with WorkerTimeoutError).'
        },
    )
    debug_collectives: bool = field(
        default=False,
        metadata={
            "help": "torch's collective-mismatch check (TORCH_DISTRIBUTED_DEBUG=DETAIL): ranks "
            "calling different collectives fail with torch's error instead of hanging; slower."
        },
    )
    # -- strategy (the fsdp_* fields matter only with strategy="fsdp") --------------------
    strategy: StrategyType = field(
        default="ddp",
        metadata={
            "help": '"ddp" (every process holds the whole model), "fsdp" (FSDP2: '
            "parameters, gradients and optimizer state sharded across processes) or "
            '"deepspeed" (DeepSpeed ZeRO; needs the deepspeed package).'
        },
    )
    fsdp_auto_wrap_policy: FsdpWrapPolicyType = field(
        default="transformer_based_wrap",
        metadata={
            "help": "which submodules are sharded as units: transformer_based_wrap (the "
            "classes in fsdp_transformer_cls_names_to_wrap, else the model's "
            "_no_split_modules), size_based_wrap (>= fsdp_min_num_params) or no_wrap."
        },
    )
    fsdp_transformer_cls_names_to_wrap: str | None = field(
        default=None,
        metadata={"help": 'comma-separated block class names, e.g. "GPT2Block".'},
    )
    fsdp_min_num_params: int = field(
        default=100_000_000,
        metadata={"help": "size_based_wrap: parameters a submodule needs to be its own unit."},
    )
    fsdp_reshard_after_forward: bool = field(
        default=True,
        metadata={"help": "free gathered parameters after forward (less memory, more traffic)."},
    )
    fsdp_cpu_offload: bool = field(
        default=False,
        metadata={"help": "keep parameter shards, gradients and optimizer state in CPU memory."},
    )
    fsdp_activation_checkpointing: bool = field(
        default=False,
        metadata={"help": "recompute the wrapped blocks' activations in backward."},
    )
    fsdp_state_dict_type: FsdpStateDictType = field(
        default="SHARDED_STATE_DICT",
        metadata={
            "help": "save_state writes one shard per rank (SHARDED_STATE_DICT, via "
            "torch.distributed.checkpoint) or full files from rank 0 (FULL_STATE_DICT)."
        },
    )
    fsdp_cpu_ram_efficient_loading: bool = field(
        default=False,
        metadata={
            "help": "only rank 0 loads real weights (the others build the model on the meta "
            "device); prepare() shards them out from rank 0."
        },
    )

    # -- the deepspeed_* fields matter only with strategy="deepspeed" ----------------------
    deepspeed_zero_stage: int = field(
        default=2,
        metadata={
            "help": "ZeRO stage: 0 (data parallel), 1 (optimizer state sharded), "
            "2 (+ gradients), 3 (+ parameters)."
        },
    )
    deepspeed_offload_optimizer_device: DeepSpeedOffloadType = field(
        default="none",
        metadata={"help": "ZeRO-Offload: optimizer state and fp32 weights in cpu (or nvme)."},
    )
    deepspeed_offload_param_device: DeepSpeedOffloadType = field(
        default="none",
        metadata={"help": "ZeRO-3 only: parameters in cpu (or nvme) memory between uses."},
    )
    deepspeed_gradient_clipping: float = field(
        default=1.0,
        metadata={
            "help": "clip the global gradient norm to this (DeepSpeed's default 1.0; 0: off)."
        },
    )
    deepspeed_config_file: str | None = field(
        default=None,
        metadata={
            "help": 'a DeepSpeed JSON config (its "auto" values are filled in prepare); '
            "replaces the offload and clipping options above."
        },
    )

    # -- Accelerate's ParallelismConfig sizes (1: not used; product = the process count) ----
    parallelism_config_dp_replicate_size: int = field(
        default=1,
        metadata={"help": "model replicas (HSDP with dp_shard_size > 1, else DDP)."},
    )
    parallelism_config_dp_shard_size: int = field(
        default=1,
        metadata={"help": "processes each model is sharded over (FSDP2)."},
    )
    parallelism_config_tp_size: int = field(
        default=1,
        metadata={"help": "tensor-parallel processes (a layer's weights split across them)."},
    )
    parallelism_config_cp_size: int = field(
        default=1,
        metadata={"help": "context-parallel processes (the sequence split; CUDA GPUs only)."},
    )
    parallelism_config_sp_size: int = field(
        default=1,
        metadata={"help": "sequence-parallel processes (Accelerate's DeepSpeed ALST: refused)."},
    )

    def __post_init__(self) -> None:
        _check_choice("compute_device", self.compute_device, COMPUTE_DEVICES)
        if self.num_processes is not None:
            _check_int("num_processes", self.num_processes, INT_MINIMUMS["num_processes"])
        # Normalise aliases ("fp32", None, "BF16") in place; frozen needs object.__setattr__.
        object.__setattr__(self, "mixed_precision", normalize_precision(self.mixed_precision))
        _check_int(
            "gradient_accumulation_steps",
            self.gradient_accumulation_steps,
            INT_MINIMUMS["gradient_accumulation_steps"],
        )
        _check_int("num_nodes", self.num_nodes, INT_MINIMUMS["num_nodes"])
        _check_int("node_rank", self.node_rank, INT_MINIMUMS["node_rank"])
        if self.node_rank >= self.num_nodes:
            raise ConfigError(
                f"node_rank={self.node_rank} must be < num_nodes={self.num_nodes}; "
                "number machines 0..num_nodes-1 and give each its own node_rank."
            )
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ConfigError(f"master_addr={self.master_addr!r} must be a host name or IP.")
        if self.master_port is not None:
            _check_int("master_port", self.master_port, INT_MINIMUMS["master_port"])
            if self.master_port > MAX_PORT:
                raise ConfigError(f"master_port={self.master_port} must be <= {MAX_PORT}.")
        _check_cluster(self.cluster)
        if self.cpus_per_rank is not None:
            _check_int("cpus_per_rank", self.cpus_per_rank, INT_MINIMUMS["cpus_per_rank"])
        if self.num_nodes > 1 and self.master_port is None and self.cluster is None:
            raise ConfigError(
                "master_port=None with num_nodes > 1: every node must agree on one port; "
                "pass the same master_port (use_port) on each machine, e.g. 29500."
            )
        _check_choice("start_method", self.start_method, START_METHODS)
        if self.gpu_ids is not None and not isinstance(self.gpu_ids, str):
            raise ConfigError(f"gpu_ids={self.gpu_ids!r} must be a string such as '0,1' or 'all'.")
        _check_int("max_restarts", self.max_restarts, INT_MINIMUMS["max_restarts"])
        if self.timeout is not None and (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, int | float)
            or self.timeout <= 0
        ):
            raise ConfigError(f"timeout={self.timeout!r} must be a number of seconds > 0.")
        if (
            isinstance(self.replace_timeout, bool)
            or not isinstance(self.replace_timeout, int | float)
            or not 0 < self.replace_timeout < float("inf")
        ):
            raise ConfigError(
                f"replace_timeout={self.replace_timeout!r} must be a number of seconds > 0 "
                "(how long a restart waits for a replacement node)."
            )
        for name in ("debug", "debug_collectives"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False.")
        after = self.hang_after
        if isinstance(after, bool) or not isinstance(after, int | float) or not after >= 0:
            raise ConfigError(f"hang_after={after!r} must be seconds >= 0 (0: no watchdog).")
        _check_choice("on_hang", self.on_hang, ON_HANG)
        self._check_strategy()

    def _check_strategy(self) -> None:
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("fsdp_auto_wrap_policy", self.fsdp_auto_wrap_policy, FSDP_WRAP_POLICIES)
        kind = self.fsdp_state_dict_type
        if isinstance(kind, str) and kind.upper() in FSDP_STATE_DICT_TYPES:
            object.__setattr__(self, "fsdp_state_dict_type", kind.upper())
        _check_choice("fsdp_state_dict_type", self.fsdp_state_dict_type, FSDP_STATE_DICT_TYPES)
        _check_int("fsdp_min_num_params", self.fsdp_min_num_params, 0)
        names = self.fsdp_transformer_cls_names_to_wrap
        if names is not None and not isinstance(names, str):
            raise ConfigError(
                f"fsdp_transformer_cls_names_to_wrap={names!r} must be a string such as "
                "'GPT2Block' or 'EncoderLayer,DecoderLayer'."
            )
        for name in FSDP_BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False.")
        for name in PARALLELISM_SIZE_FIELDS:
            _check_int(name, getattr(self, name), 1)
        stage = self.deepspeed_zero_stage
        if isinstance(stage, bool) or stage not in DEEPSPEED_ZERO_STAGES:
            raise ConfigError(f"deepspeed_zero_stage={stage!r} is unknown; use 0, 1, 2 or 3.")
        for name in ("deepspeed_offload_optimizer_device", "deepspeed_offload_param_device"):
            _check_choice(name, getattr(self, name), DEEPSPEED_OFFLOAD_DEVICES)
        if self.deepspeed_offload_param_device != "none" and stage != 3:
            raise ConfigError(
                f"deepspeed_offload_param_device={self.deepspeed_offload_param_device!r} needs "
                "deepspeed_zero_stage=3 (only ZeRO-3 partitions parameters)."
            )
        clip = self.deepspeed_gradient_clipping
        if isinstance(clip, bool) or not isinstance(clip, int | float) or clip < 0:
            raise ConfigError(
                f"deepspeed_gradient_clipping={clip!r} must be a number >= 0 (0: no clipping)."
            )

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


FSDP_BOOL_FIELDS = (
    "fsdp_reshard_after_forward",
    "fsdp_cpu_offload",
    "fsdp_activation_checkpointing",
    "fsdp_cpu_ram_efficient_loading",
)

#: Accelerate's ``parallelism_config_*`` keys, one field each
PARALLELISM_SIZE_FIELDS = (
    "parallelism_config_dp_replicate_size",
    "parallelism_config_dp_shard_size",
    "parallelism_config_tp_size",
    "parallelism_config_cp_size",
    "parallelism_config_sp_size",
)


__all__ = [
    "COMPUTE_DEVICES",
    "FSDP_BOOL_FIELDS",
    "INT_MINIMUMS",
    "MAX_PORT",
    "PARALLELISM_SIZE_FIELDS",
    "PRECISIONS",
    "START_METHODS",
    "LaunchConfig",
]
