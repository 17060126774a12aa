"""Operating-system set-up of a worker process (used by :mod:`nbaccel.launch._bootstrap`).

fds 1/2 onto the launcher's pipes with fresh Python streams, default signal
handlers, death with the launching kernel, and flushing C stdio before
``os._exit``.

Example:
    >>> from nbaccel.launch._worker_os import flush_c_stdio
    >>> flush_c_stdio()
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import signal
import sys
from typing import Any


def redirect_output(stdout_fd: int, stderr_fd: int) -> None:
    """fds 1/2 -> the launcher's pipes; fresh sys.stdout/sys.stderr on them."""
    old_streams = (sys.stdout, sys.stderr)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, target in ((stdout_fd, 1), (stderr_fd, 2)):
        if fd != target:  # spawned workers get the pipes as fds 1/2 already
            os.dup2(fd, target)
            os.close(fd)
    # These streams live as long as the process, hence no context managers.
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    out = open(1, "wb", buffering=0, closefd=False)  # noqa: SIM115
    err = open(2, "wb", buffering=0, closefd=False)  # noqa: SIM115
    sys.stdout = io.TextIOWrapper(out, line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(
        err, line_buffering=True, write_through=True, errors="backslashreplace"
    )
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr  # type: ignore[misc]
    # logging handlers created in the kernel still point at the kernel's stream objects
    new = {id(old_streams[0]): sys.stdout, id(old_streams[1]): sys.stderr}
    handlers = _kernel_handlers if _kernel_handlers is not None else _stream_handlers()
    for handler in handlers:
        stream = getattr(handler, "stream", None)
        if stream is not None and id(stream) in new:
            handler.stream = new[id(stream)]


_kernel_handlers: list[Any] | None = None


def _stream_handlers() -> list[Any]:
    """Logging handlers writing to ``sys.stdout``/``sys.stderr`` (the streams being replaced)."""
    import logging

    targets = {id(sys.stdout), id(sys.stderr)}
    found = []
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            if id(getattr(handler, "stream", None)) in targets:
                found.append(handler)
    return found


def before_fork() -> None:
    """Kernel side, right before forking: do here what every forked worker would repeat.

    Walking every logger in a worker writes to (copies) the pages of every logger object
    the kernel has; the kernel finds the few handlers to repoint once instead. The C
    functions the workers call are looked up here too, so workers inherit them.
    """
    global _kernel_handlers
    _kernel_handlers = _stream_handlers()
    lib = libc()
    for name in ("prctl", "fflush"):  # ctypes caches each function on first attribute access
        getattr(lib, name, None)


def after_fork_in_kernel() -> None:
    """Kernel side, after the forks: hold no references to the handlers."""
    global _kernel_handlers
    _kernel_handlers = None


def reset_signals() -> None:
    """Default handlers (SIGINT raises KeyboardInterrupt); no kernel wakeup fd."""
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    # plain numbers: signal.valid_signals() wraps each in an enum (~1 ms in every worker)
    for sig in range(1, signal.NSIG):
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            handler = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if sig == signal.SIGINT:
            signal.signal(sig, signal.default_int_handler)
        elif callable(handler):
            signal.signal(sig, signal.SIG_DFL)
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)


def die_with_parent(parent_pid: int) -> None:
    """Linux: get SIGKILL when the launching kernel thread dies (no orphans)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc().prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def flush_c_stdio() -> None:
    """os._exit skips libc's buffers: flush what C extensions printed."""
    with contextlib.suppress(Exception):
        libc().fflush(None)


@functools.cache
def libc() -> Any:
    """The C library (``dlopen(NULL)``); the launcher calls this before forking, so the
    workers inherit the handle instead of loading it again."""
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


__all__ = [
    "after_fork_in_kernel",
    "before_fork",
    "die_with_parent",
    "flush_c_stdio",
    "libc",
    "redirect_output",
    "reset_signals",
]
