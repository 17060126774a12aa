"""Operating-system side of a worker: output, signals, dying with the supervisor, its stack.

fds 1/2 go onto the supervisor's pipes; :func:`die` ends the worker and everything it
started when the supervisor is gone (the channel's end of file, the parent-death signal)
or on SIGTERM, no timer involved; :func:`main_thread_report` says what the main thread
does (its stack, and the torch.distributed call it waits in and for which ranks).

Example:
    >>> from nbaccel.launch.worker._worker_os import flush_c_stdio
    >>> flush_c_stdio()
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import signal
import sys
import threading
import traceback
from typing import Any

_MACHINERY = os.path.join(f"{os.sep}nbaccel", "launch", "")
_DISTRIBUTED = (
    os.path.join(f"{os.sep}torch", "distributed", ""),
    os.path.join(f"{os.sep}torch", "nn", "parallel", "distributed.py"),
)
_PEER = ("dst", "src", "peer", "group_dst", "group_src")  # point-to-point calls' partner
# Forming the process group: torch's rendezvous and group set-up, and the Accelerator's own
# first collectives (get_state in runtime/process/state.py: the ranks' agreement check).
# Bounded by the launch's `timeout` (its error names the rank that never came), so never
# judged "stuck" by the hang watchdog: on a loaded machine a group took more than 8 s to
# form, and hang_after=2 with on_hang="raise" ended a healthy job.
_FORMING_CALLS = frozenset(
    {"init_process_group", "_new_process_group_helper", "_create_c10d_store", "new_group"}
)
_FORMING_OWN = os.path.join(f"{os.sep}nbaccel", "runtime", "process", "state.py")  # get_state


def redirect_output(stdout_fd: int, stderr_fd: int) -> None:
    """fds 1/2 -> the supervisor's pipes; fresh sys.stdout/sys.stderr on them."""
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
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers = [h for logger in loggers for h in getattr(logger, "handlers", [])]
    return [h for h in handlers if id(getattr(h, "stream", None)) in targets]


def before_fork() -> None:
    """Kernel side, right before forking: do once what every forked worker would repeat
    (find the logging handlers to repoint; look up the C functions workers call)."""
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
    """Default handlers, no kernel wakeup fd; SIGTERM ends the worker's children too."""
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    # plain numbers: signal.valid_signals() wraps each in an enum (~1 ms in every worker)
    for sig in set(range(1, signal.NSIG)) - {signal.SIGKILL, signal.SIGSTOP, signal.SIGINT}:
        with contextlib.suppress(ValueError, OSError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, lambda *_: die(143))


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGTERM (then :func:`die`) when the supervising thread's process dies."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        libc().prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        die(1)


# die() runs once per process, entered from the channel's reader and from SIGTERM's handler
# (Linux resends the parent-death signal as the dying supervisor's threads hand the worker
# on). A second entry must not reach os._exit while the first still ends the children (a
# nested one found psutil half imported and left them to init): the reentrant lock lets a
# nested call in (it returns); other threads wait for the first one's os._exit.
_dying = threading.RLock()
_entered = False


def die(code: int = 1) -> None:
    """End this worker now, with every process it started (from any thread); returns
    only into a die() this thread already runs (SIGTERM's handler inside it)."""
    global _entered
    _dying.acquire()  # released by os._exit only
    if _entered:  # a signal handler inside this thread's own die(): let that one finish
        _dying.release()
        return
    _entered = True
    if _has_children():
        with contextlib.suppress(Exception):
            import psutil

            for child in psutil.Process().children(recursive=True):
                with contextlib.suppress(Exception):
                    child.kill()
    flush_c_stdio()
    os._exit(code)


def _has_children() -> bool:
    """Cheap: no child at all is the usual case, and needs no look at /proc."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    except Exception:  # no waitid (macOS): look
        pass
    return True


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


def main_thread_report(rank: int) -> dict[str, Any]:
    """What the main thread does right now: its stack (nbaccel's own frames left out) and
    ``waiting``, ``{"call": "torch.distributed.all_reduce", "ranks": [..] or None (all)}``
    when it is inside torch.distributed. Safe from another thread of the process."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    waiting = None
    forming = False
    inner = frame
    while inner is not None:
        code = inner.f_code  # a module being imported is not a call that waits
        if (
            waiting is None
            and code.co_name != "<module>"
            and any(p in code.co_filename for p in _DISTRIBUTED)
        ):
            waiting = {"call": _qualname(inner), "ranks": _ranks_of(inner, rank)}
        forming = (
            forming
            or code.co_name in _FORMING_CALLS
            or (code.co_name == "get_state" and code.co_filename.endswith(_FORMING_OWN))
        )
        inner = inner.f_back
    summary = traceback.extract_stack(frame) if frame is not None else []
    # The user's frames are those below the worker's own (the job's call); above them, a
    # forked worker's stack goes on into the kernel's frames it inherited (the launching cell).
    last = max((i for i, entry in enumerate(summary) if _MACHINERY in entry.filename), default=-1)
    user = [entry for entry in summary[last + 1 :] if _MACHINERY not in entry.filename]
    stack = "".join(traceback.format_list(user)).rstrip()
    if waiting is not None:
        stack += f"\n  (waiting in {waiting['call']})"
    own = [e for e in user if not e.filename.startswith(("<frozen", *_libraries()))]
    where = (own or user or summary)[-1:]  # the user's innermost frame, not a library's
    return {
        "stack": stack,
        "waiting": waiting,
        "forming": forming,  # in the process group's formation (see _FORMING_CALLS)
        # the innermost frame, as "busy in <frame>" names it
        "frame": f"{where[0].name} ({os.path.basename(where[0].filename)}:{where[0].lineno})"
        if where
        else None,
        # a C++ call of torch's the main thread is in (autograd's backward, a sync): where
        # DDP's and FSDP's collectives wait without a torch.distributed frame
        "in_torch": _qualname(frame) if frame is not None and _in_torch(frame) else None,
    }


@functools.cache
def _libraries() -> tuple[str, ...]:
    """Where the standard library and installed packages live."""
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple({paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths})


def _in_torch(frame: Any) -> bool:
    module = str(frame.f_globals.get("__name__", ""))
    return module.startswith("torch.") and not module.startswith("torch.utils.data")


def _qualname(frame: Any) -> str:
    module = frame.f_globals.get("__name__", "torch.distributed")
    if module.startswith("torch.distributed.distributed_c10d"):
        module = "torch.distributed"
    return f"{module}.{getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)}"


def _ranks_of(frame: Any, rank: int) -> list[int] | None:
    """The global ranks a torch.distributed call needs (None: every rank of the world)."""
    try:
        local = dict(frame.f_locals)
        group = next((local[k] for k in ("group", "process_group", "pg") if k in local), None)
        peer = next((local[k] for k in _PEER if isinstance(local.get(k), int)), None)
        dist = sys.modules["torch.distributed"]
        if peer is not None:
            return sorted({rank, int(peer)})
        if group is None or group is dist.GroupMember.WORLD:
            return None
        return sorted(int(r) for r in dist.get_process_group_ranks(group))
    except Exception:
        return None


__all__ = [
    "after_fork_in_kernel",
    "before_fork",
    "die",
    "die_with_parent",
    "flush_c_stdio",
    "libc",
    "main_thread_report",
    "redirect_output",
    "reset_signals",
]
