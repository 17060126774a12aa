"""Whether, and how, workers may start from this process: checks made before any exists.

A kernel in which an ``Accelerator`` or a process group already lives, more NCCL
processes than GPUs, an operating system without fork or POSIX process control, CUDA
initialised before a fork (the error names the line that did it): each is refused with
what to do instead. ``"auto"`` forks only when that is safe and spawns otherwise; where
the kernel's OpenMP pool cannot be released before forking (torch 2.4's libgomp), forked
workers keep one compute thread.

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
from ..platform import cudatrace, environment, forksafe


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
        else "Where it was first initialised is unknown: it is recorded from the first launch "
        "or `%load_ext nbaccel` on (run either before touching CUDA to have it named here)."
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


def fork_safe_threads(threads: int | None) -> int | None:
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
