"""Everything the launcher checks and decides before a single process exists.

:func:`plan_launch` type-checks the settings given as arguments (the options of
:mod:`nbaccel.config.options` check themselves; ``TypeError``/``ValueError`` naming
the argument and the fix), merges them with the environment and the config
file through :func:`nbaccel.config.resolve_launch_config`, counts devices
without initialising CUDA, refuses a multi-process launch when an Accelerator
already lives in the kernel, chooses fork or spawn (refusing fork when CUDA is
initialised). The resolved :class:`~nbaccel.config.LaunchConfig` in the plan is what
every worker receives, typed; the environment it also gets is torch's (ranks, rendezvous)
and the OS's (threads, visible GPUs), never nbaccel's settings as text.

Example:
    >>> from nbaccel.launch._preflight import plan_launch
    >>> plan = plan_launch(print, (), dict(num_processes=2, start_method="fork", mixed_precision="bf16"))
    >>> plan.num_processes, plan.method, plan.config.mixed_precision
    (2, 'fork', 'bf16')
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import LaunchConfig, resolve_launch_config
from ..config.options import CALL, START, CallOptions, StartOptions, check_settings
from ..errors import ConfigError
from ..platform import cudatrace, environment, hardware, tpu
from ..platform.hardware import default_num_processes
from ._rendezvous import check_rendezvous_args, elastic_meet, parse_endpoint
from ._safety import (
    check_gpus_per_process,
    check_no_state_in_kernel,
    check_platform,
    choose_start_method,
    cuda_fork_error,
    fork_safe_threads,
    worker_threads,
)


@dataclass
class LaunchPlan:
    """The validated, resolved decisions of one launch: the configuration every worker
    receives, and the call's own start and call options as the user gave them."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    config: LaunchConfig
    num_processes: int | None  # per node
    method: str  # "fork", "spawn" or "kernel" (run in this process)
    env: dict[str, str] = field(default_factory=dict)
    threads: int | None = None
    payload: bytes | None = None  # dill-pickled (function, args) for spawn
    start: StartOptions = START
    call: CallOptions = CALL
    tpu: bool = False  # workers on the TPU backend (it sets each one up; see platform.tpu)

    @property
    def debug_timeout(self) -> float | None:
        """debug=True: the seconds a failed rank waits for nbaccel.debug(); else None."""
        return self.start.debug_timeout if self.start.debug else None

    @property
    def world_size(self) -> int:
        return (self.num_processes or 1) * self.config.num_nodes

    def global_rank(self, local_rank: int) -> int:
        return self.config.node_rank * (self.num_processes or 1) + local_rank

    @property
    def ranks(self) -> list[int]:
        """The global ranks of this node's workers."""
        return [self.global_rank(i) for i in range(self.num_processes or 1)]


def check_call(
    function: Any, args: Any, example: str = "notebook_launcher(train, args=(lr,))"
) -> None:
    """The function itself, not its result; its arguments as a tuple (``example``: the
    right call, as the caller spells it)."""
    if not callable(function):
        raise TypeError(
            f"function={function!r} (a {type(function).__name__}) is not callable: pass the "
            f"function, not its result, e.g. {example}, not train(lr)."
        )
    if not isinstance(args, tuple | list):
        raise TypeError(f"args={args!r} must be a tuple of arguments, e.g. args=(lr,).")


def _accelerate_env(cfg: LaunchConfig) -> dict[str, str]:
    """Hugging Face Accelerate's own state (transformers' Trainer builds one in the worker)
    joins a multi-process CPU group only when told so; otherwise each CPU worker would
    silently train alone on the whole data set. An environment variable: nothing imported.
    Only for started workers (counting GPUs may start a subprocess; an in-kernel run needs
    no environment)."""
    if cfg.compute_device == "cpu" or (
        cfg.compute_device == "auto"
        and not environment.xla_requested()
        and environment.gpu_count() == 0
    ):
        return {"ACCELERATE_USE_CPU": "true"}
    return {}


