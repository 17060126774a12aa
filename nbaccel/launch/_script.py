"""``nbaccel launch``'s engine: a script on every process, supervised as a notebook launch.

The same start, supervisor, channel and worker loop as ``notebook_launcher``; the job
is ``script`` (the file or module runs as ``__main__``, as under ``python``) and the
exit code is the script's (the first real failure's: its own code, 1 for an uncaught
exception, 128 + N after signal N). The workers end when this process ends, also by
SIGKILL: their channel reaches its end (and, on Linux, the parent-death signal).

Example:
    >>> from nbaccel.config import LaunchConfig
    >>> run_script(LaunchConfig(num_processes=2), ["train.py", "--lr", "3e-4"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import sys
import threading

from ..config import LaunchConfig
from ..errors import WorkerError
from ._preflight import plan_script
from ._start import start_group
from ._supervisor import JobFailed


def run_script(cfg: LaunchConfig, command: list[str]) -> int:
    """Run ``command`` (``[-m] script_or_module args...``) on ``cfg``'s processes; return
    the exit code. Prints which rank failed on stderr."""
    plan = plan_script(cfg)
    stop = threading.Event()
    for attempt in range(cfg.max_restarts + 1):
        if attempt:
            print(f"nbaccel launch: restarting, attempt {attempt} of {cfg.max_restarts}",
                  file=sys.stderr)  # fmt: skip
        job: tuple[object, ...] = ("job", 1, "script", set(), list(command))
        try:
            group = start_group(plan, on_event=_ignore, round_=attempt, first_job=job)
        except KeyboardInterrupt:
            return 130
        try:
            group.run_job(1, plan.ranks, set(), stop)
            return 0
        except JobFailed as failed:
            code = _exit_code(failed.error)
        finally:
            group.terminate()
            group.close()
        if code == 130:
            return code
    return code


def _exit_code(error: BaseException) -> int:
    if isinstance(error, KeyboardInterrupt):
        return 130
    if isinstance(error, WorkerError):
        code = error.exit_code or 1
        if error.exc_type in ("SystemExit", "ExitCode") or error.exc_type.startswith("SIG"):
            detail = f"exited with code {code}"
        else:  # the traceback is on stderr already, as python prints it
            detail = f"failed with {error.exc_type}: {error.message.splitlines()[0] if error.message else ''}"
        print(f"nbaccel launch: rank {error.rank} (pid {error.pid}) {detail}", file=sys.stderr)
        return code
    print(f"nbaccel launch: {error}", file=sys.stderr)
    return 1


def _ignore(rank: int, kind: str, data: dict) -> None:
    """A script's events have no live view in a terminal."""


__all__ = ["run_script"]
