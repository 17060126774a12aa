"""The one supervisor: the kernel's side of a group of workers, for every kind of launch.

One loop multiplexes every worker's output pipes and channel with ``selectors``: output
lines go to the :class:`~nbaccel.launch._output.LineForwarder` (a tail of stderr is kept
for fatal-error stacks), channel messages (:mod:`~nbaccel.launch._messages`) are acted
on by their type.
:meth:`Supervisor.run_job` waits for one job on some ranks and decides:

* a failure (an exception, a death by signal, an unexpected exit) starts a short grace
  period for the others' reports; then the *first real* failure is raised (secondary
  "connection closed by peer"/timeout errors of healthy ranks count only when nothing
  else went wrong);
* only secondary failures while other ranks still run, or ranks still busy ``timeout``
  seconds after a peer finished: those ranks hang; their stacks (:meth:`probe`) go into
  a :class:`~nbaccel.errors.WorkerTimeoutError`;
* ranks that wait on each other with no progress for ``hang_after`` seconds: the
  :mod:`~nbaccel.launch._watchdog` reports them where the output goes and the job goes on
  (``on_hang="raise"``: ``_hang`` as above);
* a job on a subset of this node's ranks (``%%distributed --ranks 0``) whose rank enters
  a torch.distributed call that needs a rank not running the job: an error naming it;
* an interrupt, ``stop()``, or a failure while others are still busy: a one-shot group is
  terminated; a pool's busy ranks get SIGINT and ``INTERRUPT_GRACE`` to come back;
* a :class:`~nbaccel.errors.RanksMissingError` (a collective entered by some ranks only)
  gets a note with the stacks of the ranks that did not come, probed as it arrives;
* post-mortem (``keep_failed``: pools, debug=True launches): at a failure, where the other
  ranks are (:class:`~nbaccel.launch._kept.FailedJob`); a one-shot group's failed ranks are
  not terminated (they wait for ``nbaccel.debug()``); pdb's messages are queued for it.

:class:`JobFailed` carries the error and, when the workers cannot go on (a rank died,
hung, did not come back, or the ranks ran different numbers of collectives), the reason.

Example:
    >>> Supervisor.GRACE
    1.0
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import LaunchError, RanksMissingError, Stopped, WorkerTimeoutError
from ._failures import Failure, add_note, name_missing, pick_failure, remote_exception, trim_stack
from ._group import Group
from ._kept import FailedJob
from ._messages import (
    Done,
    Event,
    Fatal,
    Hello,
    Imported,
    PdbOutput,
    Probe,
    ProbeAnswer,
    Ready,
)
from ._output import LineForwarder
from ._preload import remember_worker_imports
from ._process import WorkerProcess
from ._watchdog import HangPolicy, Watchdog, subset_error
from ._wire import loads

EventCallback = Callable[[int, str, dict], None]


class JobFailed(Exception):
    """A job ended badly: ``error`` is for the user; ``broken`` says why the workers
    cannot go on (None: they can)."""

    def __init__(self, error: BaseException, broken: str | None) -> None:
        super().__init__(str(error))
        self.error, self.broken = error, broken


class Supervisor(Group):
    """Owns a group of started workers: reads them, runs jobs on them, ends them."""

    GRACE = 1.0  # seconds to collect the other ranks' reports after a first failure
    INTERRUPT_GRACE = 3.0  # seconds an interrupted pool rank gets to come back
    PROBE_EVERY = 0.5  # seconds between looks at a subset job's ranks

    def __init__(
        self,
        procs: list[WorkerProcess],
        forwarder: LineForwarder,
        *,
        timeout: float | None,
        interval: float,
        on_event: EventCallback,
        one_shot: bool,
        hang: HangPolicy | None = None,
    ) -> None:
        super().__init__(procs, forwarder, on_event)
        self.timeout, self.interval, self.one_shot = timeout, interval, one_shot
        self.hang = hang or HangPolicy()  # the watchdog's (a pool call may set its own)
        self.activity = 0  # events and answers received: progress, for the watchdog
        self.ready: set[int] = set()
        self._ids = itertools.count(2)  # 1 is the first job, made before the group started
        self._job: int | None = None
        self._done: dict[int, Done] = {}  # this job's answers, by rank
        self._done_at: dict[int, float] = {}
        self._fatal: dict[int, Failure] = {}
        self._answers: dict[int, dict[int, dict[str, Any]]] = {}
        self._reader: threading.Thread | None = None  # the thread in run_job, reading
        # post-mortem (nbaccel.debug): a pool always keeps a failed rank's traceback, a
        # launch with debug=True too; the failure's snapshot and the debugger's messages
        self.keep_failed = not one_shot
        self.post_mortem: FailedJob | None = None
        self.pdb_messages: list[tuple[int, PdbOutput]] = []

    def handle(self, proc: WorkerProcess, message: object) -> None:
        rank = proc.rank
        self.activity += isinstance(message, (Event, Done))
        match message:
            case Hello(pid=pid):
                state = "running" if self.one_shot else "idle"
                self.on_event(rank, "state", {"state": state, "pid": pid})
            case Ready():
                self.ready.add(rank)
            case Imported(modules=modules):
                remember_worker_imports(modules)  # pre-import them next time
            case Event(kind=kind, data=data, time=at):
                self.on_event(rank, kind, dict(data, time=at))
            case Done(job=job) if job == self._job:  # a late answer is dropped
                self._done[rank], self._done_at[rank] = message, time.time()
                if message.ok:
                    self.on_event(rank, "state", {"state": "finished"})
                else:
                    summary = self._job_failure(rank).summary()
                    self.on_event(rank, "state", {"state": "failed", "error": summary})
            case Fatal(info=info):
                failure = Failure(rank, proc.pid, info.get("time", 0.0), "exception", info)
                self._fatal[rank] = failure
                self.on_event(rank, "state", {"state": "failed", "error": failure.summary()})
            case ProbeAnswer(request=request) if request in self._answers:
                self._answers[request][rank] = message.report
            case PdbOutput():
                self.pdb_messages.append((rank, message))

    # ------------------------------------------------------------------ looking inside
    def probe(self, ranks: Iterable[int], wait: float = 1.0) -> dict[int, dict[str, Any]]:
        """What each rank's main thread is doing now: ``{"stack", "waiting", ...}`` (see
        :func:`nbaccel.launch._worker_os.main_thread_report`); answered by the worker's
        channel thread, so also while the main thread is blocked in C++. From another
        thread than the one running a job (a live monitor's button) it only asks: that
        thread reads the answers."""
        asked = [self.procs[r] for r in ranks if self.procs[r].returncode is None]
        request = next(self._ids)
        answers = self._answers[request] = {}
        for proc in asked:
            with contextlib.suppress(OSError, AttributeError):
                proc.channel.send(Probe(request))  # type: ignore[union-attr]
        deadline = time.monotonic() + wait
        while len(answers) < len(asked) and time.monotonic() < deadline:
            reader = self._reader
            if reader is None or reader is threading.current_thread():
                self.pump(0.05)
            else:
                time.sleep(0.05)
        return self._answers.pop(request)

    def stacks(self, ranks: Iterable[int]) -> dict[int, str]:
        answers = self.probe(ranks)
        return {
            r: answers[r]["stack"] if r in answers else "(no answer: not running Python code)"
            for r in ranks
        }

    # ------------------------------------------------------------------ jobs
    def new_job(self) -> int:
        return next(self._ids)

    def send(self, ranks: Iterable[int], message: object) -> None:
        """Send ``message`` to ``ranks``; JobFailed if a rank cannot take it."""
        try:
            for rank in ranks:
                self.procs[rank].channel.send(message)  # type: ignore[union-attr]
        except (OSError, AttributeError) as err:  # its channel is gone: the worker died
            raise JobFailed(LaunchError(f"a worker is gone ({err})"), "a worker is gone") from err
        except KeyboardInterrupt:  # some ranks may have the job, others not
            raise JobFailed(KeyboardInterrupt(), "interrupted while sending a job") from None

    def run_job(
        self, job: int, ranks: list[int], want: set[int], stop: threading.Event
    ) -> dict[int, Any]:
        """Wait until every rank in ``ranks`` finished ``job`` (one-shot: and exited);
        return the values of ``want``. Raises :class:`JobFailed`."""
        self._job, self._done, self._done_at = job, {}, {}
        self._reader = threading.current_thread()
        procs = [self.procs[r] for r in ranks]
        subset = [r for r in self.procs if r not in ranks]
        first_problem: float | None = None
        last_look = time.monotonic()

        def cpu(ranks: list[int]) -> dict[int, float | None]:  # working or stuck? (psutil)
            return {r: self.procs[r].cpu_seconds() for r in ranks}

        watchdog = Watchdog(self.hang, self.probe, cpu=cpu)
        try:
            while True:
                self.pump(self.interval)
                now = time.time()
                self._poll()
                if stop.is_set():
                    self._end_early(procs, Stopped("the run was stopped with stop()"))
                busy = [p for p in procs if p.rank not in self._done]
                problems = self.failures(procs)
                if problems:
                    first_problem = first_problem or now
                    waiting = [p for p in busy if p.returncode is None]
                    if waiting and now - first_problem < self.GRACE:
                        continue
                    self._failed(problems, procs)
                if not busy and (not self.one_shot or all(self._exited(p) for p in procs)):
                    return self._values(want)
                if subset and busy and time.monotonic() - last_look > self.PROBE_EVERY:
                    last_look = time.monotonic()
                    for rank, report in self.probe([p.rank for p in busy], wait=0.5).items():
                        if error := subset_error(rank, report, ranks, subset):
                            self._end_early(procs, error)
                finished = [self._done_at[r] for r, done in self._done.items() if done.ok]
                stuck = [p for p in busy if p.returncode is None]
                seqs = {r: done.collectives for r, done in self._done.items()}
                hang = watchdog.look([p.rank for p in stuck], seqs, self.activity)
                if hang is not None and hang.policy.action == "raise" and not hang.busy:
                    self._hang(stuck, hang.reason, hang.stacks)
                elif hang is not None:
                    hang.report(self.forwarder, self.on_event)
                if self.timeout and finished and stuck and now - min(finished) > self.timeout:
                    reason = (
                        f"rank(s) {sorted(self._done)} finished more than timeout="
                        f"{self.timeout:g}s ago and these ranks are still running (waiting "
                        "for a peer that is gone?)"
                    )
                    self._hang(stuck, reason, {})
        except KeyboardInterrupt:
            self._end_early(procs, KeyboardInterrupt())
        finally:
            self._reader = None
        raise AssertionError("unreachable")  # pragma: no cover

    def _job_failure(self, rank: int) -> Failure:
        info = self._done[rank].payload
        proc = self.procs[rank]
        return Failure(rank, proc.pid, info.get("time", 0.0), "exception", info)

    def _ok(self, rank: int) -> bool:
        """Not known to have failed this job (finished well, or not finished)."""
        done = self._done.get(rank)
        return done is None or done.ok

    def failures(self, procs: list[WorkerProcess]) -> list[Failure]:
        """The job's failed ranks, and every rank of the group that failed or died."""
        out = [self._job_failure(p.rank) for p in procs if not self._ok(p.rank)]
        out += [f for r, f in self._fatal.items() if r not in {f.rank for f in out}]
        for proc in self.procs.values():
            if not self._exited(proc) or proc.rank in {f.rank for f in out}:
                continue
            assert proc.exit_time is not None and proc.returncode is not None
            if proc.returncode < 0:
                stack = trim_stack(self._tails[proc.rank].decode(errors="replace"))
                code = -proc.returncode
                out.append(
                    Failure(proc.rank, proc.pid, proc.exit_time, "signal", code=code, stack=stack)
                )
            elif not self.one_shot or proc.returncode > 0 or proc.rank not in self._done:
                code = proc.returncode
                out.append(Failure(proc.rank, proc.pid, proc.exit_time, "exit", code=code))
        return out

    def dead(self) -> Failure | None:
        """How a worker that died while the group was idle died (None: all alive)."""
        self._poll()
        if all(p.returncode is None for p in self.procs.values()):
            return None
        deadline = time.time() + 1.0  # its last output, messages and stack arrive first
        gone = [p for p in self.procs.values() if p.returncode is not None]
        while time.time() < deadline and not all(self._exited(p) for p in gone):
            self.pump(0.05)
        found = [f for f in self.failures([]) if f.kind != "exception"] or self.failures([])
        return pick_failure(found) if found else Failure(gone[0].rank, gone[0].pid, 0.0, "exit")

    def _failed(self, problems: list[Failure], procs: list[WorkerProcess]) -> None:
        chosen = pick_failure(problems)
        failed = {f.rank for f in problems}
        stuck = [p for p in procs if p.returncode is None and p.rank not in self._done]
        stuck = [p for p in stuck if p.rank not in failed]
        if chosen.secondary and stuck:
            reason = (
                f"{chosen.summary()} (timeout={self.timeout}s) while rank(s) "
                f"{[p.rank for p in stuck]} had not reached that point"
            )
            tracebacks = {f.rank: f.info.get("traceback") or f.stack for f in problems}
            self._hang(stuck, reason, tracebacks)
        error = remote_exception(chosen)
        others = [f.summary() for f in problems if f is not chosen]
        if others:
            add_note(error, f"Also seen (after rank {chosen.rank} failed): " + "; ".join(others))
        if isinstance(error, RanksMissingError):  # who did not come, and what they do
            live = [p.rank for p in procs if p.returncode is None and p.rank not in self._done]
            counts = {r: d.collectives for r, d in self._done.items()}
            name_missing(error, chosen.rank, counts, live, self.probe)
        dead = [f for f in problems if f.kind != "exception"]
        if self.keep_failed:  # before the others are interrupted: where each one was
            finished = {r for r, done in self._done.items() if done.ok}
            self.post_mortem = FailedJob.at_failure(self, problems, chosen, procs, finished)
        self._end_early(procs, error, dead[0].summary() if dead else None)

    def _hang(self, stuck: list[WorkerProcess], reason: str, stacks: dict[int, str]) -> None:
        found = self.stacks([p.rank for p in stuck])
        error = WorkerTimeoutError(
            [p.rank for p in stuck], {**stacks, **found}, reason, stuck[0].pid
        )
        self._end_early([], error, f"rank(s) {[p.rank for p in stuck]} hung")

    def _end_early(
        self, procs: list[WorkerProcess], error: BaseException, broken: str | None = None
    ) -> None:
        """A one-shot group is terminated; a pool's busy ranks are interrupted and given
        time to come back. Raises JobFailed(error, why the workers cannot go on)."""
        if self.one_shot or broken:
            self.terminate(spare=self._lingering()) if self.one_shot else None
            raise JobFailed(error, broken or "one-shot")
        busy = [p for p in procs if p.rank not in self._done and p.returncode is None]
        for proc in busy:
            proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + self.INTERRUPT_GRACE
        with contextlib.suppress(KeyboardInterrupt):  # pressed again: stop waiting
            while time.monotonic() < deadline and any(p.rank not in self._done for p in busy):
                self.pump(0.05)
                if any(p.poll() is not None for p in self.procs.values()):
                    break
        stuck = [p.rank for p in busy if p.rank not in self._done]
        if stuck:
            failed = getattr(error, "rank", None)  # not the user's interrupt: say whose failure
            why = "an interrupt" if failed is None else f"the interrupt after rank {failed} failed"
            broken = (
                f"rank(s) {stuck} did not come back within {self.INTERRUPT_GRACE:g}s of {why} "
                "(stuck in a collective?)"
            )
        else:
            seqs = {r: d.collectives for r, d in self._done.items() if d.collectives is not None}
            if len(set(seqs.values())) > 1:
                counts = ", ".join(f"rank {r}: {s}" for r, s in sorted(seqs.items()))
                broken = (
                    f"the ranks ran different numbers of collectives ({counts}), so the "
                    "process group is out of step"
                )
        raise JobFailed(error, broken)

    def _lingering(self) -> set[int]:
        """debug=True: the failed ranks that stay for nbaccel.debug() (see ``_postmortem``)."""
        kept = self.post_mortem
        return (
            set() if kept is None else {r for r in kept.holding() if self.procs[r].poll() is None}
        )

    def _values(self, want: set[int]) -> dict[int, Any]:
        values = {}
        for rank in sorted(want):
            codec, data = self._done[rank].payload
            try:
                values[rank] = loads(codec, data)
            except Exception as err:
                raise JobFailed(
                    LaunchError(
                        f"rank {rank}'s return value could not be loaded in the kernel "
                        f"({type(err).__name__}: {err}); return plain data (numbers, tensors, "
                        "dicts, lists) from the training function."
                    ),
                    None,
                ) from err
        return values

    # ------------------------------------------------------------------ ending
    def wait_ready(self, seconds: float) -> None:
        """Until every worker said ready (rendezvous and agreement done); raise otherwise."""
        deadline = time.monotonic() + seconds
        while len(self.ready) < len(self.procs):
            self.pump(0.05)
            self._poll()
            problems = self.failures([])
            if problems:
                raise remote_exception(pick_failure(problems))
            if time.monotonic() > deadline:
                missing = sorted(set(self.procs) - self.ready)
                raise LaunchError(
                    f"worker(s) {missing} did not start within {seconds:g}s; the machine may "
                    "be overloaded. Try again, or pass timeout=... to start_workers."
                )


__all__ = ["JobFailed", "Supervisor"]
