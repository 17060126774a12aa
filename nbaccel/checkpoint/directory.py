"""The on-disk layout of a checkpoint directory: manifest, validation, naming, publishing.

Also the two collectives checkpointing needs (agree on a value, exchange success
flags) and a weights-only-safe encoding of state dicts that contain numpy arrays
(numpy RNG states), so every file loads with ``torch.load(weights_only=True)``.
Used by :mod:`nbaccel.runtime.saving.checkpointing`; nothing here is public API.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from .._version import __version__
from ..errors import ConfigError
from ..platform.process_env import distributed_active
from .durable import exchange, fsync_path, fsync_tree, make_dirs
from .rank_files import (
    RANK_FILE,
    carry_rank_files,
    manifest_save_id,
    pending_dir,
    publish_lock,
    rank_file_name,
    write_file,
)
from .weights import CheckpointError

MANIFEST = "nbaccel_checkpoint.json"
FORMAT = "nbaccel-checkpoint"
VERSION = 1
AUTO_NAME = re.compile(r"checkpoint_(\d+)")
_NDARRAY = "__nbaccel_ndarray__"
# Written into a save's temporary directory by global rank 0 before any other write:
# a node that cannot see it does not share node 0's filesystem (see save_state).
VISIBILITY_MARKER = ".nbaccel-node0"
T = TypeVar("T")


# -- collectives (no-ops on one process) ---------------------------------------------------


def from_main(acc: Any, value: Any) -> Any:
    if not distributed_active():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def all_ok(acc: Any, error: BaseException | None, what: str) -> None:
    """Exchange success flags; every rank raises if any failed (instead of hanging later)."""
    text = None if error is None else f"{type(error).__name__}: {error}"
    texts = [text]
    if distributed_active():
        texts = [None] * acc.state.world_size
        torch.distributed.all_gather_object(texts, text)
    if error is not None:
        raise error
    failed = [(rank, t) for rank, t in enumerate(texts) if t is not None]
    if failed:
        rank, t = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {t}")


# -- weights-only-safe encoding of arbitrary state dicts (numpy arrays inside RNG states) --


def _rebuild(original: Any, items: list[Any]) -> Any:
    if isinstance(original, tuple):
        return type(original)(*items) if hasattr(original, "_fields") else tuple(items)
    return items


def encode(obj: Any) -> Any:
    """Replace numpy arrays/scalars so that ``torch.load(weights_only=True)`` accepts ``obj``."""
    if isinstance(obj, np.ndarray):
        raw = torch.from_numpy(np.frombuffer(obj.tobytes(), dtype=np.uint8).copy())
        return {_NDARRAY: raw, "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        encoded = {k: encode(v) for k, v in obj.items()}
        return OrderedDict(encoded) if isinstance(obj, OrderedDict) else encoded
    if isinstance(obj, list | tuple):
        return _rebuild(obj, [encode(v) for v in obj])
    return obj


def decode(obj: Any) -> Any:
    """Undo :func:`encode`."""
    if isinstance(obj, dict) and _NDARRAY in obj:
        raw = obj[_NDARRAY].numpy().tobytes()
        return np.frombuffer(raw, dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    if isinstance(obj, dict):
        decoded = {k: decode(v) for k, v in obj.items()}
        return OrderedDict(decoded) if isinstance(obj, OrderedDict) else decoded
    if isinstance(obj, list | tuple):
        return _rebuild(obj, [decode(v) for v in obj])
    return obj


# -- manifest and directory validation -----------------------------------------------------


def check_header(manifest: Any, where: str) -> None:
    """Refuse a manifest that is not nbaccel's, or is of a newer format than this nbaccel
    reads (on local disk and object storage alike).

    Raises:
        CheckpointError: naming ``where`` (a path or URL) and what to do.
    """
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{where!r} is not an nbaccel checkpoint (its {MANIFEST} is foreign)."
        )
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{where!r} was written by a newer nbaccel (format {manifest['version']}); upgrade nbaccel."
        )


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return the manifest of the complete checkpoint at ``path``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: ``path`` is not an nbaccel checkpoint, or is incomplete/damaged.
    """
    path = Path(path)
    if not path.exists() and not recover(path):
        raise FileNotFoundError(
            f"no checkpoint at {str(path)!r}: check the path (or save_state first)."
        )
    if not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is a file; a checkpoint is a directory written by save_state()."
        )
    if ".tmp-" in path.name or ".old-" in path.name:
        raise CheckpointError(
            f"{str(path)!r} is the leftover of an interrupted save_state(), not a checkpoint; "
            "load the previous checkpoint instead (load_state() picks the latest complete one)."
        )
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{str(path)!r} is not an nbaccel checkpoint: it has no {MANIFEST}. Pass a directory "
            "written by accelerator.save_state(); for bare model weights use "
            "load_checkpoint_in_model()."
        ) from None
    except ValueError as err:
        raise CheckpointError(
            f"{str(path / MANIFEST)!r} is damaged ({err}); use another checkpoint."
        ) from err
    check_header(manifest, str(path))
    for name, size in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            raise CheckpointError(
                f"{str(path)!r} is incomplete or damaged: {name} is missing or has the wrong size."
            )
    return manifest


