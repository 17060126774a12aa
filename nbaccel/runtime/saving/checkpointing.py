"""Atomic training checkpoints: ``save_state`` / ``load_state``.

A checkpoint directory holds the unwrapped models (safetensors), optimizers,
schedulers, the GradScaler, every registered custom object, a manifest
(``nbaccel_checkpoint.json``) listing every file and its size, and one file per rank
with that rank's RNG states and dataloader positions (``rank_{r}.pt``).

Who must call what follows from the state that must be written, not from who calls:

* replicated training (one process, DDP, XLA): ``save_state``, ``load_state`` work on
  any subset of ranks, e.g. the main process alone inside ``if
  accelerator.is_main_process:`` as in Accelerate; no rank waits for another
  (:mod:`nbaccel.runtime.saving._checkpoint_write`). When every rank calls them, every rank's
  RNG state is saved and restored; a rank that finds no state of its own for that save
  keeps its RNG state and gets a warning.
* FSDP: every rank holds a shard, so every rank must call them; a call made by some
  ranks only fails within the process-group timeout with an error naming the ranks
  that did not come (:mod:`nbaccel.runtime.process.rank_check`,
  :mod:`nbaccel.runtime.saving._checkpoint_collective`).

Either way the directory appears atomically (temporary name, fsync, manifest,
exchange): a process killed at any point leaves the previous checkpoint loadable, and
``load_state`` refuses anything without a valid manifest. A write that fails (full
disk, read-only directory) raises a ``CheckpointError`` naming the path, the reason
and the fix.

Object storage: a path may be an fsspec URL (``s3://bucket/run/ckpt``, ``gs://...``; a
``project_dir`` URL for automatic naming). Each rank uploads its own files and the
manifest is written last, after every part was confirmed in the store
(:mod:`nbaccel.runtime.saving._checkpoint_remote`, :mod:`nbaccel.checkpoint.remote`);
``file://`` URLs are local paths. A URL whose package is missing or whose scheme nothing
handles is refused before anything is written. Save hooks get a private local folder
whose files are uploaded; load hooks get the downloaded copy.

Loaders: ``load_state`` restores each prepared loader's epoch, seed and shuffle
generators, and the loader starts at the beginning of that epoch (scripts skip what
they saw, e.g. with ``skip_first_batches``), as in Accelerate; with
``DataLoaderConfiguration(use_stateful_dataloader=True)`` it also resumes at the
saved position inside the epoch.

Example:
    >>> path = accelerator.save_state("ckpt")  # doctest: +SKIP
    >>> accelerator.load_state(path)  # doctest: +SKIP
    >>> accelerator.save_state("s3://bucket/run/ckpt")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...checkpoint import remote
from ...checkpoint.directory import (
    AUTO_NAME,
    MANIFEST,
    all_ok,
    checkpoints_root,
    decode,
    latest_checkpoint,
    prune,
    read_manifest,
)
from ...checkpoint.rank_files import manifest_save_id, read_rank_file
from ...checkpoint.store import as_local, basename, check, is_url, join, parent, scheme
from ...checkpoint.weights import CheckpointError, read_weights, torch_load
from ...errors import ConfigError
from ...tracking import events
from ..process import rank_check
from ._checkpoint_collective import FIX, save_collective
from ._checkpoint_write import save_replicated, suffix
from .hooks import models_to_load
from .sharded_state import holds_sharded, load_sharded

# -- save_state ---------------------------------------------------------------------------


def save_state(
    acc: Any, output_dir: str | os.PathLike[str] | None = None, *, safe_serialization: bool = True
) -> str:
    """Save everything needed to resume training; return the checkpoint directory.

    Args:
        acc: the Accelerator (replicated training: any ranks; FSDP: every rank).
        output_dir: where to save: a path or an fsspec URL (``s3://bucket/run/ckpt``);
            ``None`` with automatic naming means
            ``project_dir/checkpoints/checkpoint_{iteration}``.
        safe_serialization: models as safetensors (default) or torch ``.bin``.
    """
    config = acc.project_configuration
    auto = output_dir is None
    if auto and not config.automatic_checkpoint_naming:
        raise ConfigError(
            "save_state() needs output_dir, or Accelerator(project_config=ProjectConfiguration("
            "project_dir=..., automatic_checkpoint_naming=True))."
        )
    if output_dir is None:
        root = _auto_root(acc)
        name = f"checkpoint_{config.iteration}"
        where = join(root, name) if isinstance(root, str) else root / name
    else:
        where = _location(output_dir)
    if isinstance(where, str):
        _save_to_store(acc, where, safe_serialization, auto=auto)
        return where
    target = where.absolute()
    collective = acc.strategy.collective_state
    if collective:
        rank_check.all_ranks_enter("save_state", FIX)
        save_collective(acc, target, safe_serialization)
    else:
        save_replicated(acc, target, safe_serialization)
    if auto:
        _count_and_prune(acc, lambda: prune(acc, target.parent, current=target.name))
    return str(target)


def _count_and_prune(acc: Any, prune_old: Callable[[], None]) -> None:
    """After an automatically named save: count it, and let the main process delete what
    ``total_limit`` no longer keeps (its error raised on every rank of a collective save)."""
    acc.project_configuration.iteration += 1
    error = None
    if acc.state.is_main_process:
        try:
            prune_old()
        except Exception as err:
            error = err
    if acc.strategy.collective_state:  # nobody looks for "the latest" while old ones go
        all_ok(acc, error, "save_state (pruning)")
    elif error is not None:
        raise error


def _location(path: str | os.PathLike[str]) -> Path | str:
    """A local path (``file://`` URLs included) as a Path; an object-store URL as itself,
    its store opened first: a missing package or unknown scheme is refused here, before
    anything is written (``Path("s3://b/x")`` would be the local folder ``s3:``)."""
    if isinstance(path, str) and is_url(path):
        check(path)
        return path.rstrip("/")
    return as_local(path)


def _auto_root(acc: Any) -> Path | str:
    """Where automatic naming puts checkpoints: ``project_dir/checkpoints``, on disk or a store."""
    project_dir = acc.project_configuration.project_dir
    if isinstance(project_dir, str) and scheme(project_dir) is not None:
        where = _location(project_dir)
        return join(where, "checkpoints") if isinstance(where, str) else where / "checkpoints"
    return checkpoints_root(acc)


def _save_to_store(acc: Any, target: str, safe_serialization: bool, *, auto: bool) -> None:
    """:func:`save_state` to an object store (:mod:`._checkpoint_remote`)."""
    from ._checkpoint_remote import save_remote

    collective = acc.strategy.collective_state
    if collective:
        rank_check.all_ranks_enter("save_state", FIX)
    save_remote(acc, target, safe_serialization)
    if auto:
        limit = acc.project_configuration.total_limit
        _count_and_prune(acc, lambda: remote.prune(parent(target), limit))


# -- load_state ---------------------------------------------------------------------------


def _check_counts(acc: Any, manifest: dict[str, Any], source: Path | str) -> None:
    counts = manifest.get("counts", {})
    for kind, have in (
        ("models", acc._models),
        ("optimizers", acc._optimizers),
        ("schedulers", acc._schedulers),
        ("custom_objects", acc._custom_objects),
    ):
        if counts.get(kind, 0) != len(have):
            raise ConfigError(
                f"{str(source)!r} holds {counts.get(kind, 0)} {kind} but this Accelerator has "
                f"{len(have)}: prepare() (and register_for_checkpointing) the same objects, in the "
                "same order, before load_state()."
            )


def _source(acc: Any, input_dir: str | os.PathLike[str] | None) -> Path | str:
    if input_dir is not None:
        return _location(input_dir)
    if not acc.project_configuration.automatic_checkpoint_naming:
        raise ConfigError(
            "load_state() needs input_dir unless ProjectConfiguration("
            "automatic_checkpoint_naming=True) is set."
        )
    root = _auto_root(acc)
    source = remote.latest_checkpoint(root) if isinstance(root, str) else latest_checkpoint(root)
    if source is None:
        raise FileNotFoundError(f"no complete checkpoint under {str(root)!r}.")
    return source


def load_state(
    acc: Any,
    input_dir: str | os.PathLike[str] | None = None,
    *,
    weights_only: bool = True,
    strict: bool = True,
) -> str:
    """Restore what :func:`save_state` wrote; return the directory loaded.

    Args:
        acc: the Accelerator, after ``prepare`` (replicated training: any ranks; FSDP:
            every rank).
        input_dir: a checkpoint directory or URL; ``None`` with automatic naming loads the
            latest complete ``checkpoint_{i}`` under ``project_dir`` and continues
            numbering after it.
        weights_only: keep True; False lets torch unpickle arbitrary objects (trusted files only).
        strict: model keys must match exactly.
    """
    collective = acc.strategy.collective_state
    if collective:
        rank_check.all_ranks_enter("load_state", FIX)
    error: BaseException | None = None
    source: Path | str | None = None
    try:
        if not collective:
            _await_own_save(acc, input_dir)
        source = _source(acc, input_dir)
        if isinstance(source, str):
            from ._checkpoint_remote import fetched

            with fetched(source) as (folder, manifest):
                acc._loaded_save_id = manifest.get("save_id", "")
                _check_counts(acc, manifest, source)
                _load_into(acc, folder, manifest, weights_only=weights_only, strict=strict)
        elif _rank_files_only(acc, source):
            _restore_rank(acc, source, None, weights_only=weights_only)
        else:
            manifest = read_manifest(source)
            acc._loaded_save_id = manifest.get("save_id", "")
            _check_counts(acc, manifest, source)
            _load_into(acc, source, manifest, weights_only=weights_only, strict=strict)
    except Exception as err:
        error = err
    if collective:  # a rank that failed would leave the others in the shards' collectives
        all_ok(acc, error, "load_state")
    elif error is not None:
        raise error
    assert source is not None
    _continue_save_ids(acc)
    match = AUTO_NAME.fullmatch(basename(source) if isinstance(source, str) else source.name)
    if acc.project_configuration.automatic_checkpoint_naming and match:
        acc.project_configuration.iteration = int(match.group(1)) + 1
    # the launcher says it in the cell when a restarted run resumes (no-op outside a launch)
    events.publish("checkpoint_loaded", path=str(source), at_step=acc.step)
    return str(source)


def _continue_save_ids(acc: Any) -> None:
    """After a load, number the saves at the restored step after the loaded one.

    A save id counts saves per step (:func:`._checkpoint_write.save_id_for`); the step
    goes back to the checkpoint's, so without this the next save there would reuse the
    loaded checkpoint's id and be taken for it. Every rank reads the same manifest, so the
    ranks stay in agreement.
    """
    loaded = getattr(acc, "_loaded_save_id", "")
    parts = str(loaded).split(".")
    if len(parts) == 4 and parts[2].isdigit() and parts[3].isdigit() and int(parts[2]) == acc.step:
        acc._save_count = (acc.step, int(parts[3]))


def _await_own_save(acc: Any, input_dir: str | os.PathLike[str] | None) -> None:
    """Before loading a checkpoint this rank helped save, wait until it is published.

    A rank other than the main process returns from ``save_state`` as soon as its own
    file is written; a ``load_state`` right after (of that checkpoint, or of the latest
    one) must not read the previous checkpoint while the main process still writes the
    new one. Bounded by the process-group timeout: a main process that never saves it
    gives an error, not a hang.
    """
    pending = getattr(acc, "_unpublished_save", None)
    if pending is None:
        return
    target, before = pending  # what the target held when this rank wrote its file
    if input_dir is not None:
        where = _location(input_dir)
        if (where if isinstance(where, str) else where.absolute()) != target:
            return
    if not _needs_shared(acc):
        return  # nothing shared to wait for (e.g. each rank saved to its own directory)
    published = remote.manifest_save_id if isinstance(target, str) else manifest_save_id
    seconds = rank_check.timeout_seconds()
    deadline, pause = time.monotonic() + seconds, 0.01
    while published(target) == before:  # until this save (or a later one) is in
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"rank {acc.state.rank} saved its part of {str(target)!r} but the main process "
                f"did not publish that checkpoint within {seconds:g} s (the process-group "
                "timeout). Call save_state on the main process too (every rank, or the main "
                "process alone), or load a checkpoint the main process saved."
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
    acc._unpublished_save = None


def _needs_shared(acc: Any) -> bool:
    """True if loading restores more than this rank's own RNG and loader state."""
    shared = [acc._models, acc._optimizers, acc._schedulers, acc._custom_objects]
    return any(shared) or bool(acc.precision.state_dict())


def _rank_files_only(acc: Any, source: Path) -> bool:
    """True for a directory in which this rank saved alone (no manifest: e.g. each rank
    passed its own temporary directory); fine while nothing shared is to be restored."""
    if (source / MANIFEST).exists() or not (source / f"rank_{acc.state.rank}.pt").is_file():
        return False
    if _needs_shared(acc):
        raise CheckpointError(
            f"{str(source)!r} holds only rank {acc.state.rank}'s own state (RNG, dataloader "
            "positions), not the models and optimizers: the main process saved those in the "
            "directory it was given. Pass the same directory to save_state and load_state on "
            "every rank."
        )
    return True


def _load_full(
    acc: Any, source: Path, manifest: dict[str, Any], *, weights_only: bool, strict: bool
) -> None:
    for i, model in enumerate(models_to_load(acc, source)):  # after the load pre-hooks
        name = (
            f"model{suffix(i)}.safetensors"
            if manifest.get("safe_serialization", True)
            else f"pytorch_model{suffix(i)}.bin"
        )
        acc.strategy.load_model_state_dict(
            model, read_weights(source / name, weights_only=weights_only), strict=strict
        )
    for i, optimizer in enumerate(acc._optimizers):
        acc.strategy.load_optimizer_state_dict(
            optimizer, torch_load(source / f"optimizer{suffix(i)}.bin", weights_only=weights_only)
        )


def _load_into(
    acc: Any, source: Path, manifest: dict[str, Any], *, weights_only: bool, strict: bool
) -> None:
    if holds_sharded(source):  # one shard per rank (FSDP): DCP reshards to this run
        load_sharded(acc, source, strict=strict)
    else:
        _load_full(acc, source, manifest, weights_only=weights_only, strict=strict)
    for i, scheduler in enumerate(acc._schedulers):
        scheduler.load_state_dict(
            torch_load(source / f"scheduler{suffix(i)}.bin", weights_only=weights_only)
        )
    if manifest.get("scaler"):
        acc.precision.load_state_dict(torch_load(source / "scaler.pt", weights_only=weights_only))
    for i, obj in enumerate(acc._custom_objects):
        obj.load_state_dict(
            decode(torch_load(source / f"custom_checkpoint_{i}.pkl", weights_only=weights_only))
        )
    _restore_rank(acc, source, manifest, weights_only=weights_only)
    acc.step = int(manifest.get("step", 0))


def _rank_state(source: Path, rank: int, save_id: str, weights_only: bool) -> dict[str, Any] | None:
    """Rank ``rank``'s file of this save (``None``: absent, or left by another save)."""
    if not (source / f"rank_{rank}.pt").is_file():
        return None
    if weights_only:
        state = read_rank_file(source, rank)
    else:
        state = torch_load(source / f"rank_{rank}.pt", weights_only=False)
    if state is None or (save_id and state.get("save_id") != save_id):
        return None
    decoded: dict[str, Any] = decode(state)
    return decoded


def _restore_rank(
    acc: Any, source: Path, manifest: dict[str, Any] | None, *, weights_only: bool
) -> None:
    from ..process.rng import set_rng_state

    rank = acc.state.rank
    save_id = str(manifest.get("save_id", "")) if manifest is not None else ""
    own = _rank_state(source, rank, save_id, weights_only)
    if own is None:
        main = _rank_state(source, 0, save_id, weights_only) if manifest is not None else None
        saved_by = "the main process alone" if main is not None else "no rank"
        warnings.warn(
            f"{source} has no RNG state of rank {rank} for this save (saved by {saved_by}, with "
            f"world size {(manifest or {}).get('world_size')}): rank {rank} keeps its current "
            "RNG state. Call save_state on every rank to save every rank's RNG state.",
            stacklevel=4,
        )
        if main is not None:  # positions are the same on every rank: the main's serve
            _restore_loaders(acc, source, main.get("dataloaders", []))
        return
    _restore_loaders(acc, source, own.get("dataloaders", []))
    if manifest is None:
        acc.step = int(own.get("step", acc.step))
    set_rng_state(own["rng"])  # last: nothing above may consume the restored streams


def _restore_loaders(acc: Any, source: Path, states: list[Any]) -> None:
    """Epoch, seed and generators of every prepared loader; the position inside the epoch
    only for loaders prepared with ``use_stateful_dataloader=True`` (Accelerate's rule)."""
    if len(states) != len(acc._dataloaders):
        warnings.warn(
            f"{source} holds {len(states)} dataloader states, this Accelerator prepared "
            f"{len(acc._dataloaders)}; restoring the first {min(len(states), len(acc._dataloaders))}.",
            stacklevel=4,
        )
    for dataloader, state in zip(acc._dataloaders, states, strict=False):
        if not getattr(dataloader, "use_stateful_dataloader", False):
            state = {**state, "batches_yielded": 0}  # the epoch starts over
        dataloader.load_state_dict(state)


__all__ = [
    "MANIFEST",
    "CheckpointError",
    "latest_checkpoint",
    "load_state",
    "read_manifest",
    "save_state",
]
