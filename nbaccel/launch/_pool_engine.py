"""The machinery behind :class:`~nbaccel.launch.pool.WorkerPool`: workers, calls, restarts.

:class:`PoolEngine` owns the started workers (:mod:`._pool_start`), sends each
call's job to the ranks taking part, lets :class:`._pool_call.PoolSupervisor`
wait for their answers, turns the answers into the value or the first real error,
and replaces the workers (saying so on the cell's stderr) when they cannot go on:
a rank died, hung or is stuck, or the ranks' collective sequence numbers differ
after a call (the process group is out of step, so the next collective would
pair the wrong operations). It also keeps the pool's per-rank status for the
panel and ``nbaccel.monitor.watch``.

Example:
    >>> from nbaccel.launch._pool_engine import PoolEngine
    >>> PoolEngine.__name__
    'PoolEngine'
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import linecache
import pickle
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..errors import LaunchError
from ..platform import environment
from ._failures import add_note, pick_failure, remote_exception
from ._pool_call import _PoolBroken
from ._pool_start import Workers, boot, forwarder
from ._preflight import LaunchPlan
from ._status import Listener, RankStatus
from ._supervise import Stopped
from ._wire import HEADER, loads

_SETTLED = {"finished": "idle", "failed": "idle"}


class PoolEngine:
    """Workers of one pool and the calls made on them (one call at a time)."""

    def __init__(self, plan: LaunchPlan, streams: tuple[Any, Any]) -> None:
        self.plan, self.streams = plan, streams
        self.ranks = [plan.global_rank(i) for i in range(plan.num_processes or 1)]
        self.busy = threading.Lock()  # held by the call in progress
        self.workers: Workers | None = None
        self.restarts = 0
        self._ids = itertools.count(1)
        self._cells = itertools.count(1)
        self._handle: Any = None  # the LaunchHandle following the call in progress
        self._sent_sources: set[str] = set()
        # a finished or failed call leaves the workers waiting for the next one
        self._board = RankStatus(self.ranks, "starting", renamed=_SETTLED)

    # ------------------------------------------------------------------ workers
    def start(self) -> None:
        self._sent_sources = set()
        if self.plan.method == "fork" and self._fork_unsafe_now():
            # CUDA (or a process group) appeared in the kernel since the pool started:
            # forking now would hand the new workers a broken copy, so start them fresh.
            self.plan = dataclasses.replace(self.plan, method="spawn", payload=None)
            with contextlib.suppress(Exception):
                sys.stderr.write(
                    "nbaccel: CUDA or a process group is now initialised in the kernel, so "
                    "the pool's workers are started with start_method='spawn' from now on.\n"
                )
        self.workers = boot(self.plan, self.ranks, self.streams, self._event, self.restarts)
        for proc in self.workers.supervisor.procs:
            self._event(proc.rank, "state", {"state": "idle", "pid": proc.pid})

    @staticmethod
    def _fork_unsafe_now() -> bool:
        if environment.cuda_initialized() or environment.cuda_driver_loaded():
            return True
        dist = sys.modules.get("torch.distributed")
        return bool(dist is not None and dist.is_available() and dist.is_initialized())

    def replace(self, reason: str | None, *, graceful: bool = False) -> None:
        """End the current workers (children included) and start fresh ones."""
        if reason:
            with contextlib.suppress(Exception):
                sys.stderr.write(
                    f"nbaccel: {reason}; the pool restarted its workers (restart "
                    f"{self.restarts + 1}). Names set with push or in %%distributed cells "
                    "are gone; the process group forms again at the next Accelerator().\n"
                )
                sys.stderr.flush()
        self._stop_workers(graceful=graceful, timeout=5.0 if graceful else 0.0)
        self.restarts += 1
        self.start()

    def _stop_workers(self, *, graceful: bool, timeout: float) -> None:
        workers, self.workers = self.workers, None
        if workers is None:
            return
        sup = workers.supervisor
        children: list[Any] = []
        try:
            children = [d for p in sup.procs for d in p.descendants()]
            if graceful:  # serve() returns, the group is destroyed, the store shuts down
                for conn in workers.conns.values():
                    with contextlib.suppress(OSError):
                        conn.sendall(_frame(("exit",)))
                deadline = time.monotonic() + timeout
                while any(p.poll() is None for p in sup.procs) and time.monotonic() < deadline:
                    sup._pump(0.05)
        finally:  # also when interrupted while waiting: nothing may stay behind
            sup.terminate()  # SIGTERM (the worker kills its children), then SIGKILL
            sup.close()
            for child in children:
                with contextlib.suppress(Exception):
                    child.kill()
            workers.close_sockets()

    def ensure_healthy(self) -> None:
        """Replace the workers if one died while the pool was idle (e.g. SIGKILL, OOM)."""
        if self.workers is None:
            self.start()
            return
        chosen = self.workers.supervisor.dead_failure()
        if chosen is not None:
            self.replace(f"{chosen.summary()} while the pool was idle")

    def shutdown(self, timeout: float) -> None:
        handle = self._handle
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.stop(timeout=timeout)
        got = self.busy.acquire(timeout=max(timeout, 0.1))
        try:
            self._stop_workers(graceful=True, timeout=timeout)
        finally:
            if got:
                self.busy.release()
        for rank in self.ranks:
            self._event(rank, "state", {"state": "terminated"})

    @contextlib.contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        if not self.busy.acquire(blocking=False):
            raise LaunchError(f"cannot {what} while a call runs in the background; stop it first.")
        try:
            yield
        finally:
            self.busy.release()

    # ------------------------------------------------------------------ calls
    def next_cell_name(self) -> str:
        return f"<distributed-cell-{next(self._cells)}>"

    def execute(
        self, job: tuple[Any, ...], targets: list[int], handle: Any, stop: threading.Event
    ) -> dict[int, Any]:
        """Run one job on ``targets``; return the wanted ranks' values or raise."""
        assert self.workers is not None
        call_id = next(self._ids)
        frame = _frame((job[0], call_id, set(handle._want), self._new_sources(), *job[1:]))
        sup = self.workers.supervisor
        sup.forwarder = forwarder(handle._plan, self.ranks, handle._streams)
        self._handle = handle
        try:
            for rank in targets:
                self._event(rank, "state", {"state": "running", "pid": self.pids().get(rank)})
            try:
                for rank in targets:
                    self.workers.conns[rank].sendall(frame)
            except OSError as err:  # a worker's socket is gone: it died
                gone = LaunchError(f"a worker is gone ({err})")
                raise _PoolBroken(gone, "a worker is gone") from err
            except KeyboardInterrupt:  # some ranks may have the job, others not
                reason = "the kernel was interrupted while the job was being sent"
                raise _PoolBroken(KeyboardInterrupt(), reason) from None
            result = sup.call(call_id, targets, stop)
            self._finish_states(targets, result.done)
        except _PoolBroken as broken:
            self._finish_states(targets, {})
            self._handle = None
            self.replace(broken.reason)
            if stop.is_set():
                raise Stopped("the call was stopped; the pool restarted its workers") from None
            raise broken.error from None
        finally:
            self._handle = None
        # Only a call that did not end normally can leave ranks mid-collective; after a
        # normal one, counts may differ legitimately (one-sided send/recv count too).
        clean = not (result.stopped or result.interrupted or sup.call_failures())
        restart = None if clean else _out_of_step(result.done)
        try:
            if result.stopped:
                raise Stopped("the call was stopped with LaunchHandle.stop(); the pool stays")
            if result.interrupted:
                raise KeyboardInterrupt
            failures = sup.call_failures()
            if failures:
                real = [f for f in failures if f.info.get("type_qualname") != "KeyboardInterrupt"]
                chosen = pick_failure(real or failures)
                error = remote_exception(chosen)
                others = [f.summary() for f in failures if f is not chosen]
                if others:
                    add_note(
                        error, f"Also seen (after rank {chosen.rank} failed): " + "; ".join(others)
                    )
                raise error
            return self._values(result.done, handle._want)
        finally:
            if restart:
                self.replace(restart)

    def _values(self, done: dict[int, tuple[bool, Any, Any]], want: set[int]) -> dict[int, Any]:
        values = {}
        for rank in sorted(want):
            codec, data = done[rank][1]
            try:
                values[rank] = loads(codec, data)
            except Exception as err:
                raise LaunchError(
                    f"rank {rank}'s value could not be loaded in the kernel ({type(err).__name__}: "
                    f"{err}); return plain data (numbers, tensors, dicts, lists)."
                ) from err
        return values

    def _new_sources(self) -> dict[str, Any]:
        """Notebook cells not yet sent to these workers (for their tracebacks)."""
        out = {}
        for name, entry in list(linecache.cache.items()):
            if len(entry) == 4 and entry[1] is None and name not in self._sent_sources:
                out[name] = entry
                self._sent_sources.add(name)
        return out

    # ------------------------------------------------------------------ status
    def pids(self) -> dict[int, int]:
        workers = self.workers
        return {p.rank: p.pid for p in workers.supervisor.procs} if workers else {}

    def _finish_states(self, targets: list[int], done: dict[int, tuple[bool, Any, Any]]) -> None:
        for rank in targets:
            ok = done.get(rank, (False,))[0]
            self._event(rank, "state", {"state": "finished" if ok else "failed"})

    def _event(self, rank: int, kind: str, data: dict) -> None:
        listeners = self._board.record(rank, kind, data)
        handle = self._handle
        if handle is not None:  # the call in progress shows its own states
            handle._on_event(rank, kind, data)
        self._board.notify(listeners, rank, kind, data)

    def status(self) -> dict[int, dict[str, Any]]:
        return self._board.snapshot()

    def add_listener(self, callback: Listener) -> Listener:
        return self._board.add_listener(callback)

    def remove_listener(self, callback: Listener) -> None:
        self._board.remove_listener(callback)


class CallDriver:
    """Plays the Supervisor's part for a :class:`LaunchHandle` that follows one pool call."""

    def __init__(self, engine: PoolEngine, job: tuple[Any, ...], targets: list[int]) -> None:
        self.engine, self.job, self.targets = engine, job, targets
        self.stop_requested = threading.Event()
        self.handle: Any = None

    def run(self) -> dict[int, Any]:
        assert self.handle is not None
        try:
            return self.engine.execute(self.job, self.targets, self.handle, self.stop_requested)
        finally:
            self.engine.busy.release()

    def terminate(self) -> None:
        """Nothing to kill: the call was already interrupted; the workers stay."""

    def close(self) -> None:
        """Nothing to close: the pipes belong to the pool."""


def _frame(message: tuple[Any, ...]) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def _out_of_step(done: dict[int, tuple[bool, Any, int | None]]) -> str | None:
    seqs = {rank: seq for rank, (_, _, seq) in done.items() if seq is not None}
    if len(set(seqs.values())) > 1:
        counts = ", ".join(f"rank {r}: {s}" for r, s in sorted(seqs.items()))
        return f"the ranks ran different numbers of collectives ({counts}), so the process group is out of step"
    return None


__all__ = ["CallDriver", "PoolEngine"]
