"""Operations that need every rank: enter them together, or fail in bounded time, by name.

Some calls only work when every rank makes them: a barrier (``wait_for_everyone``), and
under FSDP ``save_state``/``load_state``/``save_model``/``get_state_dict`` (each rank holds
a shard). A script that makes such a call inside ``if accelerator.is_main_process:``
would wait forever in a plain collective. Here the ranks first meet in torch's own
``monitored_barrier`` on a small gloo group of their own (formed with the process group,
when every rank is there): rank 0 learns which ranks did not arrive within the
process-group timeout and every rank that entered raises :class:`RanksMissingError`
naming the operation, those ranks and the fix, instead of hanging.

The bound is the process-group timeout (``NBACCEL_TIMEOUT=seconds``,
``InitProcessGroupKwargs(timeout=...)``, else 1800 s, Accelerate's default): the same
time a legitimate wait (the main process evaluating or downloading while the others
wait in ``wait_for_everyone``) may take under Accelerate, so no working script fails.
Only those entry points pay for the check (a few messages to rank 0); the per-step
collectives (``gather``, ``reduce``, DDP's all-reduce) are not touched.

The same group agrees on a random id once (:func:`group_nonce`), which checkpoints
use to tell one save from another without talking to the other ranks.

Example:
    >>> all_ranks_enter("wait_for_everyone", "call it on every rank")  # one process: no-op
"""

from __future__ import annotations

import datetime
import functools
import os
import re
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ...errors import RanksMissingError
from ...platform.process_env import distributed_active

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_TIMEOUT_S = 1800.0  # Accelerate's InitProcessGroupKwargs default
_GROUP: dict[str, Any] = {}


def form(timeout: datetime.timedelta | None) -> None:
    """Form the check group and agree on the group's id; call on every rank, right after
    the process group formed (or was adopted). Never raises: without the group, barriers
    fall back to plain ones and checkpoints to per-process ids."""
    world = dist.group.WORLD
    if _GROUP.get("world") is world and _GROUP.get("pid") == os.getpid():
        return  # formed for this very process group already (a later Accelerator)
    _GROUP.clear()
    seconds = timeout.total_seconds() if timeout is not None else DEFAULT_TIMEOUT_S
    _GROUP.update(timeout=seconds, world=world, pid=os.getpid())
    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
        box: list[Any] = [uuid.uuid4().hex[:16]]
        dist.broadcast_object_list(box, src=0, group=group)
    except Exception:  # a backend without gloo next to it (XLA): keep the plain path
        _GROUP["nonce"] = uuid.uuid4().hex[:16]
        return
    _GROUP.update(group=group, nonce=str(box[0]))


def forget() -> None:
    """Drop the check group (the process group it belongs to is gone)."""
    _GROUP.clear()


def group_nonce() -> str:
    """An id shared by every rank of the current process group (random per group)."""
    if "nonce" not in _GROUP or _GROUP.get("pid") != os.getpid():
        _GROUP.clear()
        _GROUP["pid"] = os.getpid()
        _GROUP["nonce"] = uuid.uuid4().hex[:16]  # one process: any id is shared by all
    return str(_GROUP["nonce"])


def timeout_seconds() -> float:
    """How long :func:`all_ranks_enter` waits for the other ranks."""
    return float(_GROUP.get("timeout", DEFAULT_TIMEOUT_S))


def names_timeouts(operation: str) -> Callable[[F], F]:
    """Decorator for a collective: a gloo timeout (some rank never called it) becomes a
    :class:`RanksMissingError` naming ``operation`` and the fix. Costs nothing unless the
    collective fails: no check runs before it (these run on every training step)."""

    def wrap(function: F) -> F:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            except RuntimeError as err:
                if not _TIMED_OUT.search(str(err)) or isinstance(err, RanksMissingError):
                    raise
                raise RanksMissingError(
                    f"{operation} on rank {dist.get_rank()} timed out after the process-group "
                    "timeout: some rank never called it (e.g. it runs inside `if "
                    "accelerator.is_main_process:`) or is stuck elsewhere. Fix: call "
                    f"{operation} on every rank, the same number of times."
                ) from err

        return call  # type: ignore[return-value]

    return wrap


#: gloo's "Timed out waiting ... for recv"; NCCL's watchdog "... before timing out" (the
#: launcher keeps NCCL from ending the process, so the error reaches this frame)
_TIMED_OUT = re.compile(r"timed out|timing out", re.IGNORECASE)


def _missing_ranks(message: str) -> list[int]:
    match = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
    return [int(r) for r in re.findall(r"\d+", match.group(1))] if match else []


def all_ranks_enter(operation: str, fix: str) -> None:
    """Return once every rank has called ``operation``; raise if some did not in time.

    Args:
        operation: what the ranks are entering, as the user wrote it (``"save_state"``).
        fix: what to change so that every rank calls it.

    Raises:
        RanksMissingError: on every rank that entered, when some rank did not enter
            within :func:`timeout_seconds`.
    """
    if not distributed_active():
        return
    group = _GROUP.get("group") if _GROUP.get("world") is dist.group.WORLD else None
    if group is None:  # no check group (XLA): a plain barrier, as before
        dist.barrier()
        return
    seconds = timeout_seconds()
    try:
        dist.monitored_barrier(
            group=group, timeout=datetime.timedelta(seconds=seconds), wait_all_ranks=True
        )
    except RuntimeError as err:
        raise _error(operation, fix, seconds, str(err)) from None


def _error(operation: str, fix: str, seconds: float, message: str) -> RanksMissingError:
    rank, world = dist.get_rank(), dist.get_world_size()
    how_long = (
        f"within {seconds:g} s (the process-group timeout: NBACCEL_TIMEOUT=seconds or "
        "InitProcessGroupKwargs(timeout=...) sets it)"
    )
    missing = _missing_ranks(message)
    if rank == 0 and missing:
        entered = [r for r in range(world) if r not in missing]
        head = (
            f"{operation} needs every rank, but rank(s) {missing} did not call it {how_long}; "
            f"rank(s) {entered} did"
        )
    else:
        head = (
            f"{operation} needs every rank; rank {rank} called it, but rank 0 did not report "
            f"every rank present {how_long} (rank 0 never called it, or rank 0's error names "
            "the rank that did not)"
        )
    return RanksMissingError(f"{head}. Fix: {fix}", missing=missing)


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "all_ranks_enter",
    "forget",
    "form",
    "group_nonce",
    "names_timeouts",
    "timeout_seconds",
]
