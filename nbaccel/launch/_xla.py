"""Launching on XLA devices through torch_xla's own ``xmp.spawn``.

:func:`launch_xla` refuses to run when the XLA runtime was already initialised in
the kernel (``xmp.spawn`` cannot start workers then). Worker results and failures
travel through files in a temporary directory.

Example:
    >>> def train():                       # doctest: +SKIP
    ...     accelerator = Accelerator()    # device xla:0, DistributedType.XLA
    ...     ...
    >>> launch_xla(train, (), 1, {})       # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..config import LaunchConfig, install_launch_config
from ..errors import LaunchError
from ..platform.process_env import EnvironmentSnapshot, install_process_facts
from ..platform.xla import runtime_initialized, xla_available
from ..runtime.xla import xla_world
from ._environ import installed, patched_environ

# Functions and arguments handed to forked workers through memory instead of pickle
# (a notebook's function, its closures and a model passed in args all just work).
_REGISTRY: dict[int, tuple[Callable[..., Any], tuple[Any, ...]]] = {}
_TOKENS = itertools.count()


class _Worker:
    """What ``xmp.spawn`` runs on every rank: set up, call the function, store the result.

    Picklable: with ``fork`` only a registry token travels; with ``spawn`` the
    function and arguments themselves (they must be importable/picklable then).
    """

    def __init__(
        self,
        token: int,
        results_dir: str | None,
        payload: tuple[Callable[..., Any], tuple[Any, ...]] | None = None,
        config: LaunchConfig | None = None,
    ) -> None:
        self.token = token
        self.results_dir = results_dir
        self.payload = payload
        self.config = config

    def __call__(self, index: int, *_spawn_args: Any) -> None:
        function, args = self.payload or _REGISTRY[self.token]
        from ..runtime.state import reset_state

        reset_state()  # a forked child must not inherit the kernel's cached state
        world = xla_world() if self.results_dir is not None else None
        rank = world.rank if world is not None else 0
        if world is not None:  # a worker: the launch's typed state is its own
            cfg = self.config or LaunchConfig()
            install_launch_config(cfg)
            install_process_facts(_facts(cfg, world))
        try:
            value = function(*args)
        except BaseException as exc:
            if self.results_dir is not None:
                _write(Path(self.results_dir, f"failure-{rank}"), _failure_info(exc))
            raise
        if self.results_dir is not None:
            _write(Path(self.results_dir, f"result-{rank}"), value)
        else:
            _INPROCESS_RESULT[self.token] = value


_INPROCESS_RESULT: dict[int, Any] = {}


def _facts(cfg: LaunchConfig, world: Any = None) -> EnvironmentSnapshot:
    """Rank facts of an XLA worker (``world``: torch_xla's view), or of one process."""
    if world is None:
        return EnvironmentSnapshot(
            use_cpu=cfg.compute_device == "cpu", timeout=cfg.timeout, debug=cfg.debug
        )
    return EnvironmentSnapshot(
        rank=world.rank,
        world_size=world.world_size,
        local_rank=world.local_rank,
        local_world_size=world.local_world_size,
        node_rank=world.node_rank,
        use_cpu=cfg.compute_device == "cpu",
        timeout=cfg.timeout,
        debug=cfg.debug,
    )


def _failure_info(exc: BaseException) -> dict[str, Any]:
    from ._worker import error_info

    info = error_info(exc, skip=(__file__,))  # the traceback starts in the user's code
    info["pid"] = os.getpid()
    return info


def _write(path: Path, value: Any) -> None:
    from ._wire import dumps

    codec, data = dumps(value)  # tensors on the XLA device arrive on the CPU
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(codec.encode() + b"\n" + data)
    tmp.replace(path)


def _read(path: Path) -> Any:
    from ._wire import loads

    codec, _, data = path.read_bytes().partition(b"\n")
    return loads(codec.decode(), data)


def _to_cpu(value: Any) -> Any:
    """A copy of ``value`` with every tensor on the CPU (the value itself if unpicklable)."""
    from ._wire import dumps, loads

    try:
        return loads(*dumps(value))
    except Exception:
        return value


def _raise_first_failure(results_dir: Path, cause: BaseException) -> None:
    from ._failures import Failure, pick_failure, remote_exception

    failures = []
    for path in results_dir.glob("failure-*"):
        info = _read(path)
        rank = int(path.name.split("-")[1])
        failures.append(Failure(rank, info.get("pid"), info.get("time", 0.0), "exception", info))
    if not failures:
        raise LaunchError(
            f"the torch_xla workers failed before running the function: "
            f"{type(cause).__name__}: {cause}"
        ) from cause
    raise remote_exception(pick_failure(failures)) from None


def launch_xla(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    config: LaunchConfig | None = None,
    *,
    start_method: str = "fork",
) -> list[Any]:
    """Run ``function(*args)`` on XLA devices through ``torch_xla``'s ``xmp.spawn``.

    With ``num_processes=1`` the function runs in this process on one device (as
    ``xmp.spawn(nprocs=1)`` does); otherwise torch_xla starts one worker per local
    device (it decides how many: ``None`` or the device count).

    Args:
        function: the training function; with ``fork`` (default) it may be defined in
            a notebook cell and ``args`` need not be picklable.
        args: its positional arguments.
        num_processes: 1, or ``None`` for every local device.
        config: the launch configuration the workers' ``Accelerator()`` uses.
        start_method: "fork" (notebooks; the default) or "spawn".

    Returns:
        Every rank's return value, by rank, with tensors moved to the CPU.

    Raises:
        LaunchError: torch_xla is missing, or the XLA runtime was already started in
            this process and more than one worker was asked for.
        WorkerError: a worker raised (also an instance of the original exception type
            when it can be re-created); the message names the rank and carries the
            remote traceback. With ``num_processes=1`` the exception propagates as is.
    """
    if not xla_available():
        raise LaunchError(
            "TPU/XLA launch requested (PJRT_DEVICE or a TPU host) but torch_xla is not "
            "installed: pip install torch_xla matching your torch version, or unset "
            "PJRT_DEVICE / pass compute_device='cpu'."
        )
    if start_method not in ("fork", "spawn"):
        raise ValueError(f"start_method={start_method!r}: use 'fork' or 'spawn' on XLA.")
    nprocs = 1 if num_processes == 1 else None
    if nprocs is None and runtime_initialized():
        raise LaunchError(
            "the XLA runtime is already initialised in this process (an XLA device or "
            "tensor was used before launching), so torch_xla cannot start workers. "
            "Restart the kernel and launch before touching the XLA device, or pass "
            "num_processes=1 to train in this process."
        )
    import torch_xla.distributed.xla_multiprocessing as xmp

    token = next(_TOKENS)
    _REGISTRY[token] = (function, tuple(args))
    try:
        if nprocs == 1:
            return [_run_here(xmp, token, config or LaunchConfig())]
        return _run_workers(xmp, token, config, start_method, num_processes)
    finally:
        _REGISTRY.pop(token, None)
        _INPROCESS_RESULT.pop(token, None)


def _run_here(xmp: Any, token: int, config: LaunchConfig) -> Any:
    from ..runtime import state

    had_state = state.current_state() is not None
    try:
        # torch_xla sets PJRT_LOCAL_PROCESS_* here: the environment is restored afterwards
        with patched_environ({}), installed(config, _facts(config)):
            xmp.spawn(_Worker(token, None), args=(), nprocs=1)
    finally:
        if not had_state:
            state.reset_state()  # leave the kernel as found: no Accelerator state behind
    return _to_cpu(_INPROCESS_RESULT.get(token))


def _run_workers(
    xmp: Any, token: int, config: LaunchConfig | None, start_method: str, requested: int | None
) -> list[Any]:
    payload = _REGISTRY[token] if start_method == "spawn" else None
    with tempfile.TemporaryDirectory(prefix="nbaccel-xla-") as tmp:
        try:
            with patched_environ({}):
                worker = _Worker(token, tmp, payload, config)
                xmp.spawn(worker, args=(), nprocs=None, start_method=start_method)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            _raise_first_failure(Path(tmp), exc)
        paths = sorted(Path(tmp).glob("result-*"), key=lambda p: int(p.name.split("-")[1]))
        results = [_read(p) for p in paths]
    if requested is not None and len(results) != requested:
        warnings.warn(
            f"num_processes={requested} but torch_xla ran {len(results)} workers (one per "
            "local device). Limit the devices with the TPU_NUM_DEVICES / CPU_NUM_DEVICES "
            "environment variables.",
            stacklevel=3,
        )
    return results


__all__ = ["launch_xla"]
