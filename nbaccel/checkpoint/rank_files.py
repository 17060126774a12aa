"""Per-rank state files that join a checkpoint without the ranks talking to each other.

Under replicated training (one process, DDP) every file of a checkpoint but one is
written by the main process alone: the models, optimizers, schedulers... are the same
on every rank. What differs per rank is small (its RNG states, its loader position):
``rank_{r}.pt``. ``save_state`` must work when only the main process calls it (as in
Accelerate, e.g. inside ``if accelerator.is_main_process:``), so no rank may wait for
another; and when every rank calls it, every rank's file must end up in the checkpoint.

The protocol, per save (all names derive from a *save id* that every rank computes on
its own, the same for the same save):

* the writer of the shared files stages them in a private directory, then publishes
  it (:func:`nbaccel.checkpoint.directory.publish`) while holding a lock on the parent
  directory;
* every other rank writes its rank file, under the same lock, straight into the target
  when the target is this save's checkpoint (already published) or holds no checkpoint
  yet, else into ``.<name>.tmp-<save id>`` next to it (the old checkpoint stays
  intact);
* at publication the writer moves the rank files of this save (from that directory
  and from the target) into what it publishes.

Each rank file is written under a temporary name, fsynced and renamed; it records its
save id, and ``load_state`` uses a rank file only when that id is the manifest's. A rank
that saved nothing (main-only save) or whose file did not make it (a crash) keeps its
own RNG state, with a warning, as Accelerate does.

Example:
    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = write_file(folder, rank_file_name(1), {"save_id": "id1"})
    >>> read_rank_file(folder, 1)["save_id"]
    'id1'
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .durable import fsync_path, replace, temp_name
from .weights import torch_load, torch_save

MANIFEST = "nbaccel_checkpoint.json"
RANK_FILE = re.compile(r"rank_(\d+)\.pt")


def rank_file_name(rank: int) -> str:
    """``rank_{rank}.pt``."""
    return f"rank_{rank}.pt"


def pending_dir(target: Path, save_id: str) -> Path:
    """Where rank files of save ``save_id`` wait while ``target`` holds an older checkpoint."""
    return target.parent / f".{target.name}.tmp-{save_id}"


@contextlib.contextmanager
def publish_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``directory`` (the checkpoint's parent).

    Serialises a rank's "where does my file go" decision with the publication of the
    checkpoint, so a rank file never lands in a directory that is being replaced. Best
    effort where the platform or filesystem has no directory locks (Windows; some NFS
    setups): the rank file may then miss the checkpoint, which ``load_state`` reports.
    """
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):  # no directory locks here: best effort, see above
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def manifest_save_id(directory: Path) -> str | None:
    """The save id recorded in ``directory``'s manifest; ``""`` for a checkpoint of an
    older format, ``None`` when ``directory`` holds no checkpoint."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return str(manifest.get("save_id", "")) if isinstance(manifest, dict) else None


def write_file(directory: Path, name: str, payload: Any) -> Path:
    """Write ``payload`` to ``directory/name`` durably: temporary name, fsync, rename."""
    path = directory / name
    tmp = temp_name(path)
    try:
        torch_save(payload, tmp)
        replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def carry_rank_files(target: Path, staging: Path, save_id: str) -> None:
    """Move the rank files of save ``save_id`` into ``staging`` (call under the lock,
    just before publishing ``staging`` as ``target``)."""
    pending = pending_dir(target, save_id)
    sources = [pending] if pending != staging else []
    if target.is_dir() and manifest_save_id(target) != save_id:
        sources.append(target)
    moved = False
    for source in sources:
        if not source.is_dir():
            continue
        for child in source.iterdir():
            ours = RANK_FILE.fullmatch(child.name) and _save_id_of(child) == save_id
            if ours and not (staging / child.name).exists():
                os.replace(child, staging / child.name)
                moved = True
    if moved:
        fsync_path(staging)
    if pending != staging:
        shutil.rmtree(pending, ignore_errors=True)


def _save_id_of(path: Path) -> str | None:
    try:
        return str(torch_load(path).get("save_id"))
    except Exception:
        return None


def read_rank_file(directory: Path, rank: int) -> dict[str, Any] | None:
    """The rank file of ``rank`` in ``directory``, or ``None`` if there is none."""
    path = directory / rank_file_name(rank)
    if not path.is_file():
        return None
    state: dict[str, Any] = torch_load(path)
    return state


def only_rank_files(directory: Path) -> bool:
    """True if ``directory`` exists and holds nothing but rank files (and their temps)."""
    if not directory.is_dir():
        return False
    return all(
        RANK_FILE.fullmatch(c.name) or (c.name.startswith(".rank_") and ".tmp-" in c.name)
        for c in directory.iterdir()
    )


__all__ = [
    "MANIFEST",
    "carry_rank_files",
    "manifest_save_id",
    "only_rank_files",
    "pending_dir",
    "publish_lock",
    "rank_file_name",
    "read_rank_file",
    "write_file",
]
