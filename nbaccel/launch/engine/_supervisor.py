"""The one supervisor: the kernel's side of a group of workers, for every kind of launch.

:meth:`Supervisor.run_job` acts on the channel's messages (:mod:`..channel._messages`) by type and
waits for one job: after a first failure, ``GRACE`` for the others' reports, then the first
*real* failure is raised (a healthy rank's "connection closed by peer" counts only when
nothing else went wrong); ranks still busy ``timeout`` seconds after a peer finished hang
(their stacks go into a :class:`~nbaccel.errors.WorkerTimeoutError`); on an interrupt,
``stop()`` or a failure, a one-shot group is terminated while a pool's busy ranks get
SIGINT and ``INTERRUPT_GRACE`` to come back. Extras plug in as :class:`Hook` objects: the
hang watchdog and the subset check (:mod:`..debug._watchdog`), post-mortem (:mod:`..debug._kept`), a pdb
session's inbox (:mod:`.debugger`). The workers' pipes belong to the :class:`._group.Group`.

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
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn, TypeVar

from ...errors import LaunchError, RanksMissingError, Stopped, WorkerTimeoutError, named_ranks
from ..cell._output import LineForwarder
from ..channel._messages import Done, Event, Fatal, Hello, Imported, Probe, ProbeAnswer, Ready
from ..channel._wire import loads
from ._group import Group, WorkerProcess, remember_worker_imports
from ._tidy import Failure, add_note, fatal_stack, pick_failure, remote_exception

EventCallback = Callable[[int, str, dict], None]
NO_ANSWER = "(no answer: not running Python code)"
H = TypeVar("H", bound="Hook")


class JobFailed(Exception):
    """A job ended badly: ``error`` is for the user; ``broken`` says why the workers
    cannot go on (None: they can)."""

    def __init__(self, error: BaseException, broken: str | None) -> None:
        super().__init__(str(error))
        self.error, self.broken = error, broken


class Hook:
    """An extra that plugs into the supervisor (its subclass overrides what it needs)."""

    def started(self, sup: Supervisor, ranks: list[int]) -> None:
        """A job starts on ``ranks``."""

    def message(self, sup: Supervisor, rank: int, message: object) -> None:
        """A message from ``rank``'s channel, after the supervisor acted on it."""

    def look(self, sup: Supervisor, busy: list[int], done: Mapping[int, Done]) -> JobFailed | None:
        """A turn of the job's loop (``busy``: its live ranks that have not finished, ``done``:
        the answers so far); a :class:`JobFailed` returned ends the job with it."""
        return None

    def failed(
        self, sup: Supervisor, problems: list[Failure], chosen: Failure, finished: set[int]
    ) -> None:
        """The job fails (``chosen`` is raised); the other ranks are not interrupted yet."""

    def spared(self, sup: Supervisor) -> set[int]:
        """Ranks a one-shot group leaves running when its job ends early."""
        return set()


