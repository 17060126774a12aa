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
import dataclasses
import itertools
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..config.choices import OnHangType
from ..config.keywords import PoolKeywords, documented, split
from ..config.options import CALL, CallOptions, OutputTarget, check_settings
from ..errors import LaunchError, Stopped
from ..platform import cudafork, environment, forksafe
from .cell._cell_output import CellOutput
from .channel._jobs import check_syntax, dill_for_workers
from .channel._messages import Job
from .debug import _kept
from .debug._watchdog import HangPolicy, HangWatch
from .engine import _lifetimes
from .engine._supervisor import JobFailed, Supervisor
from .engine._tidy import add_hint, clean, warn_oversubscribed
from .handle import LaunchHandle, Observed, RankStatus, already_running
from .start import _forkserver
from .start._preflight import LaunchPlan, check_call, plan_launch
from .start._start import forwarder, start_group

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's
    from typing_extensions import Unpack

_SETTLED = {"finished": "idle", "failed": "idle"}  # a pool's workers wait for the next call
START_TIMEOUT = 120.0  # seconds the workers get to start (more if timeout= says so)
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


class WorkerPool(Observed):
    """Warm workers, one per device; create with :func:`start_workers`.

    Attributes:
        ranks: the global ranks of this machine's workers.
        restarts: how often the workers were replaced (by :meth:`restart` or after a failure).
    """

    def __init__(self, plan: LaunchPlan) -> None:
        self._plan = plan
        self.ranks: list[int] = plan.ranks
        self.closed = False
        self.restarts = 0
        self._group: Supervisor | None = None
        self._busy = threading.Lock()  # held by the call in progress
        self._handle: LaunchHandle | None = None  # the call in progress
        self._board = RankStatus(self.ranks, "starting", renamed=_SETTLED)
        self._cells = itertools.count(1)
        self._sent: set[str] = set()  # notebook cells whose source the workers have

    # ------------------------------------------------------------------ workers
    def _start(self) -> None:
        self._sent = set()
        if self._plan.method == "fork" and _fork_unsafe_now():
            # CUDA, a process group or a Ray connection appeared in the kernel since the
            # pool started:
            # forking now would hand the new workers a broken copy: the fork server's
            # clean copy forks them, or they start fresh.
            server = _forkserver.usable()
            self._plan = dataclasses.replace(self._plan, method="forkserver" if server else "spawn")
            how = (
                "forked from nbaccel's fork server"
                if server
                else "started with start_method='spawn'"
            )
            _say(
                "nbaccel: CUDA, a process group or a Ray connection is now in the kernel, so the "
                f"pool's workers are {how} from now on."
            )
        elif self._plan.method == "forkserver" and not _forkserver.usable():
            _forkserver.say_why_not()
            self._plan = dataclasses.replace(self._plan, method="spawn")
        pool = weakref.ref(self)  # the workers must not keep an unreferenced pool alive

        def on_event(rank: int, kind: str, data: dict) -> None:
            if (owner := pool()) is not None:
                owner._event(rank, kind, data)

        group = start_group(self._plan, on_event=on_event, round_=self.restarts, persistent=True)
        try:
            group.wait_ready(max(START_TIMEOUT, self._plan.config.timeout or 0.0))
        except BaseException:
            group.terminate()
            group.close()
            raise
        self._group = group

    def _stop_workers(self, timeout: float, spare: set[int] | None = None) -> None:
        group, self._group = self._group, None
        if group is not None:  # serve() returns, the group is destroyed, the store shuts down
            group.shutdown(timeout, spare or ())

    def _replace(
        self, reason: str | None, *, graceful: bool = False, spare: set[int] | None = None
    ) -> None:
        """End the current workers (children included; not ``spare``, failed ranks kept for
        nbaccel.debug()) and start fresh ones."""
        if reason:
            kept = (
                f" Failed rank(s) {sorted(spare)} stay for nbaccel.debug() until the next call."
                if spare
                else ""
            )
            _say(
                f"nbaccel: {reason}; the pool restarted its workers (restart "
                f"{self.restarts + 1}). Names set with push or in %%distributed cells are "
                f"gone; the process group forms again at the next Accelerator().{kept}"
            )
        if not spare:  # the failed job's workers go with these: nothing left to debug
            _kept.forget(self, "the pool restarted its workers")
        self._stop_workers(5.0 if graceful else 0.0, spare)
        self.restarts += 1
        self._start()

    def _ensure_healthy(self) -> None:
        """Replace the workers if one died while the pool was idle (e.g. SIGKILL, OOM)."""
        if self._group is None:
            self._start()
            return
        if (dead := self._group.dead()) is not None:
            self._replace(f"{dead.summary()} while the pool was idle")

    # ------------------------------------------------------------------ internals
    def _event(self, rank: int, kind: str, data: dict) -> None:
        listeners = self._board.record(rank, kind, data)
        if (handle := self._handle) is not None and rank in handle.ranks:  # its own states
            handle.on_event(rank, kind, data)
        self._board.notify(listeners, rank, kind, data)

    def _check_open(self) -> None:
        if self.closed:
            raise LaunchError("this pool is closed; start a new one with start_workers(...).")

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

    def _new_sources(self) -> dict[str, Any]:
        """Notebook cells not yet sent to these workers (for their tracebacks)."""
        out = environment.notebook_cell_sources(skip=self._sent)  # IPython 7 and 8
        self._sent.update(out)
        return out

    def _submit(
        self,
        kind: str,
        body: tuple[Any, ...],
        targets: list[int] | None = None,
        all_ranks: bool = False,
        block: bool = True,
        output: Any = None,
        *,
        hang: HangPolicy | None = None,
        label: str = "",
    ) -> Any:
        self._check_open()
        if output is not None and not (callable(output) or hasattr(output, "write")):
            raise TypeError(f"output={output!r} must be a file-like object or a callable.")
        targets = list(self.ranks) if targets is None else targets
        wanted = set(targets if all_ranks else targets[:1])
        if not self._busy.acquire(blocking=False):
            running = self._handle
            busy = "the pool is busy with a call running in the background"
            raise clean(LaunchError(
                already_running(running, busy, CellOutput.here()) if running is not None else
                f"{busy}; wait for its handle.result() or call handle.stop() first."
            ))  # fmt: skip
        try:
            self._ensure_healthy()
            if kind == "run":
                body = (*body, self._new_sources())
            cell = CellOutput.here() if output is None else None  # in the cell's thread
            route = output if cell is None else cell
            policy = hang or HangPolicy.of(self._plan.config)
            handle = LaunchHandle(targets, lambda h: self._call(h, kind, body, wanted, route,
                                  policy), all_ranks=all_ranks)  # fmt: skip
            handle.cell_output = cell
        except BaseException:
            self._busy.release()
            raise
        self._handle = handle
        handle.label = label or f"pool.{kind}()"
        if not block:
            handle.run_in_background()
            return handle
        __tracebackhide__ = True  # IPython shows the user's cell, then the error
        try:
            handle.run()
        except KeyboardInterrupt:
            raise clean(KeyboardInterrupt("the pool call was interrupted on every rank")) from None
        if (error := handle.exception()) is not None:  # the remote traceback tells the story
            raise clean(error)
        return handle.result()

    def _failed(self, handle: LaunchHandle, group: Supervisor, failed: JobFailed) -> BaseException:
        """After a failed call: states, nbaccel.debug()'s snapshot, a restart when the
        workers cannot go on; returns the error to raise."""
        for rank in handle.ranks:
            if self._board.snapshot()[rank]["state"] == "running":
                self._event(rank, "state", {"state": "failed"})
        error = failed.error
        fixed_port = self._plan.config.master_port is not None
        keep = _kept.after_pool_call(  # for nbaccel.debug()
            self, group, broken=bool(failed.broken), port_fixed=fixed_port
        )
        if failed.broken:
            self._handle = None
            self._replace(failed.broken, spare=keep)
            if isinstance(error, Stopped):
                error = Stopped("the call was stopped; the pool restarted its workers")
        elif isinstance(error, Stopped):
            error = Stopped("the call was stopped with LaunchHandle.stop(); the pool stays")
        add_hint(error, kept=_debuggable_now(error), pool=True)
        return error

    def _call(
        self,
        handle: LaunchHandle,
        kind: str,
        body: tuple[Any, ...],
        want: set[int],
        output: Any,
        hang: HangPolicy,
    ) -> dict[int, Any]:
        """One call on the workers; replaces them when they cannot go on."""
        try:
            group = self._group
            assert group is not None
            group.workers.forwarder = forwarder(self._plan, self.ranks, output)
            handle.supervisor = group
            if (watch := group.hook(HangWatch)) is not None:
                watch.policy = hang
            job = group.new_job()
            for rank in handle.ranks:
                self._event(rank, "state", {"state": "running", "pid": group.procs[rank].pid})
            _kept.forget(self, "the pool ran another call since (a failed rank keeps its "
                         "traceback until the pool's next call)")  # fmt: skip
            failed: JobFailed | None = None
            try:
                group.send(handle.ranks, Job(job, kind, want, body))
                return group.run_job(job, handle.ranks, want, handle.stop_requested)
            except JobFailed as caught:
                failed = caught
            finally:
                group.drain()
            # out of the except block: workers forked by a restart must not inherit the
            # failure being handled (their next error would carry it as its context)
            assert failed is not None
            raise self._failed(handle, group, failed) from None
        finally:
            self._handle = None
            self._busy.release()

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
        given = check_settings(dict(hang_after=hang_after, on_hang=on_hang))  # then as the pool's
        payload = dill_for_workers(
            (function, tuple(args), dict(kwargs or {})), "the function and its args"
        )
        hang = HangPolicy.of(self._plan.config.replace(**given))  # the call's own watchdog
        __tracebackhide__ = True  # IPython shows the user's cell, then the error
        name = getattr(function, "__name__", type(function).__name__)
        return self._submit("run", (payload,), None, call.return_all_ranks, call.block,
                            call.output, hang=hang, label=f"pool.call({name})")  # fmt: skip

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
        return self._submit("exec", body, targets, output=output)

    def push(self, **names: Any) -> None:
        """Set ``names`` in every worker's namespace (copied with dill): ``pool.push(lr=1e-3)``."""
        if not names:
            raise TypeError("pool.push needs names to set, e.g. pool.push(lr=1e-3).")
        self._submit("push", (dill_for_workers(names, "the pushed values"),))

    def pull(self, name: str, rank: int | None = 0) -> Any:
        """A name's value on ``rank`` (``None``: a list, one per rank); NameError if unset."""
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"pull needs a variable name (a str), got {name!r}.")
        targets = self._ranks(None if rank is None else [rank])
        return self._submit("pull", (name,), targets, all_ranks=rank is None)

    def names(self, rank: int = 0) -> list[str]:
        """The names defined in ``rank``'s namespace."""
        return list(self._submit("names", (), self._ranks([rank])))

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
        if (handle := self._handle) is not None:
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
        if (handle := self._handle) is None:
            return {rank: "(idle)" for rank in (self.ranks if ranks is None else ranks)}
        return handle.stacks(ranks)

    @property
    def start_method(self) -> str:
        """How the current workers were started: "fork", "spawn" or "forkserver"."""
        return self._plan.method

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"pids={list(self.pids.values())}"
        return f"<WorkerPool ranks={self.ranks} {state} method={self.start_method}>"


def _debuggable_now(error: BaseException) -> bool:
    """nbaccel.debug() can open a session on the failed rank of this call."""
    job, rank = _kept.last(), getattr(error, "rank", None)
    return job is not None and isinstance(rank, int) and job.unavailable(rank) is None


def _fork_unsafe_now() -> bool:
    if cudafork.fork_state().broken:  # CUDA or its driver initialised, by anyone
        return True
    if forksafe.fork_breaks_this_process():  # Ray connected since: a fork would stall it
        return True
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _say(text: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


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
