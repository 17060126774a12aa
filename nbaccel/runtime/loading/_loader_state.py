"""A prepared loader's resumable state: ``state_dict()`` / ``load_state_dict()``.

Besides the epoch and the position inside it, a state saved mid-epoch holds what the
epoch's start drew (the samplers' generators' states and the global RNG state the base
seed and sampler seeds came from) and what the batch read ahead drew
(:mod:`._epoch_rng`): the resumed iteration replays both, so the run goes on exactly as
the uninterrupted one.

Example:
    >>> from torch.utils.data import DataLoader
    >>> from nbaccel.runtime.loading.data import prepare_data_loader
    >>> loader = prepare_data_loader(DataLoader(range(6), batch_size=2))
    >>> it = iter(loader); _ = next(it)
    >>> {k: loader.state_dict()[k] for k in ("epoch", "batches_yielded")}
    {'epoch': 0, 'batches_yielded': 1}
"""

from __future__ import annotations

from typing import Any

import torch

from ._epoch_rng import LoaderProgress


class ResumableLoader:
    """``state_dict``/``load_state_dict`` of :class:`~nbaccel.runtime.loading.data.PreparedDataLoader`."""

    progress: LoaderProgress
    _synced: tuple[torch.Generator, ...]
    _seedable: Any

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "batches_yielded", "seed"}`` (and the generators' and global RNG's
        states the epoch's start and the batch read ahead drew from): where to resume."""
        p = self.progress
        state: dict[str, Any]
        if p.in_progress and not p.at_end:
            state = {"epoch": p.epoch, "batches_yielded": p.batches_yielded, "seed": p.seed}
            generators = p.generator_states
            if p.rng_at_start is not None:
                state["rng_at_epoch_start"] = p.rng_at_start.clone()
            if p.lookahead is not None:
                state["rng_lookahead"] = list(p.lookahead)
        else:  # between epochs (or after the last batch): the next epoch starts afresh
            epoch = p.next_epoch + (1 if p.in_progress else 0)
            state = {"epoch": epoch, "batches_yielded": 0, "seed": p.seed}
            generators = [g.get_state() for g in self._synced]
        if generators:
            state["generator_states"] = [g.clone() for g in generators]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration replays ``epoch``'s order and skips the seen batches."""
        p = self.progress
        p.next_epoch = int(state.get("epoch", 0))
        p.pending_skip = int(state.get("batches_yielded", 0))
        p.replay_rng = state.get("rng_at_epoch_start")
        ahead = state.get("rng_lookahead")
        p.replay_fetch = None if ahead is None else (int(ahead[0]), int(ahead[1]), ahead[2])
        if state.get("seed") is not None:
            p.seed = int(state["seed"])
            if self._seedable is not None:
                self._seedable.initial_seed = p.seed
        for generator, saved in zip(
            self._synced, state.get("generator_states") or (), strict=False
        ):
            generator.set_state(saved)


__all__ = ["ResumableLoader"]
