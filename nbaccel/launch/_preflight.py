"""Everything the launcher checks and decides before a single process exists.

:func:`plan_launch` validates the arguments (``TypeError``/``ValueError`` naming
the argument and the fix), merges them with the environment and the config
file through :func:`nbaccel.config.resolve_launch_config`, counts devices
without initialising CUDA, refuses a multi-process launch when an Accelerator
already lives in the kernel, chooses fork or spawn (refusing fork when CUDA is
initialised) and builds the environment every worker gets.

Example:
    >>> from nbaccel.launch._preflight import plan_launch
    >>> plan = plan_launch(print, num_processes=2, start_method="fork")
    >>> plan.num_processes, plan.method, plan.env["NBACCEL_MIXED_PRECISION"]
    (2, 'fork', 'no')
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import (
    START_METHODS,
    LaunchConfig,
    normalize_precision,
    resolve_launch_config,
    strategy_environment,
)
from ..errors import ConfigError, CUDAInitializedError, LaunchError, too_few_gpus_error
from ..platform import cudatrace, environment, forksafe
from ..platform.hardware import default_num_processes

RDZV_BACKENDS = ("static", "c10d")


@dataclass
class LaunchPlan:
    """The validated, resolved decisions of one ``notebook_launcher`` call."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    config: LaunchConfig
    num_processes: int | None  # per node; None only on the XLA path ("all cores")
    method: str  # "fork", "spawn", "kernel" (run in this process) or "xla"
    env: dict[str, str] = field(default_factory=dict)
    threads: int | None = None
    payload: bytes | None = None  # dill-pickled (function, args) for spawn
    template: str | None = None
    output: Any = None
    return_all_ranks: bool = False
    block: bool = True
    monitor_interval: float = 0.1

    @property
    def world_size(self) -> int:
        return (self.num_processes or 1) * self.config.num_nodes

    def global_rank(self, local_rank: int) -> int:
        return self.config.node_rank * (self.num_processes or 1) + local_rank


