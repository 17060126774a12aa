"""Helpers for the test suite: run a function on real workers through the launcher users get.

``run_on_workers`` is ``notebook_launcher``'s engine (the same start, supervisor, channel
and worker loop) with the settings tests want: CPU processes over gloo on loopback, one
compute thread each, always worker processes (also for one), every rank's value back.

Example:
    >>> from nbaccel.launch.testing import run_on_workers
    >>> def rank_squared():
    ...     import os
    ...     return int(os.environ["RANK"]) ** 2
    >>> run_on_workers(rank_squared, num_processes=2)  # doctest: +SKIP
    [0, 1]
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..config import resolve_launch_config
from ..config.keywords import LaunchKeywords, split
from ..config.options import CallOptions, StartOptions
from ..errors import LaunchError

if TYPE_CHECKING:
    from .start._preflight import LaunchPlan


def find_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now.

    Example:
        >>> 1024 <= find_free_port() <= 65535
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def run_on_workers(
    fn: Callable[..., Any],
    num_processes: int = 2,
    args: tuple[Any, ...] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 600.0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``num_processes`` CPU workers; return every rank's value.

    ``env`` is the environment of the launch (``NBACCEL_*`` settings are read from it as
    from a kernel's, and the workers inherit it); ``OMP_NUM_THREADS`` defaults to 1. The
    first real failure is raised as the launcher raises it (a ``WorkerError`` that is also
    the remote type); after ``timeout`` seconds the workers are stopped and a
    ``LaunchError`` says so. The default is a hang guard, not a speed bound: the suite runs
    on machines of every speed and load (a real hang still ends there).
    """
    from .launcher import launch, patched_environ
    from .start._preflight import plan_launch

    values = {"OMP_NUM_THREADS": "1", **dict(env or {})}
    with patched_environ(values):
        plan = plan_launch(
            fn,
            tuple(args),
            {"num_processes": num_processes},
            StartOptions(config=resolve_launch_config({"compute_device": "cpu"})),
            # worker processes also for one (block=True would use this process)
            CallOptions(return_all_ranks=True, block=False),
            kernel_state_ok=True,  # a test's own Accelerator here: the workers drop it
        )
        handle = launch(plan)
    try:
        return list(handle.result(timeout=timeout))
    except TimeoutError:
        handle.stop()
        raise LaunchError(f"run_on_workers: no result from every rank after {timeout}s") from None


def plan_for(function: Callable[..., Any], args: Any = (), **options: Any) -> LaunchPlan:
    """What ``notebook_launcher(function, args, **options)`` decides, nothing started.

    Example:
        >>> plan_for(print, num_processes=2, start_method="fork").method  # doctest: +SKIP
        'fork'
    """
    from .start._preflight import plan_launch

    return plan_launch(function, args, *split(options, {}, LaunchKeywords, "plan_for()"))


__all__ = ["find_free_port", "plan_for", "run_on_workers"]