class Supervisor:
    """Owns a group of started workers: runs jobs on them, ends them."""

    GRACE = 1.0  # seconds to collect the other ranks' reports after a first failure
    INTERRUPT_GRACE = 3.0  # seconds an interrupted pool rank gets to come back

    def __init__(
        self,
        procs: list[WorkerProcess],
        forwarder: LineForwarder,
        *,
        timeout: float | None,
        interval: float,
        on_event: EventCallback,
        one_shot: bool,
        hooks: Iterable[Hook] = (),
    ) -> None:
        self.workers = group = Group(procs, forwarder, self._handle, on_event)
        # the group's ends, as every launch and pool reaches them
        self.procs, self.on_event, self.pump = group.procs, on_event, group.pump
        self.drain, self.terminate = group.drain, group.terminate
        self.close, self.shutdown = group.close, group.shutdown
        self.timeout, self.interval, self.one_shot = timeout, interval, one_shot
        self.hooks = list(hooks)
        self.ready: set[int] = set()
        self._ids = itertools.count(2)  # 1 is the first job, made before the group started
        self._job: int | None = None
        self._done: dict[int, Done] = {}  # this job's answers, by rank
        self._done_at: dict[int, float] = {}
        self._errors: dict[int, Failure] = {}  # this job's failed ranks
        self._fatal: dict[int, Failure] = {}
        self._answers: dict[int, dict[int, dict[str, Any]]] = {}
        self._reader: threading.Thread | None = None  # the thread in run_job, reading

    def named(self, ranks: Iterable[int]) -> str:
        """``ranks`` as messages name them (on a cluster: each one's pid and node)."""
        procs = [self.procs[r] for r in ranks]
        return named_ranks(
            [p.rank for p in procs], {p.rank: p.pid for p in procs},
            {p.rank: p.node for p in procs if p.node},
        )  # fmt: skip

    def hook(self, kind: type[H]) -> H | None:
        return next((h for h in self.hooks if isinstance(h, kind)), None)

    def _handle(self, proc: WorkerProcess, message: object) -> None:
        rank = proc.rank
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
                    self._errors[rank] = self._raised(rank, message.payload)
            case Fatal(info=info):
                self._fatal[rank] = self._raised(rank, info)
            case ProbeAnswer(request=request) if request in self._answers:
                self._answers[request][rank] = message.report
        for hook in self.hooks:
            hook.message(self, rank, message)

    # ------------------------------------------------------------------ looking inside
    def probe(
        self, ranks: Iterable[int], wait: float = 1.0, *, flight: bool = False
    ) -> dict[int, dict[str, Any]]:
        """What each rank's main thread does now (:func:`..worker._worker_os.main_thread_report`),
        answered also while it is blocked in C++. From another thread than the job's (a
        monitor's button) it only asks: the job's thread reads the answers."""
        asked = [self.procs[r] for r in ranks if self.procs[r].returncode is None]
        request = next(self._ids)
        answers = self._answers[request] = {}
        for proc in asked:
            with contextlib.suppress(OSError, AttributeError):
                proc.channel.send(Probe(request, flight))  # type: ignore[union-attr]
        deadline = time.monotonic() + wait
        while len(answers) < len(asked) and time.monotonic() < deadline:
            if self._reader in (None, threading.current_thread()):  # else that thread reads
                self.pump(0.05)
            else:
                time.sleep(0.05)
        return self._answers.pop(request)

    def stacks(self, ranks: Iterable[int]) -> dict[int, str]:
        """Each rank's stack now (see :meth:`probe`)."""
        answers = self.probe(ranks)
        return {r: answers[r]["stack"] if r in answers else NO_ANSWER for r in ranks}

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
        self._job, self._done, self._done_at, self._errors = job, {}, {}, {}
        self._reader = threading.current_thread()
        procs = [self.procs[r] for r in ranks]
        first_problem: float | None = None
        for hook in self.hooks:
            hook.started(self, ranks)
        try:
            while True:
                self.pump(self.interval)
                now = time.time()
                self.workers.poll()
                if stop.is_set():
                    self.end_early(procs, Stopped("the run was stopped with stop()"))
                busy = [p for p in procs if p.rank not in self._done]
                if problems := self.failures(procs):
                    first_problem = first_problem or now
                    waiting = [p for p in busy if p.returncode is None]
                    if waiting and now - first_problem < self.GRACE:
                        continue
                    self._failed(problems, procs)
                if not busy and (not self.one_shot or all(self.workers.exited(p) for p in procs)):
                    return self._values(want)
                stuck = [p.rank for p in busy if p.returncode is None]
                for hook in self.hooks:
                    if (ending := hook.look(self, stuck, self._done)) is not None:
                        self.end_early(procs, ending.error, ending.broken)
                finished = [self._done_at[r] for r, done in self._done.items() if done.ok]
                if self.timeout and finished and stuck and now - min(finished) > self.timeout:
                    reason = (
                        f"rank(s) {sorted(self._done)} finished more than timeout="
                        f"{self.timeout:g}s ago and these ranks are still running (waiting "
                        "for a peer that is gone?)"
                    )
                    self.hung(stuck, reason, {})
        except KeyboardInterrupt:
            self.end_early(procs, KeyboardInterrupt())
        finally:
            self._reader = None
        raise AssertionError("unreachable")  # pragma: no cover

    def _raised(self, rank: int, info: dict[str, Any]) -> Failure:
        """``rank`` raised (its report: ``info``): its state is "failed" from now on."""
        proc = self.procs[rank]
        failure = Failure(rank, proc.pid, info.get("time", 0.0), "exception", info, node=proc.node)
        self.on_event(rank, "state", {"state": "failed", "error": failure.summary()})
        return failure

    def failures(self, procs: list[WorkerProcess]) -> list[Failure]:
        """The job's failed ranks, and every rank of the group that failed or died."""
        out = [self._errors[p.rank] for p in procs if p.rank in self._errors]
        out += [f for r, f in self._fatal.items() if r not in {f.rank for f in out}]
        for proc in self.procs.values():
            if not self.workers.exited(proc) or proc.rank in {f.rank for f in out}:
                continue
            assert proc.exit_time is not None and proc.returncode is not None
            if proc.returncode < 0:
                stack = fatal_stack(self.workers.tail(proc.rank))
                code = -proc.returncode
                out.append(
                    Failure(
                        proc.rank,
                        proc.pid,
                        proc.exit_time,
                        "signal",
                        code=code,
                        stack=stack,
                        node=proc.node,
                    )
                )
            elif not self.one_shot or proc.returncode > 0 or proc.rank not in self._done:
                code = proc.returncode
                out.append(
                    Failure(proc.rank, proc.pid, proc.exit_time, "exit", code=code, node=proc.node)
                )
        return out

    def dead(self) -> Failure | None:
        """How a worker that died while the group was idle died (None: all alive)."""
        self.workers.poll()
        if not (gone := [p for p in self.procs.values() if p.returncode is not None]):
            return None
        deadline = time.time() + 1.0  # its last output, messages and stack arrive first
        while time.time() < deadline and not all(self.workers.exited(p) for p in gone):
            self.pump(0.05)
        found = [f for f in self.failures([]) if f.kind != "exception"] or self.failures([])
        first = gone[0]
        return (
            pick_failure(found)
            if found
            else Failure(first.rank, first.pid, 0.0, "exit", node=first.node)
        )

    def _failed(self, problems: list[Failure], procs: list[WorkerProcess]) -> None:
        chosen = pick_failure(problems)
        live = [p.rank for p in procs if p.returncode is None and p.rank not in self._done]
        stuck = [r for r in live if r not in {f.rank for f in problems}]
        if chosen.secondary and stuck:
            reason = (
                f"{chosen.summary()} (timeout={self.timeout}s) while {self.named(stuck)} had "
                "not reached that point"
            )
            tracebacks = {f.rank: f.info.get("traceback") or f.stack for f in problems}
            self.hung(stuck, reason, tracebacks)
        error = remote_exception(chosen)
        if others := [f.summary() for f in problems if f is not chosen]:
            after = self.procs[chosen.rank].named if chosen.rank in self.procs else chosen.rank
            add_note(error, f"Also seen (after {after} failed): " + "; ".join(others))
        if isinstance(error, RanksMissingError):  # who did not come, and what they do
            self._name_missing(error, chosen.rank, live)
        dead = [f for f in problems if f.kind != "exception"]
        finished = {r for r, done in self._done.items() if done.ok}
        for hook in self.hooks:  # before the others are interrupted: where each one is
            hook.failed(self, problems, chosen, finished)
        self.end_early(procs, error, dead[0].summary() if dead else None)

    def _name_missing(self, error: RanksMissingError, rank: int, live: list[int]) -> None:
        """Name the ranks that did not come to the collective ``rank`` failed in, and note what
        each does (its stack, or that it finished or is gone); ``live``: the job's ranks still
        running. A barrier's error names them already; for gather, reduce, broadcast... they
        are the ranks that had issued fewer collectives than ``rank``: they never called it."""
        answers = self.probe(live) if live else {}
        done = {r: d.collectives for r, d in self._done.items()}
        if not error.missing:
            counts = done | {r: a.get("collectives") for r, a in answers.items()}
            if (mine := counts.get(rank)) is not None:
                error.missing = sorted(r for r, n in counts.items() if n is not None and n < mine)
        if error.missing:
            lines = [
                f"Rank(s) {error.missing} did not come. What the rank(s) that did not come are doing:"
            ]
            for r in error.missing:
                state = "finished the job" if r in done else "no longer running"
                where = f"\n{answers[r]['stack'].rstrip()}" if r in answers else f" {state}"
                lines.append(f"--- {self.procs[r].named}:{where}")
            add_note(error, "\n".join(lines))

    def hung(self, stuck: list[int], reason: str, stacks: dict[int, str]) -> NoReturn:
        """``stuck`` ranks hang: the job ends with their stacks now (over ``stacks``)."""
        found = self.stacks(stuck)
        nodes = {r: p.node for r, p in self.procs.items() if p.node}  # a cluster's ranks
        pids = {r: p.pid for r, p in self.procs.items()}
        error = WorkerTimeoutError(
            stuck, {**stacks, **found}, reason, self.procs[stuck[0]].pid, nodes, pids
        )
        self.end_early([], error, f"rank(s) {stuck} hung")

    def end_early(
        self, procs: list[WorkerProcess], error: BaseException, broken: str | None = None
    ) -> NoReturn:
        """A one-shot group is terminated; a pool's busy ranks are interrupted and given
        time to come back. Raises JobFailed(error, why the workers cannot go on)."""
        if self.one_shot or broken:
            spared = {r for hook in self.hooks for r in hook.spared(self)}
            self.terminate(spare=spared) if self.one_shot else None
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
            who = self.procs[failed].named if failed in self.procs else f"rank {failed}"
            why = "an interrupt" if failed is None else f"the interrupt after {who} failed"
            broken = (
                f"{self.named(stuck)} did not come back within {self.INTERRUPT_GRACE:g}s of "
                f"{why} (stuck in a collective?)"
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

    def _values(self, want: set[int]) -> dict[int, Any]:
        values = {}
        for rank in sorted(want):
            codec, data = self._done[rank].payload
            try:
                values[rank] = loads(codec, data)
            except Exception as err:
                error = LaunchError(
                    f"rank {rank}'s return value could not be loaded in the kernel "
                    f"({type(err).__name__}: {err}); return plain data (numbers, tensors, "
                    "dicts, lists) from the training function."
                )
                raise JobFailed(error, None) from err
        return values

    # ------------------------------------------------------------------ ending
    def wait_ready(self, seconds: float) -> None:
        """Until every worker said ready (rendezvous and agreement done); raise otherwise."""
        deadline = time.monotonic() + seconds
        while len(self.ready) < len(self.procs):
            self.pump(0.05)
            self.workers.poll()
            if problems := self.failures([]):
                raise remote_exception(pick_failure(problems))
            if time.monotonic() > deadline:
                missing = sorted(set(self.procs) - self.ready)
                raise LaunchError(
                    f"worker(s) {missing} did not start within {seconds:g}s; the machine may "
                    "be overloaded. Try again, or pass timeout=... to start_workers."
                )


__all__ = ["JobFailed", "Supervisor"]
