"""Kernel side of one pool call: wait for every rank's answer, decide what went wrong.

:class:`PoolSupervisor` is the launcher's :class:`~nbaccel.launch._supervise.Supervisor`
(same pipes, output forwarding, events, stack dumps, clean-up) for workers that do
not exit: a call is over when every rank of the call sent its ``pool_done`` frame.

Decisions, as in ``notebook_launcher`` where they apply:

* a rank failed and the others are still busy after :attr:`Supervisor.GRACE`: they
  are interrupted (SIGINT -> ``KeyboardInterrupt``); if they come back within
  :attr:`PoolSupervisor.INTERRUPT_GRACE` the pool stays, otherwise they are stuck
  (usually in a collective waiting for the failed rank) and the pool must restart;
* a rank died: the pool must restart (the group lost a member);
* only secondary failures (a collective timing out) while others still run, or
  ranks still busy ``timeout`` seconds after a peer finished: a hang, reported with
  the stuck ranks' Python stacks (:class:`~nbaccel.launch._failures.WorkerTimeoutError`);
  the pool must restart;
* ``KeyboardInterrupt`` in the kernel (the interrupt button) or ``stop()``: every
  busy rank is interrupted and waited for, as above.

"Must restart" is :class:`_PoolBroken`, carrying the error for the user and the reason.

Example:
    >>> from nbaccel.launch._pool_call import _PoolBroken
    >>> _PoolBroken(ValueError("x"), "rank 1 died").reason
    'rank 1 died'
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ._failures import Failure, WorkerTimeoutError, pick_failure, remote_exception
from ._spawn import WorkerProcess
from ._supervise import Supervisor


class _PoolBroken(Exception):
    """The pool's workers cannot go on (a rank died, hung or is stuck); restart them."""

    def __init__(self, error: BaseException, reason: str) -> None:
        super().__init__(reason)
        self.error, self.reason = error, reason


@dataclass
class CallResult:
    """Every rank's answer to one call: ``rank -> (ok, payload, sequence number)``."""

    done: dict[int, tuple[bool, Any, int | None]] = field(default_factory=dict)
    interrupted: bool = False  # KeyboardInterrupt in the kernel
    stopped: bool = False  # LaunchHandle.stop()


