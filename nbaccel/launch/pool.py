"""Warm workers: a pool of processes that lives across notebook cells.

``start_workers`` starts one process per device once, with the same options and
checks as ``notebook_launcher``; afterwards every call reuses them: no new
processes, rendezvous, process group or ``Accelerator`` state. Functions are
shipped with dill on every call, so a function edited in the notebook after the
pool started runs in its new form. Each worker has one namespace, shared by
:meth:`WorkerPool.push`, :meth:`WorkerPool.pull` and ``%%distributed`` cells
(``%load_ext nbaccel``).

Failures keep the launcher's guarantees: the first real error is raised with its
type, rank and remote traceback and the pool stays usable; the interrupt button
interrupts the call on every rank (``KeyboardInterrupt`` there) and the pool
stays; a rank that died, hung, or did not come back from an interrupt, or ranks
whose collectives fell out of step, make the pool restart its workers and say so.
``close()``, the end of a ``with`` block and the kernel's exit end every worker and
their children.

Example:
    >>> from nbaccel import start_workers  # doctest: +SKIP
    >>> def train(lr):
    ...     from nbaccel import Accelerator
    ...     accelerator = Accelerator()
    ...     return accelerator.process_index * lr
    >>> with start_workers(num_processes=2) as pool:  # doctest: +SKIP
    ...     pool.run(train, 0.5, return_all_ranks=True)
    ...     pool.push(steps=3)
    ...     pool.pull("steps", rank=None)
    [0.0, 0.5]
    [3, 3]
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import sys
import weakref
from collections.abc import Callable
from typing import Any

from ..config import LaunchConfig
from ..errors import LaunchError, WorkerError
from ._pool_engine import CallDriver, PoolEngine
from ._preflight import plan_launch
from ._supervise import Stopped
from .handle import LaunchHandle

_LIVE: weakref.WeakSet[WorkerPool] = weakref.WeakSet()
# The pools %%distributed may use, newest last. Weak: a pool the notebook no longer
# references is garbage-collected, and closed, like any object (see __del__).
_current: list[weakref.ref[WorkerPool]] = []
_atexit_registered = [False]


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


class WorkerPool:
    """Warm workers, one per device; create with :func:`start_workers`.

    Attributes:
        ranks: the global ranks of this machine's workers.
        restarts: how often the workers were replaced (by :meth:`restart` or after a failure).
    """

    def __init__(self, engine: PoolEngine) -> None:
        self._engine = engine
        self.ranks: list[int] = list(engine.ranks)
        self.closed = False

    # ------------------------------------------------------------------ calls
    def run(
        self,
        function: Callable[..., Any],
        *args: Any,
        return_all_ranks: bool = False,
        block: bool = True,
        output: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Call ``function(*args, **kwargs)`` on every rank; return rank 0's value.

        Args:
            function: any function, also one defined or edited in the notebook after
                the pool started (shipped with dill, as for ``start_method="spawn"``).
            *args, **kwargs: its arguments.
            return_all_ranks: return ``[rank0_value, rank1_value, ...]`` (this node's ranks).
            block: ``False`` returns a :class:`~nbaccel.LaunchHandle` at once.
            output: where the workers' lines go, as for ``notebook_launcher``.

        Returns:
            Rank 0's value (on another node: its first rank's), the list, or a handle.

        Raises:
            TypeError: ``function`` is not callable or cannot be pickled.
            WorkerError: a rank failed (also an instance of the remote type).
            WorkerTimeoutError: ranks hung (the pool restarted).
            KeyboardInterrupt: the kernel was interrupted (every rank was interrupted).

        Example:
            >>> pool.run(lambda x: x + 1, 41)  # doctest: +SKIP
            42
        """
        if not callable(function):
            raise TypeError(
                f"pool.run needs a function, got {function!r} (a {type(function).__name__}): "
                "pass the function itself, e.g. pool.run(train, lr) instead of pool.run(train(lr))."
            )
        payload = _dill((function, args, kwargs), "the function and its arguments")
        return self._submit(("run", payload), None, return_all_ranks, block, output)

    def exec_cell(self, source: str, ranks: list[int] | None = None, output: Any = None) -> Any:
        """Run notebook cell source on ``ranks`` (default: all); rank 0's last expression.

        This is what ``%%distributed`` does. Names the cell sets stay in each worker's
        namespace.
        """
        if not isinstance(source, str):
            raise TypeError(f"source must be a str, got {type(source).__name__}.")
        _check_syntax(source)  # a syntax error is reported here, before any rank runs
        targets = self._ranks(ranks)
        job = ("exec", source, self._engine.next_cell_name())
        return self._submit(job, targets, False, True, output, want=targets[:1])

    def push(self, **names: Any) -> None:
        """Set ``names`` in every worker's namespace (values are copied with dill).

        Example:
            >>> pool.push(lr=1e-3, data=torch.ones(4))  # doctest: +SKIP
        """
        if not names:
            raise TypeError("pool.push needs names to set, e.g. pool.push(lr=1e-3).")
        self._submit(("push", _dill(names, "the pushed values")), None, False, True, None)

    def pull(self, name: str, rank: int | None = 0) -> Any:
        """A name's value from ``rank``'s namespace; ``rank=None``: a list, one per rank.

        Raises:
            NameError (a WorkerError): the name does not exist on that rank.
        """
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"pull needs a variable name (a str), got {name!r}.")
        targets = self._ranks(None if rank is None else [rank])
        return self._submit(("pull", name), targets, rank is None, True, None)

    def names(self, rank: int = 0) -> list[str]:
        """The names defined in ``rank``'s namespace."""
        return list(self._submit(("names",), self._ranks([rank]), False, True, None))

    # ------------------------------------------------------------------ lifecycle
    def restart(self) -> None:
        """Replace every worker with a fresh one (names and process group are gone)."""
        self._check_open()
        with self._engine.exclusive("restart"):
            self._engine.replace(None, graceful=True)

    def close(self, timeout: float = 10.0) -> None:
        """End every worker and their children (idempotent); waits at most ``timeout`` s."""
        if self.closed:
            return
        self.closed = True
        _LIVE.discard(self)
        self._engine.shutdown(timeout)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self.closed:
                self.close(timeout=2)

    # ------------------------------------------------------------------ observing
    @property
    def pids(self) -> dict[int, int]:
        """Worker pids by rank."""
        return self._engine.pids()

    @property
    def restarts(self) -> int:
        return self._engine.restarts

    def status(self) -> dict[int, dict[str, Any]]:
        """Every rank's state ("idle", "running", "terminated"), step, scalars, pid."""
        return self._engine.status()

    def stacks(self, ranks: list[int] | None = None, timeout: float = 2.0) -> dict[int, str]:
        """Where each rank of the call running now is: its Python stack, by rank."""
        handle = self._engine._handle
        if handle is None:
            return {rank: "(idle)" for rank in (self.ranks if ranks is None else ranks)}
        return dict(handle.stacks(ranks, timeout))

    def add_listener(self, callback: Callable[[int, str, dict], Any]) -> Any:
        """Call ``callback(rank, kind, data)`` for every event of every call."""
        return self._engine.add_listener(callback)

    def remove_listener(self, callback: Callable[[int, str, dict], Any]) -> None:
        """Undo :meth:`add_listener`."""
        self._engine.remove_listener(callback)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"pids={list(self.pids.values())}"
        return f"<WorkerPool ranks={self.ranks} {state} method={self._engine.plan.method}>"

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self.closed:
            raise LaunchError(
                "this pool is closed; start a new one with nbaccel.start_workers(...)."
            )

    def _ranks(self, ranks: list[int] | None) -> list[int]:
        if ranks is None:
            return list(self.ranks)
        bad = [r for r in ranks if r not in self.ranks]
        if bad or not ranks:
            raise ValueError(
                f"rank(s) {bad or ranks} are not ranks of this pool's workers on this machine; "
                f"choose from {self.ranks}."
            )
        return sorted(set(ranks))

    def _submit(
        self,
        job: tuple[Any, ...],
        targets: list[int] | None,
        return_all_ranks: bool,
        block: bool,
        output: Any,
        *,
        want: list[int] | None = None,
    ) -> Any:
        self._check_open()
        if output is not None and not (callable(output) or hasattr(output, "write")):
            raise TypeError(f"output={output!r} must be a file-like object or a callable.")
        targets = list(self.ranks) if targets is None else targets
        engine = self._engine
        if not engine.busy.acquire(blocking=False):
            raise LaunchError(
                "the pool is busy with a call running in the background; wait for its "
                "handle.result() or call handle.stop() first."
            )
        try:
            engine.ensure_healthy()
            plan = dataclasses.replace(
                engine.plan,
                config=engine.plan.config.replace(max_restarts=0),
                return_all_ranks=return_all_ranks,
                block=block,
                output=output,
            )
            handle = LaunchHandle(plan)
            handle.ranks = list(targets)
            handle._want = set(targets if return_all_ranks else (want or targets[:1]))
            handle._board.keep_only(targets)
            driver = CallDriver(engine, job, targets)
            driver.handle = handle
            handle._supervisor = driver  # type: ignore[assignment]
        except BaseException:
            engine.busy.release()
            raise
        if not block:
            handle._run_in_background()
            return handle
        handle._run()
        try:
            return handle.result()
        except WorkerError as err:  # the remote traceback tells the story, not our frames
            raise err.with_traceback(None) from None


