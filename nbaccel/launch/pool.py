"""Warm workers: ``start_workers`` keeps one process per device alive across cells.

The same engine as ``notebook_launcher`` (start, supervisor, channel, worker loop), with
workers that wait for the next job: no new processes, rendezvous, process group or
``Accelerator`` state per call. Functions travel with dill on every call (a function
edited in the notebook runs in its new form). Each worker has one namespace, shared by
``push``, ``pull`` and ``%%distributed`` cells. An error is raised with its type, rank
and remote traceback and the pool stays; the interrupt button interrupts the call on
every rank; a rank that died, hung or did not come back, or ranks whose collectives fell
out of step, make the pool replace its workers and say so. ``close()``, a ``with`` block's
end and the kernel's exit end every worker and its children.

Example:
    >>> with start_workers(num_processes=2) as pool:  # doctest: +SKIP
    ...     pool.call(train, (0.5,), return_all_ranks=True)
    ...     pool.push(steps=3)
    ...     pool.pull("steps", rank=None)
    [0.0, 0.5]
    [3, 3]
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..config.choices import OnHangType
from ..config.keywords import PoolKeywords, documented, split
from ..config.options import CALL, CallOptions, OutputTarget, check_settings
from ..errors import LaunchError
from . import _kept, _lifetimes
from ._jobs import check_syntax, dill_for_workers
from ._pool import PoolWorkers
from ._preflight import check_call, plan_launch
from ._tidy import warn_oversubscribed

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's
    from typing_extensions import Unpack

_LIVE: weakref.WeakSet[WorkerPool] = weakref.WeakSet()
# The pools %%distributed may use, newest last. Weak: a pool the notebook no longer
# references is garbage-collected, and closed, like any object (see __del__).
_current: list[weakref.ref[WorkerPool]] = []


def _close_live_pools() -> None:
    for pool in list(_LIVE):
        with contextlib.suppress(Exception):
            pool.close(timeout=5)


def current_pool() -> WorkerPool | None:
    """The most recently started pool that is still open (``%%distributed`` uses it)."""
    while _current:
        pool = _current[-1]()
        if pool is not None and not pool.closed:
            return pool
        _current.pop()
    return None


class WorkerPool(PoolWorkers):
    """Warm workers, one per device; create with :func:`start_workers`.

    Attributes:
        ranks: the global ranks of this machine's workers.
        restarts: how often the workers were replaced (by :meth:`restart` or after a failure).
    """

    # ------------------------------------------------------------------ calls
    def run(self, function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` on every rank; rank 0's value (on another node:
        its first rank's). Every argument is the function's; :meth:`call` has options.

        Raises:
            TypeError: ``function`` is not callable or cannot be pickled.
            WorkerError: a rank failed (also an instance of the remote type).
            WorkerTimeoutError: ranks hung (the pool restarted).
            KeyboardInterrupt: the kernel was interrupted (every rank was interrupted).

        Example:
            >>> pool.run(lambda x: x + 1, 41)  # doctest: +SKIP
            42
        """
        __tracebackhide__ = True
        return self.call(function, args, kwargs)

    @documented()
    def call(
        self,
        function: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        return_all_ranks: bool = CALL.return_all_ranks,
        block: bool = CALL.block,
        output: OutputTarget | None = CALL.output,
        hang_after: float | None = None,
        on_hang: OnHangType | None = None,
    ) -> Any:
        """:meth:`run` with options (as ``notebook_launcher``'s; a setting left at ``None``
        is the pool's, from ``start_workers``).

        Args:
            function: any function, also one defined or edited after the pool started.
            args, kwargs: its arguments (a tuple, a dict).
            {options}

        Example:
            >>> pool.call(train, (3e-4,), return_all_ranks=True)  # doctest: +SKIP
            [0.91, 0.91]
        """
        check_call(function, args, "pool.run(train, lr)")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs={kwargs!r} must be a dict of keyword arguments.")
        call = CallOptions(return_all_ranks=return_all_ranks, block=block, output=output)
        check_settings(dict(hang_after=hang_after, on_hang=on_hang))  # then as the pool's
        payload = dill_for_workers(
            (function, tuple(args), dict(kwargs or {})), "the function and its args"
        )
        __tracebackhide__ = True  # IPython shows the user's cell, then the error
        name = getattr(function, "__name__", type(function).__name__)
        return self._submit("run", (payload,), None, call.return_all_ranks, call.block,
                            call.output, hang=self._hang_policy(hang_after, on_hang),
                            label=f"pool.call({name})")  # fmt: skip

    def exec_cell(
        self,
        source: str,
        ranks: list[int] | None = None,
        output: Any = None,
        names: Mapping[str, Any] | None = None,
    ) -> Any:
        """What ``%%distributed`` does: ``source`` on ``ranks`` (default all) in each
        worker's namespace; rank 0's last expression. ``names``: the kernel's values of
        names the cell uses (copied as ``run`` copies a function's globals)."""
        if not isinstance(source, str):
            raise TypeError(f"source must be a str, got {type(source).__name__}.")
        check_syntax(source)  # a syntax error is reported here, before any rank runs
        targets = self._ranks(ranks)
        try:
            shipped = dill_for_workers(dict(names or {}), "the kernel's names the cell uses")
        except TypeError:
            for name, value in (names or {}).items():  # say which one
                dill_for_workers(
                    value, f"{name!r} (a {type(value).__name__}), which the cell uses,"
                )
            raise
        body = (source, f"<distributed-cell-{next(self._cells)}>", shipped, self._new_sources())
        return self._submit("exec", body, targets, False, True, output, want=targets[:1])

    def push(self, **names: Any) -> None:
        """Set ``names`` in every worker's namespace (copied with dill): ``pool.push(lr=1e-3)``."""
        if not names:
            raise TypeError("pool.push needs names to set, e.g. pool.push(lr=1e-3).")
        self._submit(
            "push", (dill_for_workers(names, "the pushed values"),), None, False, True, None
        )

    def pull(self, name: str, rank: int | None = 0) -> Any:
        """A name's value on ``rank`` (``None``: a list, one per rank); NameError if unset."""
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"pull needs a variable name (a str), got {name!r}.")
        targets = self._ranks(None if rank is None else [rank])
        return self._submit("pull", (name,), targets, rank is None, True, None)

    def names(self, rank: int = 0) -> list[str]:
        """The names defined in ``rank``'s namespace."""
        return list(self._submit("names", (), self._ranks([rank]), False, True, None))

    # ------------------------------------------------------------------ lifecycle
    def restart(self) -> None:
        """Replace every worker with a fresh one (names and process group are gone)."""
        self._check_open()
        if not self._busy.acquire(blocking=False):
            raise LaunchError("cannot restart while a call runs in the background; stop it first.")
        try:
            self._replace(None, graceful=True)
        finally:
            self._busy.release()

    def close(self, timeout: float = 10.0) -> None:
        """End every worker and their children (idempotent); waits at most ``timeout`` s."""
        if self.closed:
            return
        self.closed = True
        _LIVE.discard(self)
        _kept.forget(self, "the pool was closed")  # failed ranks kept for nbaccel.debug() go
        handle = self._handle
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.stop(timeout=timeout)
        got = self._busy.acquire(timeout=max(timeout, 0.1))
        try:
            self._stop_workers(timeout)
        finally:
            if got:
                self._busy.release()
        for rank in self.ranks:
            self._event(rank, "state", {"state": "terminated"})

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a pool nobody references is closed, like a file
        with contextlib.suppress(Exception):
            self.close(timeout=2)

    # ------------------------------------------------------------------ observing
    @property
    def pids(self) -> dict[int, int]:
        """Worker pids by rank."""
        group = self._group
        return {r: p.pid for r, p in group.procs.items()} if group is not None else {}

    def stacks(self, ranks: list[int] | None = None) -> dict[int, str]:
        """Where each rank of the call running now is: its Python stack, by rank."""
        handle = self._handle
        if handle is None:
            return {rank: "(idle)" for rank in (self.ranks if ranks is None else ranks)}
        return handle.stacks(ranks)

    @property
    def start_method(self) -> str:
        """How the current workers were started: "fork" or "spawn"."""
        return self._plan.method

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"pids={list(self.pids.values())}"
        return f"<WorkerPool ranks={self.ranks} {state} method={self.start_method}>"


