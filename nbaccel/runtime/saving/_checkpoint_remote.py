"""``save_state`` / ``load_state`` to and from object storage (an fsspec URL).

The files are the same as on local disk; where they go follows
:mod:`nbaccel.checkpoint.remote` (data folder per save, manifest written last). Each rank
builds its own files in a private local staging folder (save hooks need a real folder
to write into) and uploads them itself: no rank reads what another rank wrote to disk.

* replicated training (one process, DDP): as on local disk, any subset of ranks may
  call it and no rank waits for another; the main process uploads the shared files and
  its rank file, then writes the manifest; every other caller uploads its rank file
  into the same data folder (same save id, computed on every rank alike).
* collective state (FSDP): every rank uploads its shard files, the ranks exchange
  what they uploaded (names, sizes, sha256) and success flags, then the main process
  writes the manifest listing every rank's files.

Loading downloads the checkpoint's data (checked against the manifest's sizes and
hashes) into a private temporary folder and loads it from there as a local checkpoint.

Example:
    >>> from nbaccel.checkpoint.store import is_url
    >>> is_url("s3://bucket/run/ckpt")
    True
"""

from __future__ import annotations

import contextlib
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...checkpoint import remote
from ...checkpoint.directory import all_ok, from_main, state_fields
from ...checkpoint.store import basename
from ...checkpoint.weights import torch_save
from ...platform.process_env import distributed_active
from ._checkpoint_write import rank_payload, save_id_for, write_error, write_shared
from .hooks import weights_to_save
from .sharded_state import save_sharded


def _manifest(
    acc: Any, save_id: str, files: dict[str, tuple[int, str]], safe_serialization: bool
) -> dict[str, Any]:
    return {
        **state_fields(acc, save_id, safe_serialization),
        "data": remote.DATA + save_id,
        "scaler": "scaler.pt" in files,
        "files": {name: size for name, (size, _) in sorted(files.items())},
        "sha256": {name: digest for name, (_, digest) in sorted(files.items())},
    }


def _write_own(acc: Any, staging: Path, save_id: str, shared: bool, safe: bool) -> None:
    """This rank's files: the shared ones (if it writes them) and its rank file."""
    models: list[Any] = []
    optimizers: list[Any] = []
    if acc.strategy.collective_state and acc.strategy.sharded_checkpoints:
        save_sharded(acc, staging)  # every rank its shard (DCP)
    elif shared or acc.strategy.collective_state:  # FSDP gathers: every rank takes part
        models = weights_to_save(acc, staging)
        optimizers = [acc.strategy.optimizer_state_dict(opt) for opt in acc._optimizers]
    if shared:
        write_shared(acc, staging, safe, models, optimizers)
    payload = {**rank_payload(acc), "save_id": save_id, "rank": acc.state.rank}
    torch_save(payload, staging / f"rank_{acc.state.rank}.pt")


def save_remote(acc: Any, target: str, safe_serialization: bool) -> None:
    """Save to the URL ``target`` (replicated: any ranks; collective state: every rank)."""
    if acc.strategy.collective_state:
        _save_collective(acc, target, safe_serialization)
        return
    save_id = save_id_for(acc)
    main = acc.state.is_main_process
    try:
        remote.check_target(target)
        data = remote.data_folder(target, save_id)
        if main and remote.manifest_save_id(target) == save_id:
            # this id is published there already (ids repeat only in odd cases): never
            # overwrite a published checkpoint's files in place; other ranks' files of
            # this save then miss it, and they keep their RNG state with a warning
            data = f"{data}.{uuid.uuid4().hex[:8]}"
        with remote.staging_folder(target) as folder:
            _write_own(acc, Path(folder), save_id, main, safe_serialization)
            files = remote.upload_folder(Path(folder), data)
        if main:
            manifest = _manifest(acc, save_id, files, safe_serialization)
            manifest["data"] = basename(data)
            remote.publish(target, manifest)
            acc._unpublished_save = None
        else:
            before = remote.manifest_save_id(target)
            # load_state waits until the main process published this save
            acc._unpublished_save = None if before == save_id else (target, before)
    except Exception as err:
        raise write_error(err, target)  # noqa: B904 (write_error chains the cause)


def _save_collective(acc: Any, target: str, safe_serialization: bool) -> None:
    main = acc.state.is_main_process
    save_id = from_main(acc, save_id_for(acc))  # the main's id, should the ranks differ
    error: BaseException | None = None
    files: dict[str, tuple[int, str]] = {}
    try:
        if main:
            remote.check_target(target)
        with remote.staging_folder(target) as folder:
            _write_own(acc, Path(folder), save_id, main, safe_serialization)
            files = remote.upload_folder(Path(folder), remote.data_folder(target, save_id))
    except Exception as err:
        error = write_error(err, target)
    all_ok(acc, error, "save_state")
    everyone: list[Any] = [files]
    if distributed_active():
        import torch

        everyone = [None] * acc.state.world_size
        torch.distributed.all_gather_object(everyone, files)
    error = None
    if main:
        try:
            merged = {name: entry for part in everyone for name, entry in part.items()}
            remote.publish(target, _manifest(acc, save_id, merged, safe_serialization))
        except Exception as err:
            error = write_error(err, target)
    all_ok(acc, error, "save_state (publishing)")


@contextlib.contextmanager
def fetched(source: str) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The complete checkpoint at URL ``source``, downloaded and checked: (folder, manifest)."""
    manifest = remote.read_manifest(source)
    with tempfile.TemporaryDirectory(prefix=f"nbaccel-{basename(source)}-") as folder:
        remote.fetch(source, manifest, Path(folder))
        yield Path(folder), manifest


__all__ = ["fetched", "save_remote"]
