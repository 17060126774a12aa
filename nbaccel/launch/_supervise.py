"""Watch running workers from the kernel until they finish, fail, hang or are stopped.

One loop multiplexes every worker pipe with ``selectors``: stdout/stderr lines
go to the :class:`~nbaccel.launch._output.LineForwarder`, control frames carry
hello/event/result/error messages, the stack pipe collects faulthandler dumps.
Exits are reaped with ``waitpid``.

Decisions:

* a failure (error frame, death by signal, non-zero exit) starts a short grace
  period so that the others' reports arrive; then the *first real* failure is
  raised (secondary "connection closed by peer"/timeout errors of healthy ranks
  only count when nothing else went wrong);
* if only secondary failures arrived while other ranks are still running, or
  if ranks are still running ``timeout`` seconds after a peer finished, those
  ranks are stuck: their Python stacks are dumped (``SIGUSR1`` -> faulthandler)
  and a :class:`~nbaccel.launch._failures.WorkerTimeoutError` names them;
* on any exit path every worker is terminated (SIGTERM, then SIGKILL after 1 s),
  its descendants killed, every child reaped and every pipe closed. A
  ``KeyboardInterrupt`` in the kernel does the same and propagates.

Example:
    >>> from nbaccel.launch._supervise import Supervisor
    >>> Supervisor.GRACE
    1.0
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import LaunchError, Stopped
from ._bootstrap import STACK_SIGNAL
from ._failures import Failure, WorkerTimeoutError, add_note, pick_failure, remote_exception
from ._output import LineForwarder
from ._preload import IMPORTED_EVENT, remember_worker_imports
from ._spawn import WorkerProcess
from ._wire import FrameReader, loads

EventCallback = Callable[[int, str, dict], None]


class Supervisor:
    """Supervises one attempt: ``run()`` returns ``{rank: value}`` or raises."""

    GRACE = 1.0  # seconds to collect the other ranks' reports after a first failure
    DRAIN = 0.5  # seconds to wait for output after the last worker exited

    def __init__(
        self,
        procs: list[WorkerProcess],
        forwarder: LineForwarder,
        *,
        timeout: float | None,
        interval: float,
        want: set[int],
        on_event: EventCallback,
    ) -> None:
        self.procs, self.forwarder = procs, forwarder
        self.timeout, self.interval, self.want, self.on_event = timeout, interval, want, on_event
        self.stop_requested = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._frames = {p.rank: FrameReader() for p in procs}
        self._stacks: dict[int, bytearray] = {p.rank: bytearray() for p in procs}
        self._results: dict[int, tuple[str, bytes]] = {}
        self._errors: dict[int, Failure] = {}
        self._open: set[int] = set()
        for proc in procs:
            for name, fd in proc.fds.items():
                self._selector.register(fd, selectors.EVENT_READ, (proc, name))
                self._open.add(fd)

    # ------------------------------------------------------------------ reading
    def _pump(self, wait: float) -> None:
        if not self._open:
            # Every pipe hit EOF, so the workers are exiting (the kernel closes their fds
            # after unmapping their memory, so reaping follows within a millisecond or two):
            # poll for their exit often instead of sleeping a whole interval.
            time.sleep(min(wait, 0.001))
            return
        for key, _ in self._selector.select(wait):
            proc, name = key.data
            try:
                data = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self._close_fd(key.fd, proc, name)
            elif name in ("stdout", "stderr"):
                self.forwarder.feed(proc.rank, name, data)
            elif name == "stack":
                self._stacks[proc.rank] += data
            else:
                for message in self._frames[proc.rank].feed(data):
                    self._handle(proc, message)

    def _close_fd(self, fd: int, proc: WorkerProcess, name: str) -> None:
        if fd not in self._open:
            return
        self._open.discard(fd)
        self._selector.unregister(fd)
        os.close(fd)
        if name in ("stdout", "stderr"):
            self.forwarder.close(proc.rank, name)

    def _handle(self, proc: WorkerProcess, message: tuple[Any, ...]) -> None:
        kind, rank = message[0], message[1]
        if kind == "hello":
            self.on_event(rank, "state", {"state": "running", "pid": message[2]})
        elif kind == "event" and message[2] == IMPORTED_EVENT:
            remember_worker_imports(message[3].get("modules", []))  # pre-import next time
        elif kind == "event":
            self.on_event(rank, message[2], dict(message[3], time=message[4]))
        elif kind == "result":
            self._results[rank] = (message[2], message[3])
            self.on_event(rank, "state", {"state": "finished"})
        elif kind == "error":
            info = message[2]
            self._errors[rank] = Failure(
                rank, proc.pid, info.get("time", time.time()), "exception", info
            )
            self.on_event(rank, "state", {"state": "failed", "error": self._errors[rank].summary()})

    def _ctrl_done(self, proc: WorkerProcess) -> bool:
        """The control pipe is fully read, or the worker exited long enough ago."""
        assert proc.exit_time is not None
        return proc.fds["ctrl"] not in self._open or time.time() - proc.exit_time > 0.3

    # ------------------------------------------------------------------ deciding
    def _failures(self) -> list[Failure]:
        out = list(self._errors.values())
        for p in self.procs:
            if p.returncode is None or p.rank in self._errors or not self._ctrl_done(p):
                continue
            assert p.exit_time is not None
            if p.returncode < 0:
                stack = _trim_stack(self._stacks[p.rank].decode(errors="replace"))
                out.append(
                    Failure(p.rank, p.pid, p.exit_time, "signal", code=-p.returncode, stack=stack)
                )
            elif p.returncode > 0 or p.rank not in self._results:
                out.append(Failure(p.rank, p.pid, p.exit_time, "exit", code=p.returncode))
        return out

    def run(self) -> dict[int, Any]:
        """Supervise until the end; return the wanted ranks' values or raise."""
        try:
            return self._loop()
        except BaseException:
            self.terminate()
            raise
        finally:
            self.close()

    def _loop(self) -> dict[int, Any]:
        first_problem: float | None = None
        while True:
            self._pump(self.interval)
            now = time.time()
            for proc in self.procs:
                if proc.returncode is not None:
                    continue
                code = proc.poll()
                if code is not None and code < 0:
                    self.on_event(proc.rank, "state", {"state": "killed", "code": code})
            if self.stop_requested.is_set():
                self.terminate()
                raise Stopped("the run was stopped with LaunchHandle.stop(); workers terminated")
            alive = [p for p in self.procs if p.returncode is None]
            problems = self._failures()
            if problems:
                first_problem = first_problem or now
                if not alive or now - first_problem >= self.GRACE:
                    raise self._failure_error(problems, alive)
                continue
            if not alive:
                if all(self._ctrl_done(p) for p in self.procs):
                    return self._values()
                continue
            finished = [p.exit_time for p in self.procs if p.returncode == 0 and p.exit_time]
            if self.timeout and finished and now - min(finished) > self.timeout:
                done = sorted(p.rank for p in self.procs if p.returncode == 0)
                reason = (
                    f"rank(s) {done} finished more than timeout={self.timeout:g}s ago and "
                    "these ranks are still running (waiting for a peer that is gone?)"
                )
                raise self._hang_error(alive, [p.rank for p in alive], reason, {})

    def _failure_error(self, problems: list[Failure], alive: list[WorkerProcess]) -> BaseException:
        chosen = pick_failure(problems)
        stuck = [p for p in alive if p.rank not in self._errors]
        if chosen.secondary and stuck:
            reason = (
                f"{chosen.summary()} (timeout={self.timeout}s) while rank(s) "
                f"{[p.rank for p in stuck]} had not reached that point"
            )
            tracebacks = {f.rank: f.info.get("traceback") or f.stack for f in problems}
            return self._hang_error(alive, [p.rank for p in stuck], reason, tracebacks)
        err = remote_exception(chosen)
        others = [f.summary() for f in problems if f is not chosen]
        if others:
            add_note(err, f"Also seen (after rank {chosen.rank} failed): " + "; ".join(others))
        self.terminate()
        return err

    def _hang_error(
        self, alive: list[WorkerProcess], stuck: list[int], reason: str, stacks: dict[int, str]
    ) -> WorkerTimeoutError:
        dumped = self.dump_stacks(alive)
        self.terminate()
        pid = next((p.pid for p in alive if p.rank in stuck), None)
        return WorkerTimeoutError(stuck, {**stacks, **dumped}, reason, pid)

    def dump_stacks(self, procs: list[WorkerProcess], wait: float = 1.0) -> dict[int, str]:
        """Ask ``procs`` for their Python stacks (faulthandler) and collect the dumps."""
        if STACK_SIGNAL is None:
            return {}
        for proc in procs:
            self._stacks[proc.rank].clear()
            proc.send_signal(STACK_SIGNAL)
        deadline, last_size = time.time() + wait, -1
        while time.time() < deadline:
            self._pump(0.1)
            size = sum(len(self._stacks[p.rank]) for p in procs)
            if size == last_size and all(self._stacks[p.rank] for p in procs):
                break
            last_size = size
        return {
            p.rank: _trim_stack(self._stacks[p.rank].decode(errors="replace"))
            or "(no stack received)"
            for p in procs
        }

    def _values(self) -> dict[int, Any]:
        values = {}
        for rank in sorted(self.want):
            codec, data = self._results[rank]
            try:
                values[rank] = loads(codec, data)
            except Exception as err:
                raise LaunchError(
                    f"rank {rank}'s return value could not be loaded in the kernel "
                    f"({type(err).__name__}: {err}); return plain data (numbers, tensors, "
                    "dicts, lists) from the training function."
                ) from err
        return values

    # ------------------------------------------------------------------ cleaning up
    def terminate(self) -> None:
        """SIGTERM every live worker, SIGKILL after 1 s; kill descendants; reap all."""
        alive = [p for p in self.procs if p.poll() is None]
        descendants = [d for p in alive for d in p.descendants()]
        for proc in alive:
            proc.killed_by_us = True
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 1.0
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            self._pump(0.02)
        for proc in alive:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in alive:
            proc.reap(proc.KILL_WAIT)
        for child in descendants:
            with contextlib.suppress(Exception):
                child.kill()

    def close(self) -> None:
        """Drain what is left of the output briefly, then close every pipe (idempotent)."""
        if self._selector.get_map() is None:
            return
        deadline = time.time() + self.DRAIN
        while self._open and time.time() < deadline:
            self._pump(0.05)
        for key in list(self._selector.get_map().values()):
            proc, name = key.data
            self._close_fd(key.fd, proc, name)
        self._selector.close()


def _trim_stack(text: str) -> str:
    """Drop the frames below the user's function (nbaccel's bootstrap and, after a fork,
    the kernel's own frames that the child inherited) from a faulthandler dump."""
    out, skipping = [], False
    for line in text.splitlines():
        if not line.startswith("  "):  # "Thread 0x... (most recent call first):" or blank
            skipping = False
        elif os.path.join(f"{os.sep}nbaccel", "launch", "_bootstrap.py") in line:
            skipping = True
        if not skipping:
            out.append(line)
    return "\n".join(out)


__all__ = ["Stopped", "Supervisor"]
