"""Writing a checkpoint: the files, the errors, and the save of replicated state.

Under replicated training (one process, DDP, XLA) the models, optimizers, schedulers,
scaler and registered objects are the same on every rank, so one process writes them;
only the RNG states and loader positions differ per rank (``rank_{r}.pt``). The save
therefore needs no other rank (see :mod:`nbaccel.checkpoint.rank_files`):

* the main process (and the local main of a node that cannot see the main process's
  files, or of every node with ``save_on_each_node``) stages the shared files and its
  own rank file in ``.<name>.tmp-<save id>.w<rank>``, fsyncs them and publishes the
  directory atomically (manifest, exchange) under a lock on the parent directory;
* every other rank that calls ``save_state`` writes its rank file durably where the
  publication picks it up (or into the published checkpoint, if it comes later).

The save id (``<group id>.<accelerator number>.<step>.<save number at that step>``) is
the same on every rank for the same call without any message: ranks create their
Accelerators in the same order and are at the same step when they all save.

Example:
    >>> save_id_for(type("A", (), {"_serial": 0, "step": 7})())  # doctest: +ELLIPSIS
    '....0.7.1'
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any

from ...checkpoint.directory import (
    MANIFEST,
    encode,
    place_rank_file,
    publish,
)
from ...checkpoint.durable import make_dirs
from ...checkpoint.rank_files import only_rank_files
from ...checkpoint.store import is_url
from ...checkpoint.weights import CheckpointError, dedupe_tied, torch_save, write_safetensors
from ...errors import ConfigError, StorageError
from ..process import rank_check
from .hooks import weights_to_save


def suffix(i: int) -> str:
    return "" if i == 0 else f"_{i}"


def save_id_for(acc: Any) -> str:
    """The id of the next save of ``acc``: the same on every rank that makes this call.

    ``<group id>.<accelerator number>.<step>.<saves at this step>``: counting saves per
    step keeps the ranks' ids equal even when some saves were made by the main process
    alone at other steps (the counts would drift apart otherwise).
    """
    step = int(acc.step)
    last_step, count = getattr(acc, "_save_count", (None, 0))
    count = count + 1 if last_step == step else 1
    acc._save_count = (step, count)
    return f"{rank_check.group_nonce()}.{getattr(acc, '_serial', 0)}.{step}.{count}"


def rank_payload(acc: Any) -> dict[str, Any]:
    """This rank's own part of a checkpoint: RNG states, loader positions, step."""
    from ..process.rng import get_rng_state

    return encode(
        {
            "rng": get_rng_state(),
            "dataloaders": [dl.state_dict() for dl in acc._dataloaders],
            "step": int(acc.step),
            "world_size": acc.state.world_size,
        }
    )


def write_shared(
    acc: Any, tmp: Path, safe_serialization: bool, models: list[Any], optimizers: list[Any]
) -> None:
    """Files that are identical on every rank: written once (per node with save_on_each_node)."""
    for i, state in enumerate(models):
        if safe_serialization:
            tensors, aliases = dedupe_tied(state)
            write_safetensors(tensors, tmp / f"model{suffix(i)}.safetensors", aliases)
        else:
            torch_save(
                {k: v.detach().cpu() for k, v in state.items()},
                tmp / f"pytorch_model{suffix(i)}.bin",
            )
    for i, optimizer_state in enumerate(optimizers):
        torch_save(optimizer_state, tmp / f"optimizer{suffix(i)}.bin")
    for i, scheduler in enumerate(acc._schedulers):
        torch_save(scheduler.state_dict(), tmp / f"scheduler{suffix(i)}.bin")
    scaler_state = acc.precision.state_dict()
    if scaler_state:
        torch_save(scaler_state, tmp / "scaler.pt")
    for i, obj in enumerate(acc._custom_objects):
        torch_save(encode(obj.state_dict()), tmp / f"custom_checkpoint_{i}.pkl")


