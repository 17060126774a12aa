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


def release_openmp_threads() -> bool:
    """Release every loaded OpenMP runtime's thread pool before a fork.

    Returns:
        True if at least one runtime was paused; False if none is loaded or the
        runtime predates OpenMP 5.0 (then workers fall back to what the runtime does).
    """
    paused = False
    for path in _loaded_openmp_libraries():
        pause = _pause_function(path)
        if pause is not None:
            paused = pause(_OMP_PAUSE_SOFT) == 0 or paused
    return paused


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


__all__ = ["release_openmp_threads", "unreleasable_openmp_runtimes"]