def _idle() -> None:
    """The plan's function: a pool's workers get theirs call by call."""


@documented(PoolKeywords)  # typed as notebook_launcher's (see there), defined in config
def start_workers(num_processes: int | None = None, **options: Unpack[PoolKeywords]) -> WorkerPool:
    """Start a :class:`WorkerPool`: one warm worker per device, kept across cells.

    The options are ``notebook_launcher``'s (for several machines: run the same cells on
    each), checked the same way before anything starts; a pool's calls have their own
    ``return_all_ranks``, ``block`` and ``output`` (:meth:`WorkerPool.call`), and a failed
    rank keeps its traceback for ``nbaccel.debug()`` until the pool's next call. The
    process group forms at the first ``Accelerator()`` on the workers and lives as long
    as they do.

    Args:
        {options}

    Example:
        >>> pool = start_workers(num_processes=2)  # doctest: +SKIP

    Raises:
        TypeError, ValueError: bad arguments (nothing is started).
        CUDAInitializedError: ``start_method="fork"`` after CUDA was initialised.
        WorkerError, LaunchError: a worker could not start.
    """
    named = dict(num_processes=num_processes)
    settings, start, _ = split(named, options, PoolKeywords, "start_workers()")
    # block=False: always worker processes (never "run in the kernel"), in their own session
    plan = plan_launch(_idle, (), settings, start, CallOptions(block=False))
    warn_oversubscribed(plan.config, plan.num_processes or 1, stacklevel=2)
    pool = WorkerPool(plan)
    pool._start()
    _lifetimes.register("pool", _close_live_pools)  # workers must not outlive the kernel
    _LIVE.add(pool)
    _current.append(weakref.ref(pool))
    return pool


__all__ = ["WorkerPool", "current_pool", "start_workers"]