def check_target(target: Path) -> None:
    """Refuse to write a checkpoint over a directory that is not one (or not one yet)."""
    occupied = target.exists() and (not target.is_dir() or any(target.iterdir()))
    if occupied and not (target / MANIFEST).is_file() and not only_rank_files(target):
        raise ConfigError(
            f"save_state will not overwrite {str(target)!r}: it exists and is not an nbaccel "
            "checkpoint. Choose an empty or new directory."
        )


def _sees_main_save(target: Path, save_id: str) -> bool:
    """True if the main process's copy of this save is visible here (a shared filesystem)."""
    from ...checkpoint.rank_files import manifest_save_id

    staging = target.parent / f".{target.name}.tmp-{save_id}.w0"
    return staging.is_dir() or manifest_save_id(target) == save_id


def save_replicated(acc: Any, target: Path, safe_serialization: bool) -> None:
    """Save replicated state from whichever ranks call this; no rank waits for another."""
    state, config = acc.state, acc.project_configuration
    save_id = save_id_for(acc)
    staging = target.parent / f".{target.name}.tmp-{save_id}.w{state.rank}"
    try:
        check_target(target)
        if state.is_main_process:
            make_dirs(staging)  # first: other nodes' mains look for it
        writes_shared = state.is_main_process or (
            state.is_local_main_process
            and (config.save_on_each_node or not _sees_main_save(target, save_id))
        )
        if not writes_shared:
            _, before = place_rank_file(target, save_id, state.rank, rank_payload(acc))
            # load_state waits until the main process published this save (see there)
            acc._unpublished_save = None if before == save_id else (target, before)
            return
        make_dirs(staging)
        models = weights_to_save(acc, staging)  # after the save pre-hooks
        optimizers = [acc.strategy.optimizer_state_dict(opt) for opt in acc._optimizers]
        write_shared(acc, staging, safe_serialization, models, optimizers)
        payload = {**rank_payload(acc), "save_id": save_id, "rank": state.rank}
        torch_save(payload, staging / f"rank_{state.rank}.pt")
        publish(acc, staging, target, save_id, safe_serialization)
        acc._unpublished_save = None
    except Exception as err:
        shutil.rmtree(staging, ignore_errors=True)
        raise write_error(err, target)  # noqa: B904 (write_error chains the cause)


_WRITE_FIXES = {
    errno.ENOSPC: "free disk space (or save elsewhere; total_limit keeps fewer checkpoints)",
    errno.EDQUOT: "free space within your disk quota",
    errno.EFBIG: "raise the file size limit (ulimit -f) or save elsewhere",
    errno.EACCES: "make the directory writable for this user or choose another project_dir",
    errno.EPERM: "make the directory writable for this user or choose another project_dir",
    errno.EROFS: "the filesystem is read-only: choose a project_dir on a writable one",
}


def _os_errno(err: BaseException) -> int | None:
    """The errno behind ``err``: its own, a chained OSError's, or "(os error N)" in Rust text."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    match = re.search(r"os error (\d+)", str(err))
    return int(match.group(1)) if match else None


def write_error(err: Exception, target: Path | str) -> Exception:
    """A save that could not write: say where, why, that the previous copy is intact, the fix."""
    if isinstance(err, ConfigError | CheckpointError | StorageError):
        return err
    code = _os_errno(err)
    reason = os.strerror(code) if code is not None else f"{type(err).__name__}: {err}"
    left = "nothing half-written is left"
    if isinstance(target, str) and is_url(target):  # the store, not a disk, failed
        fix = (
            f"check that the store of {target!r} is reachable and that its credentials "
            "(environment, profile) allow writing there"
        )
        # an object store has no rename: parts of this save may be there, never its manifest
        left = "the parts this save uploaded are not a checkpoint (no manifest) and go with the next save"
    else:
        fix = _WRITE_FIXES.get(code or -1, "check the directory and the disk")
    wrapped = CheckpointError(
        f"save_state could not write {str(target)!r}: {reason} ({type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}). The previous checkpoint is "
        f"untouched and still loads; {left}. Fix: {fix}."
    )
    wrapped.__cause__ = err
    return wrapped


__all__ = [
    "check_target",
    "rank_payload",
    "save_id_for",
    "save_replicated",
    "suffix",
    "write_error",
    "write_shared",
]
