"""The hang watchdog: a job whose ranks wait on each other without progress is reported.

:class:`HangWatch` plugs it into the supervisor (one :class:`Watchdog` per job); every
``look_every`` seconds (``hang_after / 8``, 0.25 to 15 s) it probes the busy ranks (their
stack, the torch.distributed call they are in, their collective count).

**Progress** between two looks: a rank's count of collectives on the default group changed,
a rank published an event (``Accelerator.log``, a step, a tqdm redraw), or one finished.

**Forming** the process group (torch's rendezvous and group set-up, the ``Accelerator``'s
first collectives) is not judged: the launch's ``timeout`` bounds it; the still time starts
when every busy rank has left it.

**Hung**: no progress for ``hang_after`` seconds while a busy rank waits on a peer (it is in
a torch.distributed call, or issued more collectives than another), or while every busy rank
sits idle inside a C++ call of torch's with equal counts (a collective called differently on
different ranks). A long computation without collectives is not hung. The report adds each
rank's last collective from torch's flight recorder and names one called differently.
**Waiting, not stuck**: a rank outside torch.distributed whose CPU time advanced by
``BUSY_SHARE`` of the last ``hang_after`` seconds is working; the others "wait for rank N,
which is busy in <frame>", and nothing is ended whatever ``on_hang`` says.

``on_hang="report"`` writes the report where the job's output goes and publishes a ``"hang"``
event per stuck rank; it comes again after 2, 4, 8, ... times ``hang_after``. ``"raise"``
ends the job with a :class:`~nbaccel.errors.WorkerTimeoutError`.

Example:
    >>> policy = HangPolicy(after=300.0)
    >>> policy.look_every, HangPolicy(after=2.0).look_every
    (15.0, 0.25)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...config import LaunchConfig
from ...errors import LaunchError, WorkerTimeoutError, named_rank, named_ranks
from ..channel._messages import Done, Event
from ..engine._supervisor import NO_ANSWER, Hook, JobFailed, Supervisor

DEFAULT_HANG_AFTER: float = LaunchConfig.hang_after  # the field's default (why: see there)

#: The share of one CPU a rank must use between two looks to count as working.
BUSY_SHARE = 0.05


@dataclass(frozen=True)
class HangPolicy:
    """``after`` seconds without progress (0: off) and what then: "report" or "raise"."""

    after: float = DEFAULT_HANG_AFTER
    action: str = "report"

    @classmethod
    def of(cls, config: Any) -> HangPolicy:  # a LaunchConfig's
        return cls(float(config.hang_after), str(config.on_hang))

    @property
    def look_every(self) -> float:
        return min(max(self.after / 8, 0.25), 15.0)


@dataclass
class Hang:
    """What a look found: the busy ranks, why they are stuck, their stacks."""

    ranks: list[int]
    reason: str
    stacks: dict[int, str]
    calls: dict[int, str | None]
    seconds: float
    next_report: float  # seconds until it is reported again
    busy: list[int] = field(default_factory=list)  # working ranks the others wait for
    pids: dict[int, int] = field(default_factory=dict)  # said with the nodes, on a cluster
    nodes: dict[int, str] = field(default_factory=dict)  # rank -> its node, on a cluster

    def text(self) -> str:
        """The report as the cell or terminal shows it."""
        if self.busy:
            return f"nbaccel: {self.reason}\n" + "".join(
                f"--- where {named_rank(r, self.pids.get(r), self.nodes.get(r))} is ---\n"
                f"{self.stacks[r]}\n"
                for r in self.busy
            )
        error = WorkerTimeoutError(
            self.ranks, self.stacks, self.reason, nodes=self.nodes, pids=self.pids
        )
        return (
            f"nbaccel: {error}\n"
            f"nbaccel: the job keeps running (on_hang='report'); if nothing moves it is "
            f"reported again in {self.next_report:g}s. Stop it with the interrupt button "
            "(Ctrl-C in a terminal) or handle.stop(); on_hang='raise' ends such a job with "
            "WorkerTimeoutError, hang_after=0 turns this watchdog off. Ranks calling "
            "different collectives? debug_collectives=True makes torch check every call.\n"
        )


class Watchdog:
    """One job's watchdog (see the module's docstring for the rules)."""

    def __init__(
        self,
        policy: HangPolicy,
        probe: Callable[..., dict[int, dict[str, Any]]],  # (ranks, *, flight=False) -> answers
        now: float | None = None,
        cpu: Callable[[list[int]], dict[int, float | None]] | None = None,
        *,
        pids: Mapping[int, int] | None = None,
        nodes: Mapping[int, str] | None = None,
    ) -> None:
        # cpu: each rank's CPU seconds read from the OS, so that a rank too busy to answer
        # the probe in time (a loaded machine, a long C call holding the GIL) still counts
        # as working; without it, the answers' "cpu" is used. pids and nodes: where each
        # rank runs, named in every line about it when that is another machine (a cluster)
        self.policy, self._probe, self._cpu_of = policy, probe, cpu
        self._pids, self._nodes = dict(pids or {}), dict(nodes or {})
        self._next_look = (time.monotonic() if now is None else now) + policy.look_every
        self._seen: tuple[Any, ...] | None = None
        self._since = 0.0  # when the last progress was seen
        # reports since then, of ranks stuck and of ranks waiting for a working one: each
        # backs off on its own (a rank reported working, then stopped, is stuck at the next
        # look that finds it so, not after the working reports' back-off)
        self._reports = {"stuck": 0, "busy": 0}
        self._counts: dict[int, int | None] = {}  # last known collective count per rank
        # (when, rank -> cpu seconds) at each look since the stillness began, from the last
        # one at least `after` seconds old on (the working judgment's window)
        self._cpu: list[tuple[float, dict[int, float]]] = []

    def look(
        self,
        busy: list[int],
        finished: Mapping[int, int | None],
        activity: int,
        now: float | None = None,
    ) -> Hang | None:
        """Probe ``busy`` (live, unfinished) ranks when a look is due; the hang found, once
        per back-off step, or None. ``finished``: rank -> collective count of the ranks done;
        ``activity``: events and answers received so far."""
        now = time.monotonic() if now is None else now
        if self.policy.after <= 0 or not busy or now < self._next_look:
            return None
        self._next_look = now + self.policy.look_every
        answers = self._probe(busy)
        cpu = {r: a.get("cpu") for r, a in answers.items()}
        if self._cpu_of:  # from the OS: also for ranks that did not answer
            cpu |= {r: c for r, c in self._cpu_of(busy).items() if c is not None}
        self._counts |= {r: answers[r].get("collectives") for r in busy if r in answers}
        counts = {r: self._counts.get(r) for r in busy} | dict(finished)
        signature = (activity, tuple(sorted(busy)), tuple(sorted(counts.items())))
        if any(a.get("forming") for a in answers.values()):
            # a rank still forms the process group: the launch's timeout bounds that (and
            # names the rank that never came); the still time starts once it is formed
            self._seen, self._cpu = None, []
            return None
        if signature != self._seen:
            self._seen, self._since, self._reports = signature, now, {"stuck": 0, "busy": 0}
            self._cpu = [(now, {r: c for r, c in cpu.items() if c is not None})]
            return None
        working = self._working(cpu, now)
        idle = now - self._since
        if idle < self.policy.after * (2 ** (min(self._reports.values()) + 1) - 1):
            return None
        calls = {r: (answers.get(r, {}).get("waiting") or {}).get("call") for r in busy}
        known = {r: c for r, c in counts.items() if c is not None}
        ahead = max(known.values(), default=0)
        waits = any(calls.values()) or len(set(known.values())) > 1
        working = [r for r in working if not calls[r]]
        blocked = {r: answers.get(r, {}).get("in_torch") for r in busy}
        if not waits and (working or not all(blocked.values())):
            return None  # nobody waits on a peer: a long computation, not a hang
        if working and not (waiting := [r for r in busy if r not in working]):
            return None
        kind = "busy" if working else "stuck"
        if idle < self.policy.after * (2 ** (self._reports[kind] + 1) - 1):
            return None
        self._reports[kind] += 1
        again = self.policy.after * 2 ** self._reports[kind]
        stacks = {r: answers[r]["stack"] if r in answers else NO_ANSWER for r in working or busy}
        name = self._named
        if working:  # the others wait for ranks that compute: reported, never ended
            where = ", ".join(
                f"{name(r)}, which is busy in {answers.get(r, {}).get('frame') or 'its code'}"
                for r in working
            )
            lines = [
                f"{named_ranks(waiting, self._pids, self._nodes)} wait for {where} (no "
                f"progress for {idle:.0f}s, but its CPU time advances: it works, it is not "
                "stuck; the job goes on whatever on_hang says)."
            ]
            lines += [f"  {name(r)}: waiting in {calls[r]}" for r in waiting if calls.get(r)]
            return Hang(
                sorted(waiting + working), "\n".join(lines), stacks, calls, idle, again, working,
                self._pids, self._nodes,
            )  # fmt: skip
        # torch's flight recorder: each rank's last collective (a dump: asked for only now)
        flights = {r: a.get("flight") for r, a in self._probe(busy, flight=True).items()}
        lines = [
            f"no progress for {idle:.0f}s (hang_after={self.policy.after:g}s: no collective "
            "issued, nothing logged, no rank finished), and ranks wait on each other:"
        ]
        for rank in sorted(counts):
            if rank in finished:
                state = "finished its part of the job"
            elif calls[rank]:
                state = f"waiting in {calls[rank]}"
            elif rank not in answers:
                state = "did not answer (busy outside Python, e.g. in a C++ call)"
            elif blocked.get(rank):
                state = f"idle inside {blocked[rank]} (a collective in C++ that cannot complete?)"
            else:
                state = "not in a torch.distributed call (running Python code)"
            if known.get(rank, ahead) < ahead:
                state += f"; issued {known[rank]} collectives, others {ahead}"
            if last := flights.get(rank):
                state += f"; last collective #{last['seq']}: {last['call']} of {last['sizes']}"
            lines.append(f"  {name(rank)}: {state}")
        if differs := mismatch(flights, name):
            lines.append(differs)
        elif not waits:
            lines.append(
                "  every rank issued the same number of collectives and sits idle in torch: "
                "a collective called differently on different ranks (shapes, or another "
                "call)? debug_collectives=True makes torch name the mismatch."
            )
        return Hang(
            sorted(busy), "\n".join(lines), stacks, calls, idle, again, [], self._pids, self._nodes
        )

    def _named(self, rank: int) -> str:
        return named_rank(rank, self._pids.get(rank), self._nodes.get(rank))

    def _working(self, cpu_seconds: Mapping[int, float | None], now: float) -> list[int]:
        """The ranks whose CPU time advanced by ``BUSY_SHARE`` of the last ``after`` seconds
        of the stillness (a window of many looks, not one: a loaded machine's noise, or the
        probe's own answer, averages out). Not of the whole stillness: a rank that computed
        for a second after the last progress, then stopped, was judged working for 20
        seconds more (``on_hang="raise"`` came at 3 to 7 times ``hang_after``)."""
        seen = {r: cpu for r, cpu in cpu_seconds.items() if cpu is not None}
        self._cpu.append((now, seen))
        # the last look at least `after` old starts the window (the stillness's first, if none)
        start = max((i for i, (at, _) in enumerate(self._cpu) if at <= now - self.policy.after),
                    default=0)  # fmt: skip
        del self._cpu[:start]
        working = []
        for rank, cpu in seen.items():
            at, was = next(((at, c[rank]) for at, c in self._cpu if rank in c), (now, cpu))
            if cpu - was >= BUSY_SHARE * (now - at) > 0:
                working.append(rank)
        return working


class HangWatch(Hook):
    """The watchdog as the supervisor's hook: progress is counted from the messages, each
    job gets a fresh :class:`Watchdog` under ``policy`` (a pool call may set its own)."""

    def __init__(self, policy: HangPolicy) -> None:
        self.policy, self.activity = policy, 0  # activity: events and answers received
        self._dog: Watchdog | None = None

    def started(self, sup: Supervisor, ranks: list[int]) -> None:
        def cpu(ranks: list[int]) -> dict[int, float | None]:  # working or stuck? (psutil)
            return {r: sup.procs[r].cpu_seconds() for r in ranks}

        nodes = {r: p.node for r, p in sup.procs.items() if p.node}  # a cluster's ranks
        pids = {r: p.pid for r, p in sup.procs.items()}
        self._dog = Watchdog(self.policy, sup.probe, cpu=cpu, pids=pids, nodes=nodes)

    def message(self, sup: Supervisor, rank: int, message: object) -> None:
        self.activity += isinstance(message, (Event, Done))

    def look(self, sup: Supervisor, busy: list[int], done: Mapping[int, Done]) -> JobFailed | None:
        assert self._dog is not None
        seqs = {r: d.collectives for r, d in done.items()}
        hang = self._dog.look(busy, seqs, self.activity)
        if hang is not None and self._dog.policy.action == "raise" and not hang.busy:
            sup.hung(busy, hang.reason, hang.stacks)
        if hang is not None:  # where the job's output goes; one "hang" event per stuck rank
            sup.workers.forwarder.note(hang.ranks[0], hang.text())
            for rank in [] if hang.busy else hang.ranks:
                data = {"seconds": hang.seconds, "call": hang.calls.get(rank), "time": time.time()}
                sup.on_event(rank, "hang", data)
        return None


class SubsetCheck(Hook):
    """A job on some of the group's ranks (``%%distributed --ranks 0``): every
    ``PROBE_EVERY`` seconds its busy ranks are probed; one inside a call that needs a rank
    not running the job can never complete: the job ends with an error naming them."""

    PROBE_EVERY = 0.5

    def __init__(self) -> None:
        self._ranks: list[int] = []
        self._last = 0.0

    def started(self, sup: Supervisor, ranks: list[int]) -> None:
        self._ranks, self._last = ranks, time.monotonic()

    def look(self, sup: Supervisor, busy: list[int], done: Mapping[int, Done]) -> JobFailed | None:
        idle = [r for r in sup.procs if r not in self._ranks]
        if not idle or not busy or time.monotonic() - self._last <= self.PROBE_EVERY:
            return None
        self._last = time.monotonic()
        for rank, report in sup.probe(busy, wait=0.5).items():
            waiting = report.get("waiting") or {"ranks": []}
            missing = sorted(set(idle if waiting["ranks"] is None else waiting["ranks"]) & {*idle})
            if missing:
                who = sup.procs[rank].named
                return JobFailed(LaunchError(
                    f"{who} entered {waiting['call']} (a call that needs rank(s) {missing} "
                    f"too) in a job run on rank(s) {self._ranks} only: rank(s) {missing} do not "
                    "run it, so it can never complete. Run the cell on every rank (without "
                    "--ranks), or keep collectives out of cells run on some ranks.\n--- where "
                    f"{who} was ---\n{report['stack']}"
                ), None)  # fmt: skip
        return None


def mismatch(
    flights: Mapping[int, dict[str, Any] | None], name: Callable[[int], str] = named_rank
) -> str | None:
    """Ranks at the same collective of a group (torch's flight recorder: its sequence
    number) with different calls or sizes: the line saying so (None: none found); ``name``
    names a rank (on a cluster: with its node)."""
    at: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for rank, last in flights.items():
        if last:
            at.setdefault((last["group"], last["seq"]), {})[rank] = last
    for (group, seq), ranks in sorted(at.items()):
        if len({(last["call"], str(last["sizes"])) for last in ranks.values()}) > 1:
            calls = ", ".join(f"{name(r)}: {c['call']} of {c['sizes']}" for r, c in ranks.items())
            return (
                f"  torch's flight recorder: collective #{seq} of {group} is called differently "
                f"on different ranks ({calls}), so it can never complete."
            )
    return None


__all__ = ["DEFAULT_HANG_AFTER", "Hang", "HangPolicy", "HangWatch", "SubsetCheck", "Watchdog"]
