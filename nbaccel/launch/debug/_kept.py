"""Kernel side of post-mortem debugging: which failed job's ranks can still be debugged.

:class:`KeepFailed`, the supervisor's hook, takes a :class:`FailedJob` snapshot as a job
fails (the failed ranks, and every other rank's stack); :func:`after_launch` and
:func:`after_pool_call` :func:`remember` it, the last one being what :func:`nbaccel.debug`
opens. Failed ranks only the kernel's debugging holds (a debug=True launch, a pool that
replaced its workers) are owned here without a thread: ended after their session, when the
pool moves on, or when the kernel next touches its workers (:func:`sweep`) once they left
or overstayed ``debug_timeout``; the exit hook (:mod:`..engine._lifetimes`) ends the rest.

Example:
    >>> last() is None or isinstance(last(), FailedJob)
    True
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

from ...config.options import DEBUG_TIMEOUT  # a failed rank waits this long for debug()
from ...errors import named_rank
from ..engine import _lifetimes
from ..engine._supervisor import Hook, Supervisor
from ..engine._tidy import Failure, signal_name

LINGER_GRACE = 5.0  # seconds after debug_timeout before the kernel ends a rank still there
LEAVE_WAIT = 5.0  # seconds a launch's rank gets to exit by itself after its session
FINISHED = "had finished the job"  # what the snapshot says of a rank that had


@dataclass
class FailedJob:
    """One failed job as ``nbaccel.debug()`` sees it."""

    failures: dict[int, Failure]  # every rank that failed, by rank
    first: int  # the first real failure's rank: debug()'s default
    others: dict[int, str]  # every other rank of the job when it failed: stack or what it did
    origin: str = "pool"  # "pool" or "notebook_launcher"
    group: Supervisor | None = None  # the workers, while a session is possible
    gone: str | None = None  # why no session is possible any more
    lock: threading.Lock = field(default_factory=threading.Lock)  # one session at a time
    deadline: float | None = None  # monotonic time a launch's failed ranks leave
    owner: int | None = None  # id() of the pool whose call failed
    gone_ranks: set[int] = field(default_factory=set)  # ranks let go after their session
    lingering: list[int] = field(default_factory=list)  # the kept ranks, while held

    def named(self, rank: int) -> str:
        """``rank`` as messages name it (on a cluster: with its pid and node)."""
        if (failure := self.failures.get(rank)) is not None:
            return named_rank(rank, failure.pid, failure.node)
        if (group := self.group) is not None and rank in group.procs:
            return group.procs[rank].named
        return named_rank(rank)

    def holding(self) -> list[int]:
        """Ranks whose worker kept a traceback (failed with an exception)."""
        return sorted(r for r, f in self.failures.items() if f.kind == "exception")

    def unavailable(self, rank: int) -> str | None:
        """Why no session on ``rank`` is possible (None: ask its worker)."""
        failure, who = self.failures.get(rank), self.named(rank)
        if failure is not None and failure.kind == "signal":
            hint = " (often the out-of-memory killer)" if failure.code == 9 else ""
            return (
                f"{who} was killed by {signal_name(failure.code)}{hint}: a killed "
                "process keeps nothing, so there is no traceback to debug. Its error message "
                "(and stack, for a fatal error) is all there is."
            )
        if failure is not None and failure.kind == "exit":
            return (
                f"{who} exited with code {failure.code} before its job ended: the "
                "process is gone, so there is no traceback to debug."
            )
        if rank not in self.failures and rank not in self.others:
            ranks = sorted({*self.failures, *self.others})
            return f"{who} did not run the failed job (its ranks: {ranks})."
        if rank not in self.failures and self.others.get(rank) == FINISHED:
            return (
                f"{who} did not fail (it had finished the job), so it holds no "
                f"traceback; rank(s) {self.holding()} did: try nbaccel.debug({self.first})."
            )
        if self.gone:
            return f"no post-mortem session on {who}: {self.gone}."
        group = self.group
        if group is None or rank not in group.procs or not group.procs[rank].alive():
            if self.origin == "pool" and rank in self.gone_ranks:
                return (
                    f"{who}: its session ended and its worker, kept only for debugging "
                    "after the pool restarted, was let go."
                )
            if self.origin == "pool":
                return f"{who}: its worker is gone."
            if rank not in self.failures:
                return (
                    f"{who} did not fail: notebook_launcher ended it when "
                    f"{self.named(self.first)} failed (only failed ranks stay for debugging). Try "
                    f"nbaccel.debug({self.first})."
                )
            return (
                f"{who}: its worker has left: its session was quit, or no debugger came "
                "within debug_timeout seconds of the failure."
            )
        return None


class KeepFailed(Hook):
    """Post-mortem's hook: the snapshot at a failure; a one-shot group spares its failed
    ranks (they wait for ``nbaccel.debug()``)."""

    def __init__(self) -> None:
        self.job: FailedJob | None = None
        self._ranks: list[int] = []

    def started(self, sup: Supervisor, ranks: list[int]) -> None:
        self._ranks = ranks

    def failed(
        self, sup: Supervisor, problems: list[Failure], chosen: Failure, finished: set[int]
    ) -> None:
        """The snapshot of the job as it fails."""
        failed = {f.rank: f for f in problems}
        alive = [r for r in self._ranks if sup.procs[r].poll() is None]
        running = [r for r in alive if r not in {*failed, *finished}]
        stacks = sup.stacks(running) if running else {}
        others = {}
        for rank in self._ranks:
            if rank in failed and rank != chosen.rank:
                others[rank] = f"failed too ({failed[rank].summary()})"
            elif rank in stacks:
                others[rank] = stacks[rank] or "(no Python frames of its own)"
            elif rank in finished:
                others[rank] = FINISHED
        self.job = FailedJob(failed, chosen.rank, others)

    def spared(self, sup: Supervisor) -> set[int]:
        job = self.job
        return set() if job is None else {r for r in job.holding() if sup.procs[r].poll() is None}


def _taken(group: Supervisor) -> FailedJob | None:
    """The snapshot of ``group``'s failed job (taken once), if it keeps failed ranks."""
    if (hook := group.hook(KeepFailed)) is None:
        return None
    job, hook.job = hook.job, None
    return job


