"""What the kernel and a worker say to each other: one small frozen dataclass per message.

Each side acts on a message by its type and ignores a type it does not act on; the file's
two sections hold the kernel's messages to a worker, and a worker's to the kernel.

Example:
    >>> Job(1, "call", {0}, (print, (), {})).kind
    'call'
    >>> Done(1, True, ("none", b""), 0).ok
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# ------------------------------------------------------------------ kernel to worker


@dataclass(frozen=True)
class Setup:
    """A spawned worker's first frame: its spec, the kernel's ``sys.path``, cell sources."""

    spec: Any  # a _worker.WorkerSpec
    sys_path: list[str]
    sources: dict[str, Any]


@dataclass(frozen=True)
class Job:
    """Run ``kind`` (an entry of ``_jobs.JOBS``) with ``body``; ship the values of ``want``."""

    id: int
    kind: str
    want: set[int]
    body: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Probe:
    """What is the main thread doing? Answered at once by the channel's reader thread;
    ``flight``: with the last collective torch's flight recorder holds (a dump: asked for
    only when the watchdog reports)."""

    request: int
    flight: bool = False


@dataclass(frozen=True)
class Debug:
    """Start pdb session ``sid`` on the last failed job's traceback."""

    sid: int


@dataclass(frozen=True)
class PdbLine:
    """A line typed at session ``sid``'s prompt (ends in a newline; ``""`` ends it)."""

    sid: int
    line: str


@dataclass(frozen=True)
class Exit:
    """Leave: the exit barrier, the process group torn down, the process gone."""


# ------------------------------------------------------------------ worker to kernel


@dataclass(frozen=True)
class Hello:
    """The worker runs (its pid, as it sees itself)."""

    pid: int


@dataclass(frozen=True)
class Ready:
    """Rendezvous and agreement done: jobs may come."""


@dataclass(frozen=True)
class Event:
    """A published tracking event (progress, log, steps...) and when it happened."""

    kind: str
    data: dict[str, Any]
    time: float


@dataclass(frozen=True)
class Imported:
    """A job imported ``modules`` after the fork: the kernel pre-imports them next time."""

    modules: list[str]


@dataclass(frozen=True)
class Done:
    """Job ``job`` ended: its value (``dumps``' pair) or its error (``error_info``), and
    the number of collectives this rank ran (ranks out of step show there)."""

    job: int
    ok: bool
    payload: Any
    collectives: int | None


@dataclass(frozen=True)
class Fatal:
    """Set-up, rendezvous or agreement failed (``error_info``): the worker leaves."""

    info: dict[str, Any]


@dataclass(frozen=True)
class ProbeAnswer:
    """Where the main thread is (``_worker_os.main_thread_report``, plus the counts)."""

    request: int
    report: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PdbOutput:
    """Session ``sid``: pdb wrote ``text`` and ``ask``\\s for a line at ``prompt``; it
    ``end``\\ed; or there is ``none`` (no failed job kept here)."""

    sid: int
    kind: Literal["ask", "end", "none"]
    text: str
    prompt: str = ""


__all__ = [
    "Debug",
    "Done",
    "Event",
    "Exit",
    "Fatal",
    "Hello",
    "Imported",
    "Job",
    "PdbLine",
    "PdbOutput",
    "Probe",
    "ProbeAnswer",
    "Ready",
    "Setup",
]
