"""Everything the launcher checks and decides before a single process exists.

:func:`plan_launch` validates the arguments (``TypeError``/``ValueError`` naming
the argument and the fix), merges them with the environment and the config
file through :func:`nbaccel.config.resolve_launch_config`, counts devices
without initialising CUDA, refuses a multi-process launch when an Accelerator
already lives in the kernel, chooses fork or spawn (refusing fork when CUDA is
initialised). The resolved :class:`~nbaccel.config.LaunchConfig` in the plan is what
every worker receives, typed; the environment it also gets is torch's (ranks, rendezvous)
and the OS's (threads, visible GPUs), never nbaccel's settings as text.

Example:
    >>> from nbaccel.launch._preflight import plan_launch
    >>> plan = plan_launch(print, num_processes=2, start_method="fork", mixed_precision="bf16")
    >>> plan.num_processes, plan.method, plan.config.mixed_precision
    (2, 'fork', 'bf16')
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import (
    START_METHODS,
    LaunchConfig,
    normalize_precision,
    resolve_launch_config,
)
from ..errors import ConfigError
from ..platform import cudatrace, environment, hardware, tpu
from ..platform.hardware import default_num_processes
from ._kept import DEBUG_TIMEOUT
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
    """The validated, resolved decisions of one ``notebook_launcher`` call."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    config: LaunchConfig
    num_processes: int | None  # per node
    method: str  # "fork", "spawn" or "kernel" (run in this process)
    env: dict[str, str] = field(default_factory=dict)
    threads: int | None = None
    payload: bytes | None = None  # dill-pickled (function, args) for spawn
    template: str | None = None
    output: Any = None
    return_all_ranks: bool = False
    block: bool = True
    monitor_interval: float = 0.1
    debug_timeout: float | None = None  # debug=True: a failed rank waits this long for debug()
    tpu: bool = False  # workers on the TPU backend (it sets each one up; see platform.tpu)

    @property
    def world_size(self) -> int:
        return (self.num_processes or 1) * self.config.num_nodes

    def global_rank(self, local_rank: int) -> int:
        return self.config.node_rank * (self.num_processes or 1) + local_rank

    @property
    def ranks(self) -> list[int]:
        """The global ranks of this node's workers."""
        return [self.global_rank(i) for i in range(self.num_processes or 1)]


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


def _check_port(use_port: Any) -> int | None:
    """``use_port`` as an int (Accelerate's scripts pass it as a string, "29500"), or None."""
    if isinstance(use_port, str) and use_port.strip().isdigit():
        use_port = int(use_port)
    if use_port is None:
        return None
    _check_int("use_port", use_port, 0, "pass a free TCP port, or None to pick one.")
    if use_port > 65535:
        raise ConfigError(f"use_port={use_port} must be <= 65535.")
    return int(use_port) or None


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


#: the options of a launch (notebook_launcher's arguments after ``args``) and their defaults;
#: None means "not given": the environment, the config file or the default decides
_NONE = "num_processes mixed_precision use_port master_addr node_rank num_nodes rdzv_conf "
_NONE += "max_restarts log_line_prefix_template start_method timeout config output "
_NONE += "hang_after on_hang debug_collectives"
OPTIONS: dict[str, Any] = dict.fromkeys(_NONE.split()) | {
    "rdzv_backend": "static",
    "rdzv_endpoint": "",
    "rdzv_id": "none",
    "monitor_interval": 0.1,
    "return_all_ranks": False,
    "block": True,
    "kernel_state_ok": False,  # a test's own Accelerator in this process (run_on_workers)
    "debug": False,
    "debug_timeout": None,
}
# the options that are LaunchConfig fields (use_port is master_port there)
_FIELDS = "num_processes mixed_precision master_addr node_rank num_nodes start_method "
_FIELDS += "max_restarts timeout hang_after on_hang debug_collectives"