_last: list[FailedJob] = []
_held: dict[int, FailedJob] = {}  # failed jobs whose workers only the kernel's debug holds


def last() -> FailedJob | None:
    """The last failed job of this kernel (None: nothing failed yet)."""
    sweep()
    return _last[0] if _last else None


def remember(job: FailedJob) -> None:
    """``job`` is the one ``debug()`` opens from now on; an earlier one is let go."""
    for old in [*_last, *_held.values()]:
        if old is not job:
            _let_go(old, "a later job failed since; nbaccel.debug() opens that one")
    _last[:] = [job]


def forget(owner: object, why: str) -> None:
    """``owner`` (a pool) runs another call or closes: its failed job's tracebacks go."""
    for job in [*_last, *_held.values()]:
        if job.owner == id(owner):
            _let_go(job, why)


def holding_any() -> bool:
    """Whether any failed job's ranks are kept alive for ``nbaccel.debug()``."""
    sweep()
    return bool(_held)


def make_room() -> list[str]:
    """A launch on the GPUs starts: ranks kept for ``nbaccel.debug()`` go first, so that
    the new ranks have their GPU memory (issue 32: a kept rank holding its tensors made
    the next launch of the same size run out of memory). Returns what was ended."""
    ended = []
    for job in list(_held.values()):
        ranks = sorted(set(job.holding()) - job.gone_ranks)
        _let_go(job, "a later launch started; the kernel ended its kept ranks for their GPU memory")
        ended.append(f"rank(s) {', '.join(map(str, ranks))} of the failed {job.origin} job")
    return ended


