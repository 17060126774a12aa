"""Saving state that every rank must write together (FSDP: each rank holds a shard).

All ranks enter (checked first, see :mod:`nbaccel.runtime.process.rank_check`), agree on a
token, write into ``.<name>.tmp-<token>`` next to the target (model and optimizer
shards with ``torch.distributed.checkpoint``, or full files gathered to the main
process), exchange success flags, then the main process (each node's, with
``save_on_each_node``) writes the manifest and swaps the directory into place.

Nodes without a shared filesystem: global rank 0 first puts a marker into the
temporary directory; the local main of every node whose ranks cannot see it writes
the shared files itself and publishes a complete copy on its own disk, so
``load_state`` finds everything each rank needs on every node.

Example:
    >>> FIX.startswith("under FSDP")
    True
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

from ...checkpoint.directory import VISIBILITY_MARKER, all_ok, from_main, publish
from ...checkpoint.durable import make_dirs
from ...checkpoint.weights import torch_save
from ...platform.process_env import distributed_active
from ._checkpoint_write import check_target, rank_payload, write_error, write_shared
from .hooks import weights_to_save
from .sharded_state import save_sharded

FIX = (
    "under FSDP every rank holds a shard of the model, so every rank must call it: move the "
    "call out of `if accelerator.is_main_process:` (nbaccel writes each file from the right "
    "rank itself)."
)


def _gather_states(acc: Any, tmp: Path) -> tuple[list[Any], list[Any]]:
    """Model and optimizer states, made on every rank (FSDP gathers them with collectives);
    a strategy with sharded checkpoints has every rank write its shard instead."""
    if acc.strategy.sharded_checkpoints:
        save_sharded(acc, tmp)
        return [], []
    models = weights_to_save(acc, tmp)  # after the save pre-hooks (on every rank, as the peer)
    return models, [acc.strategy.optimizer_state_dict(opt) for opt in acc._optimizers]


def _nodes_without_node0_files(acc: Any, marker: Path) -> set[int]:
    """Node ranks on which some rank cannot see ``marker`` (written on node 0)."""
    import torch

    seen = (acc.state.node_rank, marker.is_file())
    if not distributed_active():
        return set() if seen[1] else {seen[0]}
    views: list[Any] = [None] * acc.state.world_size
    torch.distributed.all_gather_object(views, seen)
    return {node for node, visible in views if not visible}


def save_collective(acc: Any, target: Path, safe_serialization: bool) -> None:
    """Save with every rank taking part (call on every rank, after the entry check)."""
    config, state = acc.project_configuration, acc.state
    token = from_main(acc, uuid.uuid4().hex[:12])
    tmp = target.parent / f".{target.name}.tmp-{token}"
    # Phase 1: global rank 0 creates the temporary directory with a marker in it.
    error: BaseException | None = None
    if state.is_main_process:
        try:
            check_target(target)
            make_dirs(tmp)
            (tmp / VISIBILITY_MARKER).write_bytes(b"")
        except Exception as err:
            error = write_error(err, target)
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
            check_target(target)
        make_dirs(tmp)
        models, optimizers = _gather_states(acc, tmp)
        if writes_shared:
            write_shared(acc, tmp, safe_serialization, models, optimizers)
        payload = {**rank_payload(acc), "save_id": token, "rank": state.rank}
        torch_save(payload, tmp / f"rank_{state.rank}.pt")
    except Exception as err:
        error = write_error(err, target)
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
                error = write_error(err, target)
        all_ok(acc, error, "save_state (publishing)")


__all__ = ["FIX", "save_collective"]
