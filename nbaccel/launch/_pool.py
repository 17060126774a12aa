"""The machinery of a warm pool: its workers, their replacement, one call at a time.

:class:`PoolWorkers` owns the pool's group of workers (:func:`~._start.start_group` with
``persistent=True``) and runs each call on it through the one supervisor; when the
workers cannot go on (a rank died, hung, did not come back from an interrupt, or the
ranks ran different numbers of collectives) it replaces them and says so on stderr.
:class:`~nbaccel.launch.pool.WorkerPool` is its public face.

Example:
    >>> PoolWorkers.__name__
    'PoolWorkers'
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import threading
import weakref
from typing import Any

from ..errors import LaunchError, Stopped
from ..platform import cudafork, environment
from . import _kept
from ._cell_output import CellOutput
from ._messages import Job
from ._preflight import LaunchPlan
from ._start import forwarder, start_group
from ._supervisor import JobFailed, Supervisor
from ._tidy import add_hint, clean
from ._watchdog import HangPolicy, HangWatch
from .handle import LaunchHandle, Observed, RankStatus, already_running

_SETTLED = {"finished": "idle", "failed": "idle"}  # a pool's workers wait for the next call
START_TIMEOUT = 120.0  # seconds the workers get to start (more if timeout= says so)


class PoolWorkers(Observed):
    """A pool's workers and its calls (one at a time)."""

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
            # CUDA (or a process group) appeared in the kernel since the pool started:
            # forking now would hand the new workers a broken copy, so start them fresh.
            self._plan = dataclasses.replace(self._plan, method="spawn")
            _say(
                "nbaccel: CUDA or a process group is now initialised in the kernel, so the "
                "pool's workers are started with start_method='spawn' from now on."
            )
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
        handle = self._handle
        if handle is not None and rank in handle.ranks:  # the call shows its own states
            handle.on_event(rank, kind, data)
        self._board.notify(listeners, rank, kind, data)

    def _check_open(self) -> None:
        if self.closed:
            raise LaunchError("this pool is closed; start a new one with start_workers(...).")

    def _hang_policy(self, after: float | None, action: str | None) -> HangPolicy | None:
        """A call's own watchdog settings (checked as LaunchConfig fields), or None."""
        given = {k: v for k, v in (("hang_after", after), ("on_hang", action)) if v is not None}
        return HangPolicy.of(self._plan.config.replace(**given)) if given else None

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
        targets: list[int] | None,
        all_ranks: bool,
        block: bool,
        output: Any,
        *,
        want: list[int] | None = None,
        hang: HangPolicy | None = None,
        label: str = "",
    ) -> Any:
        self._check_open()
        if output is not None and not (callable(output) or hasattr(output, "write")):
            raise TypeError(f"output={output!r} must be a file-like object or a callable.")
        targets = list(self.ranks) if targets is None else targets
        wanted = set(targets if all_ranks else (want or targets[:1]))
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
        error = handle.exception()
        if error is not None:  # the remote traceback tells the story, not our frames
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


def _debuggable_now(error: BaseException) -> bool:
    """nbaccel.debug() can open a session on the failed rank of this call."""
    job, rank = _kept.last(), getattr(error, "rank", None)
    return job is not None and isinstance(rank, int) and job.unavailable(rank) is None


def _fork_unsafe_now() -> bool:
    if cudafork.fork_state().broken:  # CUDA or its driver initialised, by anyone
        return True
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _say(text: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


__all__ = ["START_TIMEOUT", "PoolWorkers"]