def plan_launch(function: Any, args: Any = (), **options: Any) -> LaunchPlan:
    """Validate and resolve a launch; raises before anything is started.

    ``options`` are :data:`OPTIONS`. Every one that is not None was given explicitly and
    wins over the config file and the environment, also when it equals the default
    (``num_nodes=1``, ``max_restarts=0``).
    """
    cudatrace.install()  # from now on a later CUDA initialisation in the kernel is recorded
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"unexpected argument(s) {unknown}; valid ones: {sorted(OPTIONS)}.")
    o = {**OPTIONS, **options}
    _check_function(function)
    if not isinstance(args, tuple | list):
        raise TypeError(f"args={args!r} must be a tuple of arguments, e.g. args=(model,).")
    fixes = {
        "num_processes": (1, "use None for one process per device, or a positive int."),
        "num_nodes": (1, "pass the number of machines taking part."),
        "node_rank": (0, "number the machines 0..num_nodes-1."),  # < num_nodes: LaunchConfig
        "max_restarts": (0, "pass 0 to never restart."),
    }
    for name, (minimum, fix) in fixes.items():
        if o[name] is not None:
            _check_int(name, o[name], minimum, fix)
    if o["mixed_precision"] is not None:
        o["mixed_precision"] = normalize_precision(o["mixed_precision"])
    if o["start_method"] is not None and o["start_method"] not in START_METHODS:
        raise ConfigError(
            f"start_method={o['start_method']!r} is unknown; use one of {START_METHODS}."
        )
    o["use_port"] = _check_port(o["use_port"])
    timeout = o["timeout"]
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
        raise TypeError(f"timeout={timeout!r} must be a number of seconds (or None).")
    rdzv = (o["rdzv_backend"], o["rdzv_conf"], o["rdzv_id"], o["rdzv_endpoint"])
    nodes = o["num_nodes"] or getattr(o["config"], "num_nodes", None) or 1
    check_rendezvous_args(*rdzv, nodes)
    elastic = o["rdzv_backend"] == "c10d" and nodes > 1
    if o["rdzv_endpoint"] and not elastic:
        host, port = parse_endpoint(str(o["rdzv_endpoint"]))
        o["master_addr"], o["use_port"] = host or o["master_addr"], port or o["use_port"]
    interval, template, output = o["monitor_interval"], o["log_line_prefix_template"], o["output"]
    if not isinstance(interval, int | float) or not interval > 0:
        raise ConfigError(f"monitor_interval={interval!r} must be seconds > 0.")
    if template is not None and not isinstance(template, str):
        raise TypeError(f"log_line_prefix_template={template!r} must be a str.")
    if output is not None and not (callable(output) or hasattr(output, "write")):
        raise TypeError(f"output={output!r} must be a file-like object or a callable.")
    if o["config"] is not None and not isinstance(o["config"], LaunchConfig):
        raise TypeError(f"config={o['config']!r} must be a nbaccel.LaunchConfig (or None).")
    linger = _check_debug(o["debug"], o["debug_timeout"])
    if elastic:  # the machines meet and get their node_rank (nothing started yet)
        o["node_rank"], o["master_addr"], o["use_port"] = elastic_meet(
            str(o["rdzv_endpoint"]),
            run_id=str(o["rdzv_id"]),
            num_nodes=nodes,
            conf=o["rdzv_conf"],
            port=o["use_port"],
            timeout=o["timeout"],
        )
    given = {k: o[k] for k in _FIELDS.split() if o[k] is not None}
    if linger is not None:
        given["debug"] = True
    if o["use_port"] is not None:
        given["master_port"] = o["use_port"]
    cfg = o["config"].replace(**given) if o["config"] is not None else resolve_launch_config(given)
    if o["rdzv_backend"] == "c10d" and cfg.num_nodes > 1 and not elastic:
        raise ConfigError(
            f"rdzv_backend='c10d' with num_nodes={cfg.num_nodes} from the config: pass "
            "num_nodes=... to the launch itself, so that the machines meet before it starts."
        )
    common: dict[str, Any] = {
        "template": template,
        "output": output,
        "return_all_ranks": bool(o["return_all_ranks"]),
        "block": bool(o["block"]),
        "monitor_interval": float(interval),
        "debug_timeout": linger,
    }
    return _decide(cfg, function, tuple(args), common, o["kernel_state_ok"])


