"""Everything the launcher checks and decides before a single process exists.

:func:`plan_launch` type-checks the settings given as arguments (the options of
:mod:`nbaccel.config.options` check themselves; ``TypeError``/``ValueError`` naming
the argument and the fix), merges them with the environment and the config
file through :func:`nbaccel.config.resolve_launch_config`, counts devices
without initialising CUDA, and refuses, each with what to do: a live ``Accelerator`` or
process group in the kernel, more NCCL processes than GPUs, no fork or POSIX process
control, CUDA initialised before a fork (the error names the line). ``"auto"`` forks only
when safe; where torch 2.4's libgomp pool cannot be released before forking, forked
workers keep one compute thread. The resolved :class:`~nbaccel.config.LaunchConfig` in
the plan is what every worker receives, typed; the environment it also gets is torch's
(ranks, rendezvous) and the OS's (threads, visible GPUs), never nbaccel's settings as text.

Example:
    >>> from nbaccel.launch.start._preflight import plan_launch
    >>> plan = plan_launch(print, (), dict(num_processes=2, start_method="fork", mixed_precision="bf16"))
    >>> plan.num_processes, plan.method, plan.config.mixed_precision
    (2, 'fork', 'bf16')
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...config import LaunchConfig, resolve_launch_config
from ...config.options import CALL, START, CallOptions, StartOptions, check_settings
from ...errors import ConfigError, CUDAInitializedError, LaunchError, too_few_gpus_error
from ...platform import cudafork, cudatrace, environment, forksafe, gpufacts, hardware, stores
from ..channel._jobs import dill_for_workers
from ..channel._rendezvous import check_rendezvous_args, elastic_meet, parse_endpoint
from . import _forkserver, _freegpus
from ._local import take_fork_server
from ._tpu import tpu_processes
from .cluster._cluster_place import check_cluster_installed, keep_print_plain


def check_no_state_in_kernel() -> None:
    state = sys.modules.get("nbaccel.runtime.process.state")
    if state is not None and state.current_state() is not None:
        raise ConfigError(
            "an Accelerator was already created in this kernel, so it cannot launch several "
            "processes: its process state would be copied into every worker. Create the "
            "Accelerator inside the training function; restart the kernel (or call "
            "nbaccel.runtime.process.state.reset_state()) and launch again."
        )
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        raise ConfigError(
            "a torch.distributed process group is already initialised in this kernel; call "
            "torch.distributed.destroy_process_group() (or restart the kernel) before launching."
        )


def check_gpus_per_process(cfg: LaunchConfig, nproc: int) -> None:
    """More processes than GPUs would put two NCCL ranks on one GPU: refuse before starting
    (counted with NVML, not CUDA; never for ``compute_device='cpu'``)."""
    if nproc < 2 or cfg.compute_device == "cpu":
        return
    gpus = environment.gpu_count()
    if cfg.gpu_ids and cfg.gpu_ids.strip().lower() != "all":
        gpus = min(gpus, len([g for g in cfg.gpu_ids.split(",") if g.strip()]))
    if 0 < gpus < nproc:
        raise too_few_gpus_error(nproc, gpus)


def check_cluster_gpu_ids(cfg: LaunchConfig) -> None:
    """``gpu_ids`` names this machine's GPUs; on a cluster Ray lends each node's."""
    if cfg.gpu_ids and cfg.gpu_ids.strip().lower() != "all":
        raise ConfigError(
            f"gpu_ids={cfg.gpu_ids!r} picks GPUs of this machine, but cluster={cfg.cluster!r} "
            "runs the ranks on the cluster's nodes, where Ray lends each node's GPUs to its "
            "ranks. Fix: leave gpu_ids unset; choose a node's GPUs where it is started "
            "(`CUDA_VISIBLE_DEVICES=0,1 ray start ... --num-gpus=2`)."
        )


def cuda_fork_error(state: cudafork.CudaForkState | None = None) -> CUDAInitializedError:
    """The error for start_method='fork' where a fork would break CUDA in the workers."""
    state = state or cudafork.CudaForkState(context=True)
    return CUDAInitializedError(
        f"{state.what()}, so start_method='fork' cannot be used: every forked worker would "
        "fail at its first CUDA call (torch: 'Cannot re-initialize CUDA in forked "
        f"subprocess').\n{cudatrace.describe_cause(state)}\nFix it in one of two ways:\n"
        "  1. pass start_method='spawn' (or 'auto'), which starts fresh worker processes and "
        "ships your function with dill, no restart needed;\n"
        "  2. restart the kernel and do not touch CUDA (.cuda(), .to('cuda'), "
        "torch.cuda.is_available(), `import torchao`...) before calling notebook_launcher; "
        "create the model and move it to the GPU inside the training function (set "
        "PYTORCH_NVML_BASED_CUDA_CHECK=1 to make torch.cuda.is_available() safe)."
    )


_SAID_WHY_SPAWN = [False]  # "auto" says once per kernel why it spawns


def _say_why_spawn(state: cudafork.CudaForkState) -> None:
    if _SAID_WHY_SPAWN[0]:
        return
    _SAID_WHY_SPAWN[0] = True
    warnings.warn(
        f"nbaccel starts the workers with spawn, not fork: {state.what()}, and forked "
        f"workers would fail at their first CUDA call.\n{cudatrace.describe_cause(state)}\n"
        "Spawned workers start a fresh interpreter (a few seconds each launch); a warm pool "
        "(nbaccel.start_workers) pays that once. (Said once per kernel.)",
        RuntimeWarning,
        stacklevel=5,
    )


def check_platform(requested: str) -> None:
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


def choose_start_method(requested: str) -> str:
    # asks torch's flag and the driver itself (cuInit called by anyone), never CUDA
    state = cudafork.fork_state()
    if requested == "fork":
        if not hasattr(os, "fork"):
            raise ConfigError("start_method='fork' is not available on this platform; use 'spawn'.")
        if state.broken:
            if _forkserver.usable():  # forked all the same, from the kernel's clean copy
                return "forkserver"
            raise cuda_fork_error(state)
        if why := forksafe.fork_breaks_this_process():
            if _forkserver.usable():  # the server forks, not the kernel
                return "forkserver"
            raise ConfigError(
                f"start_method='fork' cannot be used here: {why}. Fix: pass "
                "start_method='auto' (or 'spawn'), which starts fresh worker processes, or "
                "launch before ray.init()."
            )
        return "fork"
    if requested == "spawn":
        return "spawn"
    if state.broken:
        if _forkserver.usable():
            return "forkserver"
        _forkserver.say_why_not()
        _say_why_spawn(state)
        return "spawn"
    if environment.fork_preferred() and (why := forksafe.fork_breaks_this_process()):
        if _forkserver.usable():
            return "forkserver"
        _say_once(f"nbaccel: workers are spawned, not forked: {why}.")
        return "spawn"
    return "fork" if environment.fork_preferred() else "spawn"


_SAID: set[str] = set()


def _say_once(line: str) -> None:
    """``line`` in the cell, once per kernel (a launch's choice made for it, not an error)."""
    if line not in _SAID:
        _SAID.add(line)
        sys.stderr.write(line + "\n")


def fork_safe_threads(threads: int | None) -> int | None:
    """1 compute thread per forked worker where the kernel's OpenMP pool cannot be released."""
    inherited = os.environ.get("OMP_NUM_THREADS", "").strip()  # threads=None: the user's
    if (threads if threads is not None else inherited) in (1, "1"):
        return threads  # single-threaded workers never touch the pool
    if not (stuck := forksafe.unreleasable_openmp_runtimes()):
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


def worker_threads(nproc: int) -> int:
    """Compute threads per worker: ``OMP_NUM_THREADS`` when set, else cores / processes
    (left to torch, two workers on two cores run about 5x slower)."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    return max(1, environment.cpu_count() // nproc)


@dataclass
class LaunchPlan:
    """The validated, resolved decisions of one launch: the configuration every worker
    receives, and the call's own start and call options as the user gave them."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    config: LaunchConfig
    num_processes: int | None  # per node
    method: str  # "fork", "spawn", "forkserver" or "kernel" (run in this process)
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

    @property
    def ranks(self) -> list[int]:
        """The global ranks of this node's workers (on a cluster: every rank, all placed
        from here)."""
        nproc = self.num_processes or 1
        if self.config.cluster is not None:
            return list(range(self.world_size))
        return [self.config.node_rank * nproc + i for i in range(nproc)]


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
    if cfg.compute_device == "gpu" and environment.gpu_count() == 0:
        raise ConfigError("compute_device='gpu' but no CUDA GPU is visible; use 'cpu' or 'auto'.")
    # one rule for "one process per usable GPU", shared with the CLI and the panel
    return hardware.default_num_processes(cfg.compute_device, cfg.gpu_ids)


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
    stores.check_args(args)  # an s3:// argument this environment cannot reach: refused now
    take_fork_server()  # nbaccel's first use, while CUDA may still be untouched
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


def _check_deepspeed(cfg: LaunchConfig, args: tuple[Any, ...]) -> None:
    """DeepSpeed asked for (strategy, or a plugin among the arguments) but not installed:
    one error naming the install command, in the kernel, before any worker starts."""
    from ...runtime.strategy.deepspeed.deepspeed_plugin import DeepSpeedPlugin, require_deepspeed

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
        nproc, in_kernel = tpu_processes(cfg), False
        check_platform(cfg.start_method)
    else:
        _check_deepspeed(cfg, args)
        if cfg.cluster is not None:
            check_cluster_installed(cfg.cluster)  # before anything starts
            keep_print_plain()  # before the function is copied with dill
        # a cluster's nodes are not this machine: one rank per node unless told otherwise
        nproc = (cfg.num_processes or 1) if cfg.cluster is not None else _count_processes(cfg)
        in_kernel = nproc == 1 and cfg.num_nodes == 1 and plan.call.block and not cfg.cluster
        if not in_kernel:
            check_platform(cfg.start_method)  # the OS first: nothing else would help there
        if cfg.cluster is not None:  # the nodes' GPUs decide, read on each (_cluster_nodes)
            check_cluster_gpu_ids(cfg)
        else:
            check_gpus_per_process(cfg, nproc)
        if cfg.cluster is None and (
            cfg.mixed_precision == "fp8" or not gpufacts.gpu_facts().capabilities
        ):
            hardware.check_gpu_precision(cfg.mixed_precision, cfg.compute_device)  # by name
        if cfg.strategy == "fsdp" and nproc * cfg.num_nodes < 2:
            raise ConfigError(
                "strategy='fsdp' shards the model across processes, but this launch starts "
                "one: pass num_processes >= 2 (CPU processes work too), or use strategy='ddp'."
            )
        _check_parallelism(cfg, nproc)
        if (nproc > 1 or cfg.num_nodes > 1) and not kernel_state_ok:  # workers drop it anyway
            check_no_state_in_kernel()
        # a cluster's threads are each node's (its cores / its ranks, or cpus_per_rank)
        threads = None if in_kernel or cfg.cluster is not None else worker_threads(nproc)
    if in_kernel:
        method = "kernel"
    elif cfg.cluster is not None:  # a fresh interpreter on each node, the spec its first frame
        method = "spawn"
    else:  # the kernel starts the workers: fork or spawn is its choice, said where it matters
        method = choose_start_method(cfg.start_method)
    if method == "fork" and not on_tpu:
        threads = fork_safe_threads(threads)
    payload = None
    if method in ("spawn", "forkserver"):
        payload = dill_for_workers(
            (plan.function, args, {}),
            "the function, its args and the globals it uses (start_method='spawn')",
            "inside the function, or pass them through args as plain data",
        )
    env = process_env(cfg, threads)
    local = cfg.cluster is None  # else decided per node from its own facts (_cluster_nodes)
    if not on_tpu and local:  # bf16 on a T4, a broken P2P path, a small /dev/shm: one line each
        env.update(_freegpus.for_launch(cfg, nproc, plan.function, os.environ).env)
    if not (in_kernel or on_tpu) and local:
        env.update(_accelerate_env(cfg))
    return dataclasses.replace(plan, num_processes=nproc, method=method, env=env,
                               threads=threads, payload=payload, tpu=on_tpu)  # fmt: skip


def _check_parallelism(cfg: LaunchConfig, nproc: int) -> None:
    """The ``parallelism_config_*`` sizes against every node's processes, before any starts."""
    from ...runtime.parallel.from_launch import check_launch

    check_launch(cfg, num_processes=nproc * cfg.num_nodes)


def plan_script(cfg: LaunchConfig) -> LaunchPlan:
    """A script's launch (``nbaccel launch``): worker processes also for one, each a fresh
    interpreter (as ``python script.py``) unless ``start_method="fork"``; on a TPU one
    process (torch_xla's runtime starts one per chip from it). Output is not prefixed."""
    on_tpu = cfg.compute_device == "tpu"
    nproc = 1 if on_tpu else _count_processes(cfg)
    if cfg.cluster is not None:  # the nodes' processes, not this machine's devices
        check_cluster_installed(cfg.cluster)
        check_cluster_gpu_ids(cfg)
        nproc = cfg.num_processes or 1
    check_platform(cfg.start_method)
    if cfg.cluster is None:
        check_gpus_per_process(cfg, nproc)
    if not on_tpu:
        _check_parallelism(cfg, nproc)
    if cfg.cluster is not None:  # threads, devices, GPUs: decided per node, from its facts
        env = process_env(cfg, None)
        return LaunchPlan(print, (), cfg, nproc, "spawn", env, None,
                          start=StartOptions(log_line_prefix_template=""))  # fmt: skip
    threads = worker_threads(nproc)
    env = process_env(cfg, threads) | _accelerate_env(cfg)
    if on_tpu:
        env["PJRT_DEVICE"] = os.environ.get("PJRT_DEVICE", "TPU")
    method = "fork" if cfg.start_method == "fork" and cfg.cluster is None else "spawn"
    return LaunchPlan(print, (), cfg, nproc, method, env, threads,
                      start=StartOptions(log_line_prefix_template=""))  # fmt: skip


__all__ = [
    "LaunchPlan",
    "check_call",
    "check_no_state_in_kernel",
    "cuda_fork_error",
    "plan_launch",
    "plan_script",
    "process_env",
    "worker_threads",
]