def after_launch(group: Supervisor, error: BaseException, timeout: float | None) -> bool:
    """A launch failed for good (no restart follows). Remember it for ``nbaccel.debug()``;
    True when the kernel keeps ``group`` (its failed ranks linger), which then ends it."""
    if (job := _taken(group)) is None:
        rank = getattr(error, "rank", None)
        if isinstance(rank, int) and not isinstance(error, KeyboardInterrupt):
            why = (
                "no rank raised an exception that could be kept (a hang, an interrupt, a "
                "stop), so the launch ended every worker"
                if timeout is not None
                else "notebook_launcher ended every worker when the launch failed; run it "
                "with debug=True to keep a failed rank for nbaccel.debug()"
            )
            remember(FailedJob({}, rank, {rank: ""}, "notebook_launcher", gone=why))
        return False
    job.origin = "notebook_launcher"
    remember(job)
    return _hold(job, group, set(job.holding()), timeout or 0.0)


def after_pool_call(
    owner: object, group: Supervisor, *, broken: bool, port_fixed: bool
) -> set[int]:
    """A pool call failed: remember its snapshot. When the pool replaces its workers
    (``broken``), return the failed ranks it must leave alive for the kernel to hold (not
    rank 0 when it restarts on the same port: its store listens there)."""
    if (job := _taken(group)) is None:
        return set()
    job.owner, job.group = id(owner), group  # its next call, restart or close: forget()
    remember(job)
    if not broken:
        return set()
    ranks = set(job.holding()) - ({0} if port_fixed else set())
    return ranks if _hold(job, group, ranks, DEBUG_TIMEOUT) else set()


def _hold(job: FailedJob, group: Supervisor, ranks: set[int], seconds: float) -> bool:
    """Keep ``group`` for the live ones of ``ranks`` (ended by :func:`sweep`, a session's
    end, the pool, or the exit hook)."""
    if not (alive := [r for r in sorted(ranks) if group.procs[r].poll() is None]):
        return False
    job.group, job.deadline, job.lingering = group, time.monotonic() + seconds, alive
    _held[id(job)] = job
    _lifetimes.register("kept", _end_all)  # no lingering rank outlives the kernel
    return True


def sweep() -> None:
    """End the kept groups whose ranks all left, or overstayed their deadline (by
    ``LINGER_GRACE``); never one a debugging session holds."""
    now = time.monotonic()
    for job in list(_held.values()):
        group = job.group
        if group is None or not job.lock.acquire(blocking=False):
            continue
        try:
            done = not any(group.procs[r].alive() for r in job.lingering)  # left, or leaving
            if done or (job.deadline is not None and now > job.deadline + LINGER_GRACE):
                _end(job)
        finally:
            job.lock.release()


def release(job: FailedJob, rank: int) -> None:
    """After ``rank``'s session (its debug() holds ``job.lock``): a held rank goes."""
    group = job.group
    if id(job) not in _held or group is None:
        return
    if job.origin == "notebook_launcher":
        group.procs[rank].wait(LEAVE_WAIT)  # it leaves by itself once the session ended
    group.terminate(spare=set(group.procs) - {rank})
    job.gone_ranks.add(rank)
    if all(group.procs[r].poll() is not None for r in job.holding() if r in group.procs):
        _end(job)


def _let_go(job: FailedJob, why: str) -> None:
    job.gone = job.gone or why
    if id(job) in _held:
        with job.lock:  # never while a session runs on the group
            _end(job)


def _end(job: FailedJob) -> None:
    group, job.group = job.group, None
    _held.pop(id(job), None)
    if group is not None:
        with contextlib.suppress(Exception):
            group.terminate()
            group.close()


def _end_all() -> None:
    """Kernel exit: no lingering rank outlives it (they would also see their channel end)."""
    for job in list(_held.values()):
        _end(job)


__all__ = [
    "DEBUG_TIMEOUT",
    "FailedJob",
    "KeepFailed",
    "after_launch",
    "after_pool_call",
    "forget",
    "holding_any",
    "last",
    "make_room",
    "release",
    "remember",
    "sweep",
]
