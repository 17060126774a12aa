"""Atomic training checkpoints (save_state / load_state) and model export (save_model).

A checkpoint directory holds the unwrapped models (safetensors), optimizers,
schedulers, the GradScaler, every registered custom object, and one file per
rank with that rank's RNG states and dataloader positions, plus a manifest
(``nbaccel_checkpoint.json``) listing every file and its size.

Atomicity: all ranks write into ``.<name>.tmp-<token>`` next to the target (the
token is agreed via broadcast), every file is fsynced, the ranks exchange a
success flag, then the main process (each node's, with ``save_on_each_node``)
writes the manifest and swaps the directory into place (an atomic exchange where
the filesystem allows it, see :func:`nbaccel.checkpoint.directory.publish`). A
process killed at any point leaves the previous checkpoint loadable and no
directory that :func:`load_state` accepts: it refuses anything without a valid
manifest. A write that fails (full disk, read-only directory) raises a
``CheckpointError`` naming the path, the reason and the fix.

Nodes without a shared filesystem: global rank 0 first puts a marker into the
temporary directory; the local main of every node whose ranks cannot see it
writes the shared files itself and publishes a complete copy on its own disk, so
``load_state`` finds everything each rank needs on every node.

Every function that takes ``acc`` must be called on every rank, except
``save_model`` and ``save``, which only write on the main process.

Example:
    >>> path = accelerator.save_state("ckpt")  # doctest: +SKIP
    >>> accelerator.load_state(path)  # doctest: +SKIP
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

from ..checkpoint.directory import (
    AUTO_NAME,
    MANIFEST,
    VISIBILITY_MARKER,
    all_ok,
    checkpoints_root,
    decode,
    encode,
    from_main,
    latest_checkpoint,
    prune,
    publish,
    read_manifest,
)
from ..checkpoint.durable import make_dirs
from ..checkpoint.weights import (
    CheckpointError,
    dedupe_tied,
    read_weights,
    torch_load,
    torch_save,
    write_safetensors,
)
from ..errors import ConfigError
from ..platform.process_env import distributed_active
from .hooks import models_to_load, weights_to_save
from .sharded_state import holds_sharded, load_sharded, save_sharded

# -- save_state ---------------------------------------------------------------------------


def _suffix(i: int) -> str:
    return "" if i == 0 else f"_{i}"


def _gather_states(acc: Any, tmp: Path) -> tuple[list[Any], list[Any]]:
    """Model and optimizer states, made on every rank (FSDP gathers them with collectives);
    a strategy with sharded checkpoints has every rank write its shard instead."""
    if acc.strategy.sharded_checkpoints:
        save_sharded(acc, tmp)
        return [], []
    models = weights_to_save(acc, tmp)  # after the save pre-hooks (on every rank, as the peer)
    return models, [acc.strategy.optimizer_state_dict(opt) for opt in acc._optimizers]


def _write_shared(
    acc: Any, tmp: Path, safe_serialization: bool, models: list[Any], optimizers: list[Any]
) -> None:
    """Files that are identical on every rank: written once (per node with save_on_each_node)."""
    for i, state in enumerate(models):
        if safe_serialization:
            tensors, aliases = dedupe_tied(state)
            write_safetensors(tensors, tmp / f"model{_suffix(i)}.safetensors", aliases)
        else:
            torch_save(
                {k: v.detach().cpu() for k, v in state.items()},
                tmp / f"pytorch_model{_suffix(i)}.bin",
            )
    for i, optimizer_state in enumerate(optimizers):
        torch_save(optimizer_state, tmp / f"optimizer{_suffix(i)}.bin")
    for i, scheduler in enumerate(acc._schedulers):
        torch_save(scheduler.state_dict(), tmp / f"scheduler{_suffix(i)}.bin")
    scaler_state = acc.precision.state_dict()
    if scaler_state:
        torch_save(scaler_state, tmp / "scaler.pt")
    for i, obj in enumerate(acc._custom_objects):
        torch_save(encode(obj.state_dict()), tmp / f"custom_checkpoint_{i}.pkl")


def _write_rank(acc: Any, tmp: Path) -> None:
    from .rng import get_rng_state

    state = {
        "rng": get_rng_state(),
        "dataloaders": [dl.state_dict() for dl in acc._dataloaders],
    }
    torch_save(encode(state), tmp / f"rank_{acc.state.rank}.pt")


def save_state(
    acc: Any, output_dir: str | os.PathLike[str] | None = None, *, safe_serialization: bool = True
) -> str:
    """Save everything needed to resume training; return the checkpoint directory.

    Args:
        acc: the Accelerator (call on every rank).
        output_dir: where to save; ``None`` with automatic naming means
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
        target = checkpoints_root(acc) / f"checkpoint_{config.iteration}"
    else:
        target = Path(output_dir)
    target = target.absolute()
    token = from_main(acc, uuid.uuid4().hex[:12])
    tmp = target.parent / f".{target.name}.tmp-{token}"
    state = acc.state
    # Phase 1: global rank 0 creates the temporary directory with a marker in it. A node
    # whose ranks cannot see the marker shares no filesystem with node 0: its local main
    # then writes the shared files and publishes a complete copy there itself, so every
    # node finds what its ranks need (as with save_on_each_node).
    error: BaseException | None = None
    if state.is_main_process:
        try:
            _check_target(target)
            make_dirs(tmp)
            (tmp / VISIBILITY_MARKER).write_bytes(b"")
        except Exception as err:
            error = _write_error(err, target)
    try:
        all_ok(acc, error, "save_state")
    except BaseException:
        if state.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    separate = _nodes_without_node0_files(acc, tmp / VISIBILITY_MARKER)
    writes_shared = state.is_main_process or (
        state.is_local_main_process and (config.save_on_each_node or state.node_rank in separate)
    )
    error = None
    try:
        if writes_shared and not state.is_main_process:
            _check_target(target)
        make_dirs(tmp)
        models, optimizers = _gather_states(acc, tmp)
        if writes_shared:
            _write_shared(acc, tmp, safe_serialization, models, optimizers)
        _write_rank(acc, tmp)
    except Exception as err:
        error = _write_error(err, target)
    try:
        all_ok(acc, error, "save_state")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # rename node by node so that mains sharing one filesystem never race
    for node in range(state.num_nodes):
        error = None
        if writes_shared and state.node_rank == node:
            try:
                publish(acc, tmp, target, token, safe_serialization)
            except Exception as err:
                shutil.rmtree(tmp, ignore_errors=True)
                error = _write_error(err, target)
        all_ok(acc, error, "save_state (publishing)")
    if auto:
        config.iteration += 1
        error = None
        if state.is_main_process:
            try:
                prune(acc, target.parent)
            except Exception as err:
                error = err
        # nobody looks for "the latest checkpoint" while old ones are being removed
        all_ok(acc, error, "save_state (pruning)")
    return str(target)


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


