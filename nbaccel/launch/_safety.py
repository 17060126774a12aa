"""Whether, and how, workers may start from this process: checks made before any exists.

A live ``Accelerator`` or process group, more NCCL processes than GPUs, no fork or POSIX
process control, CUDA initialised before a fork (the error names the line): each refused
with what to do. ``"auto"`` forks only when safe; where torch 2.4's libgomp pool cannot be
released before forking, forked workers keep one compute thread.

Example:
    >>> from nbaccel.launch._safety import worker_threads
    >>> worker_threads(2) >= 1
    True
"""

from __future__ import annotations

import os
import sys
import warnings

from ..config import LaunchConfig
from ..errors import ConfigError, CUDAInitializedError, LaunchError, too_few_gpus_error
from ..platform import cudafork, cudatrace, environment, forksafe


def check_no_state_in_kernel() -> None:
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
            raise cuda_fork_error(state)
        return "fork"
    if requested == "spawn":
        return "spawn"
    if state.broken:
        _say_why_spawn(state)
        return "spawn"
    return "fork" if environment.fork_preferred() else "spawn"


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


__all__ = [
    "check_gpus_per_process",
    "check_no_state_in_kernel",
    "check_platform",
    "choose_start_method",
    "cuda_fork_error",
    "fork_safe_threads",
    "worker_threads",
]