def _check_int(name: str, value: Any, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int; {fix}")
    if value < minimum:
        raise ConfigError(f"{name}={value!r} must be >= {minimum}; {fix}")


def _check_function(function: Any) -> None:
    if not callable(function):
        raise TypeError(
            f"function={function!r} (a {type(function).__name__}) is not callable: pass the "
            "function, not its result, e.g. notebook_launcher(train, args=(model,)) instead "
            "of notebook_launcher(train(model))."
        )


def _parse_endpoint(endpoint: str) -> tuple[str | None, int | None]:
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        return endpoint or None, None
    if not port.isdigit():
        raise ConfigError(f"rdzv_endpoint={endpoint!r} must look like 'host:port'.")
    return host or None, int(port)


def _overrides(**given: Any) -> dict[str, Any]:
    """Arguments that differ from the signature defaults count as explicit settings."""
    defaults = {"master_addr": "127.0.0.1", "node_rank": 0, "num_nodes": 1}
    defaults.update(start_method="auto", max_restarts=0)
    return {k: v for k, v in given.items() if v is not None and defaults.get(k, object()) != v}


def _check_no_state_in_kernel() -> None:
    state = sys.modules.get("nbaccel.runtime.state")
    if state is not None and state.current_state() is not None:
        raise ConfigError(
            "an Accelerator was already created in this kernel, so it cannot launch several "
            "processes: its process state would be copied into every worker. Create the "
            "Accelerator inside the training function; restart the kernel (or call "
            "nbaccel.runtime.state.reset_state()) and launch again."
        )
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        raise ConfigError(
            "a torch.distributed process group is already initialised in this kernel; call "
            "torch.distributed.destroy_process_group() (or restart the kernel) before launching."
        )


def _count_processes(cfg: LaunchConfig) -> int:
    if cfg.num_processes is not None:
        return cfg.num_processes
    if cfg.compute_device == "cpu":
        return 1
    if cfg.compute_device == "gpu" and environment.gpu_count() == 0:
        raise ConfigError("compute_device='gpu' but no CUDA GPU is visible; use 'cpu' or 'auto'.")
    # one rule for "one process per usable GPU", shared with the CLI and the panel
    return default_num_processes(cfg.compute_device, cfg.gpu_ids)


def _check_gpus_per_process(cfg: LaunchConfig, nproc: int) -> None:
    """More processes than GPUs would put two NCCL ranks on one GPU: refuse before starting.

    Counted without initialising CUDA (NVML). Only for launches that will use the GPUs:
    ``compute_device='cpu'`` runs gloo on the CPU, where any number of processes works.
    """
    if nproc < 2 or cfg.compute_device == "cpu":
        return
    gpus = environment.gpu_count()
    if cfg.gpu_ids and cfg.gpu_ids.strip().lower() != "all":
        gpus = min(gpus, len([g for g in cfg.gpu_ids.split(",") if g.strip()]))
    if 0 < gpus < nproc:
        raise too_few_gpus_error(nproc, gpus)


def cuda_fork_error() -> CUDAInitializedError:
    """The error for start_method='fork' in a kernel where CUDA is initialised."""
    where = cudatrace.describe_first_init()
    culprit = (
        f"CUDA was first initialised here:\n{where}"
        if where
        else "Where it was first initialised is unknown (import nbaccel before touching CUDA, "
        "or set NBACCEL_DEBUG_MODE=1, to have it recorded)."
    )
    return CUDAInitializedError(
        "CUDA is already initialised in this kernel, so start_method='fork' cannot be used: "
        "forked workers would inherit a CUDA context that does not work in a child process.\n"
        f"{culprit}\nFix it in one of two ways:\n"
        "  1. restart the kernel and do not touch CUDA (.cuda(), .to('cuda'), "
        "torch.cuda.is_available()...) before calling notebook_launcher; create the model "
        "and move it to the GPU inside the training function;\n"
        "  2. pass start_method='spawn' (or 'auto'), which starts fresh worker processes and "
        "ships your function with dill, no restart needed."
    )


def _check_platform(requested: str) -> None:
    """Refuse, before anything starts, what this operating system cannot do."""
    if sys.platform == "win32":
        raise LaunchError(
            "notebook_launcher cannot start worker processes on Windows "
            f"(sys.platform={sys.platform!r}): its workers are started with POSIX facilities "
            "(inherited pipes and sockets, process sessions, signals). Alternatives: run the "
            "notebook in WSL2 (Linux), where every launch works; or use num_processes=1 "
            "(block=True), which runs the function in this kernel; Accelerator() itself works "
            "on Windows in one process."
        )
    if requested == "fork" and sys.platform == "darwin":
        raise ConfigError(
            f"start_method='fork' is not safe on macOS (sys.platform={sys.platform!r}): Apple's "
            "system libraries (and torch's OpenMP pool, which cannot be released there without "
            "/proc) break in forked children. Use start_method='spawn' or 'auto' (which spawns "
            "on macOS)."
        )


def _start_method(requested: str) -> str:
    initialized = environment.cuda_initialized()  # the real torch.cuda.is_initialized()
    # cudaGetDeviceCount (e.g. torch.cuda.is_available()) loads and initialises the driver
    # without setting torch's flag; forked children then fail on their first CUDA call.
    driver = not initialized and environment.cuda_driver_loaded()
    if requested == "fork":
        if not hasattr(os, "fork"):
            raise ConfigError("start_method='fork' is not available on this platform; use 'spawn'.")
        if initialized:
            raise cuda_fork_error()
        if driver:
            warnings.warn(
                "the CUDA driver is already loaded in this kernel (torch.cuda.is_available() "
                "or device_count() without NVML do that), so forked workers may fail on their "
                "first CUDA call; use start_method='spawn' if they do.",
                RuntimeWarning,
                stacklevel=4,
            )
        return "fork"
    if requested == "spawn" or initialized or driver or not environment.fork_preferred():
        return "spawn"
    return "fork"


def _fork_safe_threads(threads: int | None) -> int | None:
    """1 compute thread per forked worker where the kernel's OpenMP pool cannot be released."""
    inherited = os.environ.get("OMP_NUM_THREADS", "").strip()  # threads=None: the user's
    if (threads if threads is not None else inherited) in (1, "1"):
        return threads  # single-threaded workers never touch the pool
    stuck = forksafe.unreleasable_openmp_runtimes()
    if not stuck:
        return threads
    warnings.warn(
        f"this torch's OpenMP runtime ({os.path.basename(stuck[0])}, older than OpenMP 5.0; "
        "torch 2.4's wheels ship it) cannot release the kernel's thread pool before fork, so "
        "a forked worker's first multi-threaded op would wait for ever on pool threads that "
        "do not exist in it. The workers run with 1 compute thread each; do not raise "
        "torch.set_num_threads in the function. For multi-threaded workers pass "
        "start_method='spawn', or use torch >= 2.5.",
        RuntimeWarning,
        stacklevel=5,
    )
    return 1


def _spawn_payload(function: Any, args: tuple[Any, ...]) -> bytes:
    import dill

    try:
        return bytes(dill.dumps((function, args), recurse=True))
    except Exception as err:
        raise TypeError(
            f"could not send the function to the spawned workers ({type(err).__name__}: {err}). "
            "With start_method='spawn' the function, its args and the globals it uses are "
            "pickled with dill: create unpicklable objects (open files, locks, CUDA models) "
            "inside the function, or pass them through args as plain data."
        ) from err


def worker_env(cfg: LaunchConfig, threads: int | None) -> dict[str, str]:
    """The nbaccel settings every worker receives (rank variables are added per worker)."""
    env = {
        "NBACCEL_MIXED_PRECISION": cfg.mixed_precision,
        "NBACCEL_GRADIENT_ACCUMULATION_STEPS": str(cfg.gradient_accumulation_steps),
    }
    if cfg.compute_device == "cpu":
        env["NBACCEL_USE_CPU"] = "1"
    if cfg.compute_device == "cpu" or (
        cfg.compute_device == "auto"
        and environment.gpu_count() == 0
        and not environment.xla_requested()
    ):
        # Hugging Face Accelerate's own state (transformers' Trainer builds one in the worker)
        # joins a multi-process CPU group only when told so; otherwise each worker would
        # silently train alone on the whole data set. An environment variable: nothing imported.
        env["ACCELERATE_USE_CPU"] = "true"
    if cfg.timeout is not None:
        env["NBACCEL_TIMEOUT"] = repr(float(cfg.timeout))
    if cfg.debug:
        env["NBACCEL_DEBUG_MODE"] = "1"
    if cfg.gpu_ids and cfg.gpu_ids.strip().lower() != "all":
        env["CUDA_VISIBLE_DEVICES"] = cfg.gpu_ids.replace(" ", "")
    env.update(strategy_environment(cfg))  # the Accelerator() inside picks FSDP from these
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def plan_launch(
    function: Any,
    args: Any = (),
    num_processes: Any = None,
    mixed_precision: Any = None,
    use_port: Any = None,
    master_addr: Any = "127.0.0.1",
    node_rank: Any = 0,
    num_nodes: Any = 1,
    start_method: Any = "auto",
    max_restarts: Any = 0,
    timeout: Any = None,
    *,
    rdzv_backend: Any = "static",
    rdzv_endpoint: Any = "",
    monitor_interval: Any = 0.1,
    log_line_prefix_template: Any = None,
    config: Any = None,
    return_all_ranks: bool = False,
    block: bool = True,
    output: Any = None,
) -> LaunchPlan:
    """Validate and resolve a launch; raises before anything is started."""
    _check_function(function)
    if not isinstance(args, tuple | list):
        raise TypeError(f"args={args!r} must be a tuple of arguments, e.g. args=(model,).")
    fix = "use None for one process per device, or a positive int."
    if num_processes is not None:
        _check_int("num_processes", num_processes, 1, fix)
    _check_int("num_nodes", num_nodes, 1, "pass the number of machines taking part.")
    _check_int("node_rank", node_rank, 0, "number the machines 0..num_nodes-1.")
    if node_rank >= num_nodes:
        raise ConfigError(
            f"node_rank={node_rank} must be < num_nodes={num_nodes}; number the machines "
            "0..num_nodes-1 and give each its own node_rank."
        )
    if mixed_precision is not None:
        mixed_precision = normalize_precision(mixed_precision)
    if start_method not in START_METHODS:
        raise ConfigError(f"start_method={start_method!r} is unknown; use one of {START_METHODS}.")
    _check_int("max_restarts", max_restarts, 0, "pass 0 to never restart.")
    if use_port is not None:
        _check_int("use_port", use_port, 0, "pass a free TCP port, or None to pick one.")
        if use_port > 65535:
            raise ConfigError(f"use_port={use_port} must be <= 65535.")
        use_port = use_port or None
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
        raise TypeError(f"timeout={timeout!r} must be a number of seconds (or None).")
    if rdzv_backend not in RDZV_BACKENDS:
        raise ConfigError(f"rdzv_backend={rdzv_backend!r} is unknown; use one of {RDZV_BACKENDS}.")
    if rdzv_endpoint:
        host, port = _parse_endpoint(str(rdzv_endpoint))
        master_addr, use_port = host or master_addr, port or use_port
    if not isinstance(monitor_interval, int | float) or not monitor_interval > 0:
        raise ConfigError(f"monitor_interval={monitor_interval!r} must be seconds > 0.")
    if log_line_prefix_template is not None and not isinstance(log_line_prefix_template, str):
        raise TypeError(f"log_line_prefix_template={log_line_prefix_template!r} must be a str.")
    if output is not None and not (callable(output) or hasattr(output, "write")):
        raise TypeError(f"output={output!r} must be a file-like object or a callable.")
    if config is not None and not isinstance(config, LaunchConfig):
        raise TypeError(f"config={config!r} must be a nbaccel.LaunchConfig (or None).")

    given = _overrides(
        num_processes=num_processes,
        mixed_precision=mixed_precision,
        master_addr=master_addr,
        master_port=use_port,
        node_rank=node_rank,
        num_nodes=num_nodes,
        start_method=start_method,
        max_restarts=max_restarts,
        timeout=timeout,
    )
    cfg = config.replace(**given) if config is not None else resolve_launch_config(given)
    common: dict[str, Any] = {
        "template": log_line_prefix_template,
        "output": output,
        "return_all_ranks": bool(return_all_ranks),
        "block": bool(block),
        "monitor_interval": float(monitor_interval),
    }
    return _decide(cfg, function, tuple(args), common)


def _decide(
    cfg: LaunchConfig, function: Any, args: tuple[Any, ...], common: dict[str, Any]
) -> LaunchPlan:
    if cfg.compute_device == "tpu" or (
        cfg.compute_device == "auto" and environment.xla_requested()
    ):
        if not common["block"]:
            raise ConfigError("block=False is not supported on TPU (torch_xla); use block=True.")
        nproc = cfg.num_processes or environment.tpu_core_count()
        if cfg.strategy == "fsdp":
            raise ConfigError("strategy='fsdp' is not available on TPU (torch_xla); use 'ddp'.")
        return LaunchPlan(function, args, cfg, nproc, "xla", worker_env(cfg, None), **common)
    nproc = _count_processes(cfg)
    in_kernel = nproc == 1 and cfg.num_nodes == 1 and common["block"]
    if not in_kernel:
        _check_platform(cfg.start_method)  # the OS first: nothing else would help there
    _check_gpus_per_process(cfg, nproc)
    if cfg.strategy == "fsdp" and nproc * cfg.num_nodes < 2:
        raise ConfigError(
            "strategy='fsdp' shards the model across processes, but this launch starts one: "
            "pass num_processes >= 2 (CPU processes work too), or use strategy='ddp'."
        )
    if nproc > 1 or cfg.num_nodes > 1:
        _check_no_state_in_kernel()
    user_threads = "OMP_NUM_THREADS" in os.environ
    threads = None if user_threads else max(1, environment.cpu_count() // nproc)
    if in_kernel:
        method, threads = "kernel", None
    else:
        method = _start_method(cfg.start_method)
    if method == "fork":
        threads = _fork_safe_threads(threads)
    payload = _spawn_payload(function, args) if method == "spawn" else None
    env = worker_env(cfg, threads)
    return LaunchPlan(function, args, cfg, nproc, method, env, threads, payload, **common)


__all__ = ["LaunchPlan", "cuda_fork_error", "plan_launch", "worker_env"]