def _displaced(target: Path) -> list[Path]:
    """Copies of ``target`` moved aside by an overwrite (``.name.old-<token>``), newest first."""
    pattern = f".{glob.escape(target.name)}.old-*"
    found = [p for p in target.parent.glob(pattern) if p.is_dir()] if target.parent.is_dir() else []
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def recover(target: str | os.PathLike[str]) -> bool:
    """Put back a checkpoint that an overwrite moved aside and never replaced; say if it did.

    Where the filesystem cannot exchange two directories atomically, overwriting a
    checkpoint takes two renames (old copy aside, new one in). A crash between them
    leaves ``target`` missing and the complete old copy under ``.name.old-<token>``;
    loading ``target`` then restores that copy instead of failing.
    """
    target = Path(target)
    for old in _displaced(target):
        if not (old / MANIFEST).is_file():
            continue
        try:
            os.rename(old, target)  # rename, not replace: never over a target that reappeared
        except OSError:
            if target.exists():  # another rank (or node) recovered it first
                return True
            continue
        fsync_path(target.parent)
        warnings.warn(
            f"{target} was missing after an interrupted overwrite; restored the previous "
            f"copy from {old.name}.",
            stacklevel=3,
        )
        return True
    return target.exists()


def checkpoints_root(acc: Any) -> Path:
    """``project_dir/checkpoints``, where automatic naming puts checkpoints."""
    project_dir = acc.project_configuration.project_dir
    if project_dir is None:
        raise ConfigError(
            "automatic checkpoint naming needs ProjectConfiguration(project_dir=...)."
        )
    return Path(project_dir) / "checkpoints"


def _numbered(root: Path) -> list[tuple[int, Path]]:
    found = []
    if root.is_dir():
        for old in list(root.glob(".checkpoint_*.old-*")):
            name = old.name[1:].split(".old-")[0]
            if AUTO_NAME.fullmatch(name) and not (root / name).exists():
                recover(root / name)
        for child in root.iterdir():
            match = AUTO_NAME.fullmatch(child.name)
            if match and child.is_dir():
                found.append((int(match.group(1)), child))
    return sorted(found)