def _write_error(err: Exception, target: Path) -> Exception:
    """A save that could not write: say where, why, that the previous copy is intact, the fix."""
    if isinstance(err, ConfigError | CheckpointError):
        return err
    code = _os_errno(err)
    reason = os.strerror(code) if code is not None else f"{type(err).__name__}: {err}"
    fix = _WRITE_FIXES.get(code or -1, "check the directory and the disk")
    wrapped = CheckpointError(
        f"save_state could not write {str(target)!r}: {reason} ({type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}). The previous checkpoint is "
        f"untouched and still loads; nothing half-written is left. Fix: {fix}."
    )
    wrapped.__cause__ = err
    return wrapped


def _check_target(target: Path) -> None:
    occupied = target.exists() and (not target.is_dir() or any(target.iterdir()))
    if occupied and not (target / MANIFEST).is_file():
        raise ConfigError(
            f"save_state will not overwrite {str(target)!r}: it exists and is not an nbaccel "
            "checkpoint. Choose an empty or new directory."
        )


def _nodes_without_node0_files(acc: Any, marker: Path) -> set[int]:
    """Node ranks on which some rank cannot see ``marker`` (written on node 0)."""
    import torch

    seen = (acc.state.node_rank, marker.is_file())
    if not distributed_active():
        return set() if seen[1] else {seen[0]}
    views: list[Any] = [None] * acc.state.world_size
    torch.distributed.all_gather_object(views, seen)
    return {node for node, visible in views if not visible}