class PoolSupervisor(Supervisor):
    """Supervises long-lived pool workers, one call at a time."""

    INTERRUPT_GRACE = 3.0  # seconds an interrupted rank gets to come back

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._call_id: int | None = None
        self._done: dict[int, tuple[bool, Any, int | None, float]] = {}

    def _handle(self, proc: WorkerProcess, message: tuple[Any, ...]) -> None:
        if message[0] == "pool_done":
            if message[2] == self._call_id:  # a late answer to an abandoned call is dropped
                self._done[message[1]] = (message[3], message[4], message[5], time.time())
            return
        if message[0] == "result":  # serve() returned: the worker is leaving (close)
            return
        super()._handle(proc, message)

    # ------------------------------------------------------------------ one call
    def call(self, call_id: int, ranks: list[int], stop: threading.Event) -> CallResult:
        """Wait until every rank in ``ranks`` answered ``call_id``; raise _PoolBroken."""
        self._call_id, self._done = call_id, {}
        procs = [p for p in self.procs if p.rank in ranks]
        outcome = CallResult()
        try:
            self._wait(procs, stop, outcome)
        except KeyboardInterrupt:
            outcome.interrupted = True
            self._interrupt(procs, "the kernel was interrupted")
        self._drain()
        outcome.done = {r: v[:3] for r, v in self._done.items()}
        return outcome

    def _wait(self, procs: list[WorkerProcess], stop: threading.Event, out: CallResult) -> None:
        first_error: float | None = None
        while True:
            self._pump(self.interval)
            now = time.time()
            self._check_alive(procs)
            if stop.is_set():
                out.stopped = True
                self._interrupt(procs, "the call was stopped")
                return
            busy = [p for p in procs if p.rank not in self._done]
            if not busy:
                return
            failed = self.call_failures()
            if failed:
                first_error = first_error or now
                if now - first_error < self.GRACE:
                    continue
                chosen = pick_failure(failed)
                if chosen.secondary:  # a collective timed out while peers never arrived
                    reason = f"{chosen.summary()} while rank(s) {[p.rank for p in busy]} were busy"
                    self._hang(busy, reason)
                self._interrupt(procs, f"{chosen.summary()}")
                return
            finished = [t for (ok, _, _, t) in self._done.values() if ok]
            if self.timeout and finished and now - min(finished) > self.timeout:
                done = sorted(self._done)
                reason = (
                    f"rank(s) {done} finished the call more than timeout={self.timeout:g}s ago "
                    "and these ranks are still busy (waiting for a peer?)"
                )
                self._hang(busy, reason)

    def _check_alive(self, procs: list[WorkerProcess]) -> None:
        chosen = self.dead_failure()
        if chosen is not None:
            raise _PoolBroken(remote_exception(chosen), chosen.summary())

    def dead_failure(self) -> Failure | None:
        """How a dead worker died (its exit, signal and last stack), or None if all live."""
        dead = [p for p in self.procs if p.poll() is not None]
        if not dead:
            return None
        deadline = time.time() + 1.0  # let its last output, frames and stack arrive
        while time.time() < deadline and not all(self._ctrl_done(p) for p in dead):
            self._pump(0.05)
        failures = self._failures() + self.call_failures()
        if not failures:
            return Failure(dead[0].rank, dead[0].pid, time.time(), "exit", code=0)
        return pick_failure([f for f in failures if f.kind != "exception"] or failures)

    def call_failures(self) -> list[Failure]:
        """The ranks of the current call that answered with an exception."""
        out = []
        for rank, (ok, info, _, _) in self._done.items():
            if not ok:
                proc = next(p for p in self.procs if p.rank == rank)
                out.append(Failure(rank, proc.pid, info.get("time", 0.0), "exception", info))
        return out

    def _hang(self, busy: list[WorkerProcess], reason: str) -> None:
        stacks = {r: trim_pool_stack(text) for r, text in self.dump_stacks(busy).items()}
        stacks.update({f.rank: f.info.get("traceback", "") for f in self.call_failures()})
        pid = busy[0].pid if busy else None
        err = WorkerTimeoutError([p.rank for p in busy], stacks, reason, pid)
        raise _PoolBroken(err, f"rank(s) {[p.rank for p in busy]} hung")

    def _interrupt(self, procs: list[WorkerProcess], why: str) -> None:
        """SIGINT the busy ranks; _PoolBroken when one does not come back in time."""
        busy = [p for p in procs if p.rank not in self._done]
        for proc in busy:
            proc.send_signal(signal.SIGINT)
        deadline = time.time() + self.INTERRUPT_GRACE
        try:
            while time.time() < deadline and any(p.rank not in self._done for p in busy):
                self._pump(0.05)
                if any(p.poll() is not None for p in self.procs):
                    break
        except KeyboardInterrupt:  # pressed again: stop waiting
            pass
        stuck = [p.rank for p in busy if p.rank not in self._done]
        if stuck:
            error: BaseException = KeyboardInterrupt()
            failures = self.call_failures()
            if failures and not all(_interrupted(f) for f in failures):
                error = remote_exception(pick_failure([f for f in failures if not _interrupted(f)]))
            raise _PoolBroken(
                error,
                f"{why}; rank(s) {stuck} did not come back within "
                f"{self.INTERRUPT_GRACE:g}s of an interrupt (stuck in a collective?)",
            )

    def _drain(self) -> None:
        """Forward output written before the answers (it is in the pipes already)."""
        for _ in range(1000):
            if not self._open or not self._selector.select(0):
                break
            self._pump(0)
        for proc in self.procs:
            for stream in ("stdout", "stderr"):
                self.forwarder.close(proc.rank, stream)


def trim_pool_stack(text: str) -> str:
    """Keep the user's frames of a faulthandler dump: cut each thread at the pool's loop,
    and drop threads that only run nbaccel's own code (the watchdog).

    Example:
        >>> dump = ("Current thread 0x1 (most recent call first):\\n"
        ...         '  File "cell", line 3 in train\\n'
        ...         '  File "/x/nbaccel/launch/_pool_worker.py", line 9 in handle')
        >>> trim_pool_stack(dump).splitlines()[-1]
        '  File "cell", line 3 in train'
    """
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith("  ") or not blocks:
            blocks.append([line])
        else:
            blocks[-1].append(line)
    out = []
    for header, *frames in blocks:
        cut = next((i for i, f in enumerate(frames) if "_pool_worker.py" in f), len(frames))
        if frames and cut == 0:
            continue  # a thread that is all nbaccel (the watchdog)
        out.append("\n".join([header, *frames[:cut]]))
    return "\n".join(out).strip() or text


def _interrupted(failure: Failure) -> bool:
    return failure.info.get("type_qualname") == "KeyboardInterrupt"


__all__ = ["CallResult", "PoolSupervisor", "trim_pool_stack"]
