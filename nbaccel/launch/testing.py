"""Helpers shared by the test suite and ``nbaccel test``.

``run_on_workers`` forks N real CPU processes that rendezvous over gloo on
loopback, runs a function in each, and returns every rank's result. It is
deliberately independent of :mod:`nbaccel.launcher` so the runtime can be tested
on its own.

Example:
    >>> from nbaccel.launch.testing import run_on_workers
    >>> def rank_squared():
    ...     import os
    ...     return int(os.environ["RANK"]) ** 2
    >>> run_on_workers(rank_squared, num_processes=2)  # doctest: +SKIP
    [0, 1]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import LaunchError, WorkerError
from ..platform import torchcompat
from ..platform.forksafe import release_openmp_threads


def find_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now.

    Example:
        >>> 1024 <= find_free_port() <= 65535
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _worker(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    env: dict[str, str],
    results: Any,
) -> None:
    os.environ.update(env)
    torch = sys.modules.get("torch")
    if torch is not None:
        # OMP_NUM_THREADS is read once, at torch's import, so the child sizes its pool
        # explicitly (the parent released its own pool before forking: see _forksafe).
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    try:
        value = fn(*args)
        payload = pickle.dumps((rank, True, value))
    except BaseException as exc:  # ship every failure, KeyboardInterrupt included
        payload = pickle.dumps(
            (rank, False, (type(exc).__qualname__, str(exc), traceback.format_exc()))
        )
    finally:
        torchcompat.destroy_process_group()
    # plain pickle bytes: avoids torch's shared-memory reducers outliving the worker
    results.put(payload)


def run_on_workers(
    fn: Callable[..., Any],
    num_processes: int = 2,
    args: tuple[Any, ...] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> list[Any]:
    """Fork ``num_processes`` CPU workers, run ``fn(*args)`` in each, return results by rank.

    Each worker gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT`` and ``OMP_NUM_THREADS=1``
    (plus ``env``). The first failing rank is re-raised as :class:`WorkerError`;
    every worker is terminated and joined before this returns or raises.

    Args:
        fn: a picklable-by-reference function (module level) or any callable (fork).
        num_processes: how many workers.
        args: positional arguments for ``fn``.
        env: extra environment variables for every worker.
        timeout: seconds to wait for all results before killing the workers.

    Returns:
        ``[result_of_rank_0, result_of_rank_1, ...]``.
    """
    ctx = mp.get_context("fork")
    release_openmp_threads()  # else children hang in their first multi-threaded op
    results = ctx.Queue()
    port = find_free_port()
    procs = []
    for rank in range(num_processes):
        worker_env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(num_processes),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(num_processes),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            **dict(env or {}),
        }
        proc = ctx.Process(target=_worker, args=(fn, args, rank, worker_env, results))
        proc.start()
        procs.append(proc)
    collected: dict[int, Any] = {}
    failure: WorkerError | None = None
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < num_processes and failure is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LaunchError(
                    f"run_on_workers: no result from ranks "
                    f"{sorted(set(range(num_processes)) - set(collected))} after {timeout}s"
                )
            try:
                rank, ok, value = pickle.loads(results.get(timeout=min(remaining, 0.5)))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in collected and p.exitcode not in (None, 0)
                ]
                if dead:
                    r = dead[0]
                    raise WorkerError(
                        r, procs[r].pid, "ProcessDied", f"exit code {procs[r].exitcode}"
                    ) from None
                continue
            if ok:
                collected[rank] = value
            else:
                exc_type, message, tb = value
                failure = WorkerError(rank, procs[rank].pid, exc_type, message, tb)
        if failure is not None:
            raise failure
        return [collected[r] for r in range(num_processes)]
    finally:
        for proc in procs:
            proc.join(timeout=5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
        results.join_thread()


__all__ = ["find_free_port", "run_on_workers"]