# -- load_state ---------------------------------------------------------------------------


def _check_counts(acc: Any, manifest: dict[str, Any], source: Path) -> None:
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


def load_state(
    acc: Any,
    input_dir: str | os.PathLike[str] | None = None,
    *,
    weights_only: bool = True,
    strict: bool = True,
) -> str:
    """Restore what :func:`save_state` wrote; return the directory loaded.

    Args:
        acc: the Accelerator (call on every rank, after ``prepare``).
        input_dir: a checkpoint directory; ``None`` with automatic naming loads the latest
            complete ``checkpoint_{i}`` and continues numbering after it.
        weights_only: keep True; False lets torch unpickle arbitrary objects (trusted files only).
        strict: model keys must match exactly.
    """
    config = acc.project_configuration
    error: BaseException | None = None
    source: Path | None = None
    try:
        if input_dir is None:
            if not config.automatic_checkpoint_naming:
                raise ConfigError(
                    "load_state() needs input_dir unless ProjectConfiguration("
                    "automatic_checkpoint_naming=True) is set."
                )
            source = latest_checkpoint(checkpoints_root(acc))
            if source is None:
                raise FileNotFoundError(
                    f"no complete checkpoint under {str(checkpoints_root(acc))!r}."
                )
        else:
            source = Path(input_dir)
        manifest = read_manifest(source)
        _check_counts(acc, manifest, source)
        _load_into(acc, source, manifest, weights_only=weights_only, strict=strict)
    except Exception as err:
        error = err
    all_ok(acc, error, "load_state")
    assert source is not None
    match = AUTO_NAME.fullmatch(source.name)
    if config.automatic_checkpoint_naming and match:
        config.iteration = int(match.group(1)) + 1
    return str(source)


def _load_full(
    acc: Any, source: Path, manifest: dict[str, Any], *, weights_only: bool, strict: bool
) -> None:
    for i, model in enumerate(models_to_load(acc, source)):  # after the load pre-hooks
        name = (
            f"model{_suffix(i)}.safetensors"
            if manifest.get("safe_serialization", True)
            else f"pytorch_model{_suffix(i)}.bin"
        )
        acc.strategy.load_model_state_dict(
            model, read_weights(source / name, weights_only=weights_only), strict=strict
        )
    for i, optimizer in enumerate(acc._optimizers):
        acc.strategy.load_optimizer_state_dict(
            optimizer, torch_load(source / f"optimizer{_suffix(i)}.bin", weights_only=weights_only)
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
            torch_load(source / f"scheduler{_suffix(i)}.bin", weights_only=weights_only)
        )
    if manifest.get("scaler"):
        acc.precision.load_state_dict(torch_load(source / "scaler.pt", weights_only=weights_only))
    for i, obj in enumerate(acc._custom_objects):
        obj.load_state_dict(
            decode(torch_load(source / f"custom_checkpoint_{i}.pkl", weights_only=weights_only))
        )
    rank_file = source / f"rank_{acc.state.rank}.pt"
    if not rank_file.is_file():
        warnings.warn(
            f"{source} has no state for rank {acc.state.rank} (saved with world size "
            f"{manifest.get('world_size')}); RNG states and dataloader positions are not restored.",
            stacklevel=3,
        )
    else:
        from .rng import set_rng_state

        per_rank = decode(torch_load(rank_file, weights_only=weights_only))
        loaders = per_rank.get("dataloaders", [])
        if len(loaders) != len(acc._dataloaders):
            warnings.warn(
                f"{source} holds {len(loaders)} dataloader positions, this Accelerator prepared "
                f"{len(acc._dataloaders)}; restoring the first {min(len(loaders), len(acc._dataloaders))}.",
                stacklevel=3,
            )
        for dataloader, state in zip(acc._dataloaders, loaders, strict=False):
            dataloader.load_state_dict(state)
        set_rng_state(per_rank["rng"])  # last: nothing above may consume the restored streams
    acc.step = int(manifest.get("step", 0))


__all__ = [
    "MANIFEST",
    "CheckpointError",
    "latest_checkpoint",
    "load_state",
    "read_manifest",
    "save_state",
]