def _count_processes(cfg: LaunchConfig) -> int:
    if cfg.num_processes is not None:
        return cfg.num_processes
    if cfg.compute_device == "cpu":
        return 1
    if cfg.compute_device == "gpu" and environment.gpu_count() == 0:
        raise ConfigError("compute_device='gpu' but no CUDA GPU is visible; use 'cpu' or 'auto'.")
    # one rule for "one process per usable GPU", shared with the CLI and the panel
    return default_num_processes(cfg.compute_device, cfg.gpu_ids)


def _spawn_payload(function: Any, args: tuple[Any, ...]) -> bytes:
    import dill

    try:
        return bytes(dill.dumps((function, args, {}), recurse=True))
    except Exception as err:
        raise TypeError(
            f"could not send the function to the spawned workers ({type(err).__name__}: {err}). "
            "With start_method='spawn' the function, its args and the globals it uses are "
            "pickled with dill: create unpicklable objects (open files, locks, CUDA models) "
            "inside the function, or pass them through args as plain data."
        ) from err


def process_env(cfg: LaunchConfig, threads: int | None) -> dict[str, str]:
    """What the operating system and libraries of every worker read from the environment
    (visible GPUs, compute threads, torch's distributed debug level); rank and rendezvous
    variables are added per worker."""
    env = {}
    if cfg.gpu_ids and cfg.gpu_ids.strip().lower() != "all":
        env["CUDA_VISIBLE_DEVICES"] = cfg.gpu_ids.replace(" ", "")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if cfg.debug_collectives:  # torch wraps each process group in its checking wrapper
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    return env


def plan_launch(
    function: Any,
    args: Any = (),
    settings: Mapping[str, Any] | None = None,
    start: StartOptions = START,
    call: CallOptions = CALL,
    *,
    kernel_state_ok: bool = False,  # a test's own Accelerator in this process (run_on_workers)
) -> LaunchPlan:
    """Validate and resolve a launch; raises before anything is started.

    ``settings`` are :class:`~nbaccel.config.LaunchConfig` fields given as arguments
    (``None``: not given). Every one given wins over ``start.config``, the config file and
    the environment, also when it equals the default (``num_nodes=1``, ``max_restarts=0``).
    ``start`` and ``call`` were validated when they were made.
    """
    cudatrace.install()  # from now on a later CUDA initialisation in the kernel is recorded
    check_call(function, args)
    given = check_settings(dict(settings or {}))
    nodes: int = given.get("num_nodes") or (start.config.num_nodes if start.config else 1)
    check_rendezvous_args(start.rdzv_backend, start.rdzv_conf, start.rdzv_id, start.rdzv_endpoint,
                          nodes)  # fmt: skip
    elastic = start.rdzv_backend == "c10d" and nodes > 1
    port = start.port
    if start.rdzv_endpoint and not elastic:
        host, at = parse_endpoint(start.rdzv_endpoint)
        if host:
            given["master_addr"] = host
        port = at or port
    if elastic:  # the machines meet and get their node_rank (every other value checked first)
        LaunchConfig(**dict(given, num_nodes=1, node_rank=0))
        given["node_rank"], given["master_addr"], port = elastic_meet(
            start.rdzv_endpoint,
            run_id=start.rdzv_id,
            num_nodes=nodes,
            conf=start.rdzv_conf,
            port=port,
            timeout=given.get("timeout"),
        )
    if start.debug:
        given["debug"] = True
    if port is not None:
        given["master_port"] = port
    cfg = resolve_launch_config(given) if start.config is None else start.config.replace(**given)
    if start.rdzv_backend == "c10d" and cfg.num_nodes > 1 and not elastic:
        raise ConfigError(
            f"rdzv_backend='c10d' with num_nodes={cfg.num_nodes} from the config: pass "
            "num_nodes=... to the launch itself, so that the machines meet before it starts."
        )
    return _decide(LaunchPlan(function, tuple(args), cfg, None, "", start=start, call=call),
                   kernel_state_ok)  # fmt: skip