def newest_complete(numbered: list[tuple[int, T]], read: Callable[[T], Any]) -> T | None:
    """The last of ``numbered`` (``(i, where)``, lowest ``i`` first) whose manifest ``read``
    accepts, saying which newer ones it skipped and why; None if none is complete."""
    for _, where in reversed(numbered):
        try:
            read(where)
        except (CheckpointError, OSError) as err:
            warnings.warn(f"skipping {where}: {err}", stacklevel=4)
            continue
        return where
    return None


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete ``checkpoint_{i}`` under ``root`` with the highest ``i``, or None."""
    return newest_complete(_numbered(Path(root)), read_manifest)


def state_fields(acc: Any, save_id: str, safe_serialization: bool) -> dict[str, Any]:
    """What a manifest says of the saved state, on local disk and on a store alike."""
    return {
        "nbaccel_version": __version__,
        "save_id": save_id,  # the rank files of this save carry it too
        "step": int(acc.step),
        "world_size": acc.state.world_size,
        "safe_serialization": safe_serialization,
        "counts": {
            "models": len(acc._models),
            "optimizers": len(acc._optimizers),
            "schedulers": len(acc._schedulers),
            "dataloaders": len(acc._dataloaders),
            "custom_objects": len(acc._custom_objects),
        },
    }


def _manifest(acc: Any, tmp: Path, safe_serialization: bool, save_id: str) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        **state_fields(acc, save_id, safe_serialization),
        "scaler": (tmp / "scaler.pt").exists(),
        # relative paths: sharded (DCP) state lives in sub-folders, one file per rank
        "files": {
            p.relative_to(tmp).as_posix(): p.stat().st_size
            for p in sorted(tmp.rglob("*"))
            if p.is_file() and p.name not in (MANIFEST, VISIBILITY_MARKER)
        },
    }


def place_rank_file(
    target: Path, save_id: str, rank: int, payload: dict[str, Any]
) -> tuple[Path, str | None]:
    """Write this rank's file of save ``save_id`` where its checkpoint will pick it up.

    Into ``target`` when it holds this save's checkpoint (published already) or none
    yet, else next to it (:func:`~nbaccel.checkpoint.rank_files.pending_dir`), so an
    older checkpoint stays intact; :func:`publish` gathers the files. Needs no other
    rank. ``payload`` gets ``save_id`` and ``rank`` added. Returns the path written and
    the save id ``target`` held at that moment (``None``: no checkpoint yet).
    """
    make_dirs(target.parent)
    body = {**payload, "save_id": save_id, "rank": rank}
    with publish_lock(target.parent):
        if not target.exists():
            recover(target)  # an overwrite that died between its two renames
        published = manifest_save_id(target)
        if published is None or published == save_id:
            make_dirs(target)
            return write_file(target, rank_file_name(rank), body), published
        pending = pending_dir(target, save_id)
        make_dirs(pending)
        return write_file(pending, rank_file_name(rank), body), published


def publish(acc: Any, tmp: Path, target: Path, save_id: str, safe_serialization: bool) -> None:
    """Write the manifest into ``tmp`` and move it to ``target`` with no gap in between.

    An existing ``target`` is swapped with ``tmp`` in one atomic exchange where the
    filesystem allows it; elsewhere it is moved aside first and :func:`recover` puts
    it back if the process dies before the new copy is in place. Either way some
    complete checkpoint is at (or recoverable for) ``target`` at every moment. The
    rank files of this save that other ranks wrote so far move in first; if another
    writer (another node's main on a shared filesystem) published this save already,
    only ``tmp``'s rank files join it.
    """
    if not tmp.is_dir():  # another node's main already renamed it (shared filesystem)
        return
    (tmp / VISIBILITY_MARKER).unlink(missing_ok=True)
    fsync_tree(tmp)  # the big writes reach the disk before the lock is taken
    with publish_lock(target.parent):
        if manifest_save_id(target) == save_id:
            for child in tmp.iterdir():
                if RANK_FILE.fullmatch(child.name) and not (target / child.name).exists():
                    os.replace(child, target / child.name)
            fsync_path(target)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        if not target.exists():
            recover(target)
        carry_rank_files(target, tmp, save_id)
        manifest_path = tmp / MANIFEST
        manifest = _manifest(acc, tmp, safe_serialization, save_id)
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
        fsync_path(manifest_path)
        fsync_path(tmp)
        _swap_in(tmp, target, save_id)


def _swap_in(tmp: Path, target: Path, save_id: str) -> None:
    displaced = None
    if target.exists() and exchange(tmp, target):
        displaced = tmp  # now holds the old checkpoint
    else:
        if target.exists():
            displaced = target.parent / f".{target.name}.old-{save_id}"
            os.replace(target, displaced)
            fsync_path(target.parent)
        os.replace(tmp, target)
        fsync_path(target.parent)
    # this save's displaced copy, and leftovers of earlier saves to the same place that
    # died (not this save's: another node's main may still be writing its copy)
    ours = f".{target.name}.tmp-{save_id}"
    leftovers = [
        p
        for p in target.parent.glob(f".{glob.escape(target.name)}.tmp-*")
        if p.name != ours and not p.name.startswith(ours + ".")
    ]
    for stale in {p for p in (displaced, *leftovers, *_displaced(target)) if p is not None}:
        shutil.rmtree(stale, ignore_errors=True)


def prune(acc: Any, root: Path, current: str | None = None) -> None:
    """Drop stale temporary dirs and the oldest checkpoints beyond ``total_limit``;
    the temporary dirs of ``current`` (the save just made) stay: another node's main
    process may still be writing its copy of it."""
    for child in root.iterdir() if root.is_dir() else ():
        if not child.name.startswith(".checkpoint_"):
            continue
        if current is not None and child.name.startswith(f".{current}.tmp-"):
            continue
        if ".tmp-" in child.name or (
            # a displaced copy is only stale once its checkpoint is back in place
            ".old-" in child.name and (root / child.name[1:].split(".old-")[0]).exists()
        ):
            shutil.rmtree(child, ignore_errors=True)
    limit = acc.project_configuration.total_limit
    ours = [path for _, path in _numbered(root) if (path / MANIFEST).is_file()]
    if limit is not None:
        for path in ours[: max(0, len(ours) - limit)]:
            shutil.rmtree(path)
