"""Fork safety: the OpenMP pool released before a fork, and what a fork is told about.

GNU libgomp is not fork-safe: once the parent (a notebook kernel that ran any
multi-threaded torch op) has started its thread pool, a forked child that runs a
multi-threaded op waits for ever on pool threads that do not exist in the child.
OpenMP 5.0's ``omp_pause_resource_all`` releases the pool in the parent; the
next parallel region (in the parent or a child) simply starts a fresh one.

Python >= 3.12 warns on every ``os.fork()`` in a multi-threaded process ("This process
is multi-threaded, use of fork() may lead to deadlocks in the child"), and a kernel
always is. :func:`check_fork` decides instead, from what nbaccel can see: the kernel's
own threads (ipykernel, IPython, tqdm, nbaccel) hold nothing a worker needs; any other
Python thread might. :func:`forking` wraps the fork: Python's generic warning is
replaced by nbaccel's verdict, a warning that names the threads and the fix only where
the fork was not checked to be safe.

Example:
    >>> from nbaccel.platform.forksafe import release_openmp_threads
    >>> release_openmp_threads() in (True, False)
    True
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# omp_pause_resource_t values from the OpenMP 5.0 specification
_OMP_PAUSE_SOFT = 1
_OPENMP_NAMES = ("libgomp", "libiomp", "libomp")


def _loaded_openmp_libraries() -> list[str]:
    """Paths of OpenMP runtimes mapped into this process (Linux: /proc/self/maps)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            text = maps.read()
    except OSError:  # not Linux: fork is not the default start method there anyway
        return []
    for name in _OPENMP_NAMES:  # str.find over the text: ~2,000 lines, read every launch
        at = text.find(name)
        while at != -1:
            start, end = text.rfind("\n", 0, at) + 1, text.find("\n", at)
            path = text[start : end if end != -1 else len(text)].rsplit(" ", 1)[-1].strip()
            base = os.path.basename(path)
            if path.startswith("/") and base.startswith(name) and path not in paths:
                paths.append(path)
            at = text.find(name, end if end != -1 else len(text))
    return paths


# Set by release_openmp_threads() in the kernel right before it forks, so that forked
# workers inherit it: a loaded runtime could not release its pool (see
# keep_forked_worker_single_threaded).
_UNRELEASED = [False]


def release_openmp_threads() -> bool:
    """Release every loaded OpenMP runtime's thread pool before a fork.

    Returns:
        True if at least one runtime was paused; False if none is loaded or the
        runtime predates OpenMP 5.0 (then workers fall back to what the runtime does).
    """
    paused = unreleased = False
    for path in _loaded_openmp_libraries():
        pause = _pause_function(path)
        if pause is None:
            unreleased = True
        else:
            paused = pause(_OMP_PAUSE_SOFT) == 0 or paused
    _UNRELEASED[0] = unreleased
    return paused


def keep_forked_worker_single_threaded() -> bool:
    """In a worker forked after :func:`release_openmp_threads` met a runtime it could not
    release: ``torch.set_num_threads(n)`` with ``n > 1`` warns and keeps 1 thread.

    The worker's first multi-threaded op would otherwise wait for ever on the kernel's pool
    threads, which do not exist in it, and on every rank at once, so no peer finishes and
    no timeout fires. The launcher already starts such workers with 1 thread; this keeps a
    training function that raises the count itself from hanging.

    Returns:
        True if ``torch.set_num_threads`` is guarded in this process.

    Example:
        >>> keep_forked_worker_single_threaded() in (True, False)
        True
    """
    torch = sys.modules.get("torch")
    if not _UNRELEASED[0] or torch is None:
        return False
    original = torch.set_num_threads
    if getattr(original, "_nbaccel_single_threaded", False):
        return True

    @functools.wraps(original)
    def set_num_threads(num: int) -> None:
        if int(num) > 1:
            warnings.warn(
                f"torch.set_num_threads({num}) in a forked worker: this torch's OpenMP "
                "runtime (older than OpenMP 5.0, as torch 2.4's wheels ship) could not "
                "release the kernel's thread pool, so a multi-threaded op here would wait "
                "for ever. The worker keeps 1 compute thread. For more, launch with "
                "start_method='spawn', or use torch >= 2.5.",
                RuntimeWarning,
                stacklevel=2,
            )
            num = 1
        original(num)

    set_num_threads._nbaccel_single_threaded = True  # type: ignore[attr-defined]
    setattr(torch, "set_num_threads", set_num_threads)  # noqa: B010 - a module attribute
    return True


def unreleasable_openmp_runtimes() -> list[str]:
    """Loaded OpenMP runtimes that cannot release their pool (older than OpenMP 5.0).

    torch 2.4's wheels ship such a libgomp. Once the kernel has run a multi-threaded op,
    a forked child's first multi-threaded op there waits for ever; single-threaded
    children are safe.

    Example:
        >>> isinstance(unreleasable_openmp_runtimes(), list)
        True
    """
    return [path for path in _loaded_openmp_libraries() if _pause_function(path) is None]


@functools.lru_cache(maxsize=8)
def _pause_function(path: str) -> Any:
    """``omp_pause_resource_all`` of an already-mapped runtime (looked up once per
    process, not per launch: a mapped library stays mapped), or None if it has none."""
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause


# Top-level packages whose threads a forked worker never needs: Jupyter's kernel machinery
# (shell/IOPub/heartbeat/control threads, output pipes, history, parent poller), Colab's and
# the debugger's, progress bars' monitors, and nbaccel's own supervisors. Their locks stay
# with the kernel; the worker runs only nbaccel's bootstrap and the user's function.
# OpenTelemetry's exporters (mlflow starts them) re-create their threads and locks in a
# forked child themselves (os.register_at_fork).
KNOWN_THREAD_PACKAGES = frozenset(
    {"ipykernel", "IPython", "jupyter_client", "zmq", "tornado", "comm", "debugpy", "tqdm",
     "google", "nbaccel", "opentelemetry"}
)  # fmt: skip
# Python's own warning (3.12+), replaced by check_fork's verdict.
_PYTHON_FORK_WARNING = r"This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead"


def _resets_itself_after_fork(thread: threading.Thread) -> bool:
    """Whether ``thread`` belongs to a library that makes a forked child a fresh one.

    fsspec's IO loop thread ("fsspecIO", started by any async filesystem such as s3fs, and
    by nbaccel's object-storage checkpoints) runs an asyncio loop whose target names only
    asyncio; fsspec registers ``os.register_at_fork`` to drop that loop and its lock in the
    child, so a forked worker starts its own. Known by identity, not name: a user's thread
    called "fsspecIO" is still the user's.
    """
    asyn = sys.modules.get("fsspec.asyn")
    return asyn is not None and thread in getattr(asyn, "iothread", ())


def unknown_threads() -> list[str]:
    """Names of the live Python threads (besides the calling one and the main thread) that
    were started by code other than :data:`KNOWN_THREAD_PACKAGES`.

    Example:
        >>> unknown_threads()
        []
    """
    found = []
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread is threading.main_thread():
            continue
        if _resets_itself_after_fork(thread):
            continue
        # Thread(target=...) or threading.Timer(interval, function): whose code runs
        target = getattr(thread, "_target", None) or getattr(thread, "function", None)
        origins = {type(thread).__module__, getattr(target, "__module__", None) or ""}
        origins -= {"threading", ""}  # a plain Thread: its target tells
        if not origins or not all(o.split(".")[0] in KNOWN_THREAD_PACKAGES for o in origins):
            found.append(thread.name)
    return found


def fork_breaks_this_process() -> str | None:
    """Why forking would break this very process, not only its child (None: it would not).

    A Ray driver (``ray.init()`` done here, ``ray://`` included): Ray's gRPC threads in this
    process do not survive a fork of it. After a forked launch the kernel's next call to the
    cluster (``ray.nodes()``, a placement group) waited for ever in a whole run of the suite;
    Ray's own advice is to spawn (ray-project/ray#59661). Ray is never imported here.

    Example:
        >>> fork_breaks_this_process() is None  # no Ray connected in this process
        True
    """
    ray = sys.modules.get("ray")
    try:
        connected = ray is not None and bool(ray.is_initialized())
    except Exception:  # a half-imported or broken Ray: nothing connected through it
        connected = False
    if not connected:
        return None
    return (
        "this kernel is connected to Ray (ray.init()), whose gRPC connection does not "
        "survive a fork of the kernel: its next Ray call could wait for ever "
        "(ray-project/ray#59661)"
    )


@dataclass(frozen=True)
class ForkCheck:
    """nbaccel's verdict on forking workers from this process now.

    Attributes:
        threads: threads nbaccel does not know (a worker may deadlock on a lock one of
            them held at the fork); empty when the fork is checked to be safe.
    """

    threads: tuple[str, ...] = ()

    @property
    def safe(self) -> bool:
        """True when nothing but the kernel's own and nbaccel's threads runs here."""
        return not self.threads

    def message(self) -> str:
        """What the cell shows when the fork is not known to be safe."""
        names = ", ".join(repr(name) for name in self.threads)
        return (
            f"nbaccel forks its workers from this kernel while {len(self.threads)} thread(s) "
            f"that nbaccel does not know are running here ({names}). If one of them holds a "
            "lock at the fork (logging, a file, a queue), a worker that needs it waits for "
            "ever. If the launch hangs or its workers misbehave, stop those threads first or "
            "launch with start_method='spawn'."
        )


def check_fork() -> ForkCheck:
    """Whether forking from this process is safe as far as nbaccel can tell.

    Example:
        >>> check_fork().safe
        True
    """
    return ForkCheck(tuple(unknown_threads()))


def warn_if_fork_unsafe() -> ForkCheck:
    """Kernel side, once per launch before forking: check, and warn when not known safe.

    Returns:
        The :class:`ForkCheck` (its warning, if any, already issued as a ``RuntimeWarning``).
    """
    check = check_fork()
    if not check.safe:
        warnings.warn(check.message(), RuntimeWarning, stacklevel=3)
    return check


@contextlib.contextmanager
def forking() -> Iterator[None]:
    """Around ``os.fork()``: Python's generic multi-threaded-fork ``DeprecationWarning``
    is not shown (nbaccel's own verdict, :func:`warn_if_fork_unsafe`, replaces it). Under
    ``-W error`` it would otherwise raise in the parent after the child was created.

    Example:
        >>> with forking():
        ...     pass
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _PYTHON_FORK_WARNING, DeprecationWarning)
        yield


__all__ = [
    "KNOWN_THREAD_PACKAGES",
    "ForkCheck",
    "check_fork",
    "fork_breaks_this_process",
    "forking",
    "keep_forked_worker_single_threaded",
    "release_openmp_threads",
    "unknown_threads",
    "unreleasable_openmp_runtimes",
    "warn_if_fork_unsafe",
]