def _tpu_processes(cfg: LaunchConfig) -> int:
    """TPU: the backend's processes, started and served by the one engine (never in the
    kernel, whose XLA runtime must stay unstarted for the workers to own the chips)."""
    if cfg.strategy in ("fsdp", "deepspeed"):  # a config error first, with or without torch_xla
        raise ConfigError(
            f"strategy={cfg.strategy!r} is not available on TPU (torch_xla); use 'ddp'."
        )
    backend = tpu.require_backend()
    nproc = tpu.check_process_count(cfg.num_processes) or 1  # e.g. 4 on a v5e-8: refused
    if backend.runtime_initialized():
        raise ConfigError(
            f"the {backend.name} runtime is already started in this kernel (an XLA device or "
            "tensor was used before launching), so no worker can own the TPU. Restart the "
            "kernel and launch before touching the device."
        )
    check_platform(cfg.start_method)
    return nproc


def _check_deepspeed(cfg: LaunchConfig, args: tuple[Any, ...]) -> None:
    """DeepSpeed asked for (strategy, or a plugin among the arguments) but not installed:
    one error naming the install command, in the kernel, before any worker starts."""
    from ..runtime.deepspeed_plugin import DeepSpeedPlugin, require_deepspeed

    if cfg.strategy == "deepspeed" or any(isinstance(a, DeepSpeedPlugin) for a in args):
        require_deepspeed("strategy='deepspeed' (or a DeepSpeedPlugin)")


def _decide(plan: LaunchPlan, kernel_state_ok: bool) -> LaunchPlan:
    """How many processes, started how (or the function run right here), with what
    environment: ``plan`` completed."""
    cfg, args = plan.config, plan.args
    on_tpu = cfg.compute_device == "tpu" or (
        cfg.compute_device == "auto" and environment.xla_requested()
    )
    threads: int | None = None
    if on_tpu:
        nproc, in_kernel = _tpu_processes(cfg), False
    else:
        _check_deepspeed(cfg, args)
        nproc = _count_processes(cfg)
        in_kernel = nproc == 1 and cfg.num_nodes == 1 and plan.call.block
        if not in_kernel:
            check_platform(cfg.start_method)  # the OS first: nothing else would help there
        check_gpus_per_process(cfg, nproc)
        hardware.check_gpu_precision(cfg.mixed_precision, cfg.compute_device)  # bf16 on a T4
        if cfg.strategy == "fsdp" and nproc * cfg.num_nodes < 2:
            raise ConfigError(
                "strategy='fsdp' shards the model across processes, but this launch starts "
                "one: pass num_processes >= 2 (CPU processes work too), or use strategy='ddp'."
            )
        if (nproc > 1 or cfg.num_nodes > 1) and not kernel_state_ok:  # workers drop it anyway
            check_no_state_in_kernel()
        threads = None if in_kernel else worker_threads(nproc)
    method = "kernel" if in_kernel else choose_start_method(cfg.start_method)
    if method == "fork" and not on_tpu:
        threads = fork_safe_threads(threads)
    payload = _spawn_payload(plan.function, args) if method == "spawn" else None
    env = process_env(cfg, threads)
    if not (in_kernel or on_tpu):
        env.update(_accelerate_env(cfg))
    return dataclasses.replace(plan, num_processes=nproc, method=method, env=env,
                               threads=threads, payload=payload, tpu=on_tpu)  # fmt: skip


def plan_script(cfg: LaunchConfig) -> LaunchPlan:
    """A script's launch (``nbaccel launch``): worker processes also for one, each a fresh
    interpreter (as ``python script.py``) unless ``start_method="fork"``; on a TPU one
    process (torch_xla's runtime starts one per chip from it). Output is not prefixed."""
    on_tpu = cfg.compute_device == "tpu"
    nproc = 1 if on_tpu else _count_processes(cfg)
    check_platform(cfg.start_method)
    check_gpus_per_process(cfg, nproc)
    threads = worker_threads(nproc)
    env = process_env(cfg, threads) | _accelerate_env(cfg)
    if on_tpu:
        env["PJRT_DEVICE"] = os.environ.get("PJRT_DEVICE", "TPU")
    method = "fork" if cfg.start_method == "fork" else "spawn"
    return LaunchPlan(print, (), cfg, nproc, method, env, threads,
                      start=StartOptions(log_line_prefix_template=""))  # fmt: skip


__all__ = [
    "LaunchPlan",
    "check_call",
    "cuda_fork_error",
    "plan_launch",
    "plan_script",
    "process_env",
]
