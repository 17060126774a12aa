"""What the installed torch can and cannot do, for the torch versions nbaccel supports.

nbaccel claims torch>=2.4 and CI runs the launcher, runtime and kernel tests on the
oldest and the newest release (``scripts/setup_torch_matrix.sh``). Differences
those runs found live here, each keyed to the torch version that fixed it:

* torch < 2.8: the libuv ``TCPStore`` backend (the default since 2.4) refuses a
  handed-over listening socket (``master_listen_fd``), see :func:`libuv_store_adopts_socket`;
* torch < 2.8: destroying a gloo process group holds the GIL while joining gloo's
  worker threads, and a worker thread that is just freeing a finished collective's
  tensors needs the GIL: a deadlock, one run in a few, right after the last
  collective. :func:`destroy_process_group` avoids it;
* torch < 2.7: a ``torch.profiler`` block around a ``DistributedDataParallel`` backward
  can corrupt the heap: the rank dies with SIGABRT or SIGSEGV (gloo, in a launched worker:
  2.4.1 one run in three, 2.5.1 and 2.6.0 4 of 49; 2.7.1 and 2.9.1 0 of 20), see
  :func:`profiler_survives_ddp_backward`.

torch is imported only inside the functions.

Example:
    >>> from nbaccel.platform.torchcompat import torch_at_least
    >>> torch_at_least(2, 4)
    True
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

# Process groups that torch < 2.8 must not destroy while gloo may still need the GIL:
# kept alive until the process exits (workers end right after tearing down).
_KEPT_ALIVE: list[Any] = []
# False in a launched worker that ends in os._exit after every peer has left
_TEARDOWN_AT_EXIT = [True]


def torch_at_least(major: int, minor: int) -> bool:
    """True when the installed torch is ``major.minor`` or newer (pre-releases count)."""
    import torch

    version = torch.__version__.split("+")[0]
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in version.split(".")[:2]]
    return (parts[0], parts[1]) >= (major, minor)


def libuv_store_adopts_socket() -> bool:
    """Whether the libuv TCPStore backend can serve on a handed-over socket (torch >= 2.8).

    Older versions raise ``NotImplementedError`` (and log it on stderr from C++);
    their legacy backend (``use_libuv=False``) adopts the socket.
    """
    return torch_at_least(2, 8)


def profiler_survives_ddp_backward() -> bool:
    """Whether ``torch.profiler`` records a DDP backward without crashing (torch >= 2.7)."""
    return torch_at_least(2, 7)


# The oldest torch whose FSDP2 (``fully_shard``) passes nbaccel's FSDP tests on the CPU
# (tried: 2.6 has no CPU stream events there; 2.7 and 2.8 give results that differ from
# one unsharded process; 2.9 passes). Older torch gets a clear error naming this version.
FSDP_MIN_TORCH = (2, 9)


def fsdp_supported() -> bool:
    """Whether ``strategy='fsdp'`` can run on the installed torch (see FSDP_MIN_TORCH)."""
    return torch_at_least(*FSDP_MIN_TORCH)


def dtensor_module() -> Any:
    """``torch.distributed.tensor`` (public since torch 2.5; ``_tensor`` on torch 2.4).

    Plain (unsharded) ``save_model``/``load_model`` ask whether a model holds DTensors,
    so this must work on every claimed torch.
    """
    import importlib

    dtensor = importlib.import_module("torch.distributed.tensor")
    if not hasattr(dtensor, "DTensor"):  # torch 2.4 has the package without the public names
        dtensor = importlib.import_module("torch.distributed._tensor")
    return dtensor


def destroy_process_group() -> None:
    """Tear down the default process group (if any) without risking torch < 2.8's deadlock.

    On torch >= 2.8 this is ``torch.distributed.destroy_process_group()``. On older
    torch the groups are unregistered the same way, but their C++ objects are kept
    alive until the process exits, so that their destructor (which would hold the GIL
    while waiting for gloo's threads) does not run while a gloo thread still frees the
    last collective's tensors. Never raises: it runs on the way out of a worker.
    """
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return
        if not torch_at_least(2, 8):
            world = getattr(dist.distributed_c10d, "_world", None)
            groups = list(getattr(world, "pg_map", {}) or {}) if world is not None else []
            _KEPT_ALIVE.extend(groups or [dist.group.WORLD])
        dist.destroy_process_group()
    except Exception:  # on the way out there is nobody left to tell
        pass


def skip_teardown_at_exit() -> None:
    """Make :func:`destroy_process_group_at_exit` a no-op in this process.

    For a launched worker that ends in ``os._exit`` once every peer has passed the exit
    barrier: nobody needs its group any more, exiting closes the sockets, and tearing a
    gloo group down would cost ~20 ms of every launch.
    """
    _TEARDOWN_AT_EXIT[0] = False


def destroy_process_group_at_exit() -> None:
    """The at-exit handler the runtime registers for scripts: torch aborts at interpreter
    exit (status 134, about 1 run in 3) when a group is left open."""
    if _TEARDOWN_AT_EXIT[0]:
        destroy_process_group()


def reread_debug_level() -> None:
    """Apply ``TORCH_DISTRIBUTED_DEBUG`` from this process's environment now.

    torch.distributed reads it once, when it is imported; a worker forked from a kernel
    that imported it already would keep the kernel's level (``debug_collectives=True``
    sets the variable in the workers' environment, before any process group exists).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and os.environ.get("TORCH_DISTRIBUTED_DEBUG"):
        with contextlib.suppress(Exception):
            dist.set_debug_level_from_env()


def check_ddp_debug_level() -> None:
    """A clear error where torch's ``DistributedDataParallel`` would crash the process.

    Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (``debug_collectives=True``) a gloo group is
    torch's checking wrapper, and DDP's constructor logs the gloo backend's thread count
    through a cast that assumes the plain gloo backend: a segmentation fault (seen on torch
    2.13; NCCL groups are not affected).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_debug_level() == dist.DebugLevel.DETAIL and dist.get_backend() == "gloo":
        from ..errors import ConfigError

        raise ConfigError(
            "debug_collectives=True (TORCH_DISTRIBUTED_DEBUG=DETAIL) with a gloo process group: "
            "torch's DistributedDataParallel crashes the process (SIGSEGV) when built under "
            "it. Use debug_collectives to find mismatched collectives in code that calls "
            "them directly, or on GPUs (NCCL); turn it off to train with DDP on the CPU."
        )


__all__ = [
    "FSDP_MIN_TORCH",
    "check_ddp_debug_level",
    "destroy_process_group",
    "destroy_process_group_at_exit",
    "dtensor_module",
    "fsdp_supported",
    "libuv_store_adopts_socket",
    "profiler_survives_ddp_backward",
    "reread_debug_level",
    "skip_teardown_at_exit",
    "torch_at_least",
]