def _check_debug(debug: Any, timeout: Any) -> float | None:
    """debug=True: the seconds a failed rank waits for nbaccel.debug(); else None."""
    if not isinstance(debug, bool):
        raise TypeError(f"debug={debug!r} must be True or False.")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0
    ):
        raise ConfigError(
            f"debug_timeout={timeout!r} must be seconds > 0 (how long a failed rank waits for "
            f"nbaccel.debug(); default {DEBUG_TIMEOUT:g})."
        )
    if not debug:
        return None
    return float(DEBUG_TIMEOUT if timeout is None else timeout)


def _tpu_plan(cfg: LaunchConfig, function: Any, args: tuple[Any, ...], common: Any) -> LaunchPlan:
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
    method = choose_start_method(cfg.start_method)
    payload = _spawn_payload(function, args) if method == "spawn" else None
    env = process_env(cfg, None)
    return LaunchPlan(function, args, cfg, nproc, method, env, None, payload, **common, tpu=True)


def _check_deepspeed(cfg: LaunchConfig, args: tuple[Any, ...]) -> None:
    """DeepSpeed asked for (strategy, or a plugin among the arguments) but not installed:
    one error naming the install command, in the kernel, before any worker starts."""
    from ..runtime.deepspeed_plugin import DeepSpeedPlugin, require_deepspeed

    if cfg.strategy == "deepspeed" or any(isinstance(a, DeepSpeedPlugin) for a in args):
        require_deepspeed("strategy='deepspeed' (or a DeepSpeedPlugin)")


def _decide(
    cfg: LaunchConfig,
    function: Any,
    args: tuple[Any, ...],
    common: dict[str, Any],
    kernel_state_ok: bool = False,
) -> LaunchPlan:
    if cfg.compute_device == "tpu" or (
        cfg.compute_device == "auto" and environment.xla_requested()
    ):
        return _tpu_plan(cfg, function, args, common)
    _check_deepspeed(cfg, args)
    nproc = _count_processes(cfg)
    in_kernel = nproc == 1 and cfg.num_nodes == 1 and common["block"]
    if not in_kernel:
        check_platform(cfg.start_method)  # the OS first: nothing else would help there
    check_gpus_per_process(cfg, nproc)
    hardware.check_gpu_precision(cfg.mixed_precision, cfg.compute_device)  # bf16 on a T4: fp16
    if cfg.strategy == "fsdp" and nproc * cfg.num_nodes < 2:
        raise ConfigError(
            "strategy='fsdp' shards the model across processes, but this launch starts one: "
            "pass num_processes >= 2 (CPU processes work too), or use strategy='ddp'."
        )
    if (nproc > 1 or cfg.num_nodes > 1) and not kernel_state_ok:  # workers drop it anyway
        check_no_state_in_kernel()
    threads: int | None = worker_threads(nproc)
    if in_kernel:
        method, threads = "kernel", None
    else:
        method = choose_start_method(cfg.start_method)
    if method == "fork":
        threads = fork_safe_threads(threads)
    payload = _spawn_payload(function, args) if method == "spawn" else None
    env = process_env(cfg, threads)
    if not in_kernel:
        env.update(_accelerate_env(cfg))
    return LaunchPlan(function, args, cfg, nproc, method, env, threads, payload, **common)


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
    return LaunchPlan(print, (), cfg, nproc, method, env, threads, template="")


__all__ = [
    "DEBUG_TIMEOUT",
    "LaunchPlan",
    "cuda_fork_error",
    "plan_launch",
    "plan_script",
    "process_env",
]