def _check_syntax(source: str) -> None:
    try:
        compile(source, "<distributed cell>", "exec")
    except SyntaxError as err:
        line = (err.text or "").strip()
        if line.startswith(("%", "!")):
            err.msg += (
                " (a %%distributed cell runs as plain Python on the workers: IPython magics "
                "and !shell lines work only in ordinary cells)"
            )
        raise


def _dill(value: Any, what: str) -> bytes:
    import dill

    try:
        return bytes(dill.dumps(value, recurse=True))
    except Exception as err:
        raise TypeError(
            f"could not send {what} to the workers ({type(err).__name__}: {err}). They are "
            "copied with dill: create unpicklable objects (open files, locks, CUDA models) on "
            "the workers, e.g. inside the function or in a %%distributed cell."
        ) from err


def start_workers(
    num_processes: int | None = None,
    mixed_precision: str | None = None,
    use_port: int | None = None,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    start_method: str = "auto",
    timeout: float | None = None,
    *,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    config: LaunchConfig | None = None,
) -> WorkerPool:
    """Start a :class:`WorkerPool`: one warm worker per device, kept across cells.

    Takes the same options, and makes the same checks before anything starts, as
    :func:`~nbaccel.notebook_launcher` (``num_processes``, ``mixed_precision``,
    ``start_method``, ``timeout``, ``config=``, and ``master_addr``/``node_rank``/
    ``num_nodes``/``use_port`` for several machines: run the same cells on each).
    The process group forms at the first ``Accelerator()`` on the workers and lives
    as long as they do.

    Example:
        >>> pool = start_workers(num_processes=2)  # doctest: +SKIP
        >>> pool.run(lambda: __import__("os").environ["RANK"], return_all_ranks=True)  # doctest: +SKIP
        ['0', '1']
        >>> pool.close()  # doctest: +SKIP

    Raises:
        TypeError, ValueError: bad arguments (nothing is started).
        CUDAInitializedError: ``start_method="fork"`` after CUDA was initialised.
        WorkerError, LaunchError: a worker could not start.
    """
    from ..platform.xla import xla_requested
    from ._pool_worker import serve

    no_tpu = "start_workers does not support TPUs (torch_xla) yet; use notebook_launcher."
    if config.compute_device == "tpu" if config is not None else xla_requested():
        raise LaunchError(no_tpu)  # before the planner, whose TPU message is about block=False
    plan = plan_launch(
        serve,
        (),
        num_processes,
        mixed_precision,
        use_port,
        master_addr,
        node_rank,
        num_nodes,
        start_method,
        0,
        timeout,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        monitor_interval=monitor_interval,
        log_line_prefix_template=log_line_prefix_template,
        config=config,
        block=False,  # always worker processes (never "run in the kernel"), own session
    )
    if plan.method == "xla":
        raise LaunchError(no_tpu)
    engine = PoolEngine(plan, (sys.stdout, sys.stderr))
    engine.start()
    pool = WorkerPool(engine)
    if not _atexit_registered[0]:  # workers must not outlive the kernel
        atexit.register(_close_live_pools)
        _atexit_registered[0] = True
    _LIVE.add(pool)
    _current.append(weakref.ref(pool))
    return pool


__all__ = ["Stopped", "WorkerPool", "current_pool", "start_workers"]
