"""Make the OpenMP runtime safe to fork from a process that already used it.

GNU libgomp is not fork-safe: once the parent (a notebook kernel that ran any
multi-threaded torch op) has started its thread pool, a forked child that runs a
multi-threaded op waits for ever on pool threads that do not exist in the child.
OpenMP 5.0's ``omp_pause_resource_all`` releases the pool in the parent; the
next parallel region (in the parent or a child) simply starts a fresh one.

Example:
    >>> from nbaccel.platform.forksafe import release_openmp_threads
    >>> release_openmp_threads() in (True, False)
    True
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import warnings
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


__all__ = [
    "keep_forked_worker_single_threaded",
    "release_openmp_threads",
    "unreleasable_openmp_runtimes",
]
