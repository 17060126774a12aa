"""The global-stream draws a plain ``DataLoader`` makes when an epoch starts, made replayable.

A plain ``DataLoader`` (and so Accelerate's prepared one) draws from torch's global RNG at
each ``iter()``: first the iterator's *base seed* (the seed of its worker processes) unless
the loader has a ``generator``, then -- at the first batch -- the shuffle seed of a
``RandomSampler`` that has no generator. nbaccel makes the very same draws, in the same
order and from the same stream, but computes them from a snapshot of the global state
taken at the epoch's start (:func:`plan_epoch_draws`). A checkpoint saved mid-epoch keeps
that snapshot, so the resumed run replays the epoch's start from it instead of drawing
again: the uninterrupted run drew before the checkpoint, whose RNG state already includes
those draws.

Example:
    >>> import torch
    >>> _ = torch.manual_seed(0)
    >>> base, seeds, start = plan_epoch_draws(base=True, samplers=1, replay=None)
    >>> after = torch.rand(1)
    >>> _ = torch.manual_seed(0)
    >>> plain_base, plain_seed = draw_seed(None), draw_seed(None)
    >>> draw_seed(base) == plain_base and seeds == [plain_seed] and bool(torch.rand(1) == after)
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def draw_seed(generator: torch.Generator | None) -> int:
    """One 64-bit draw, exactly as ``DataLoader`` and ``RandomSampler`` make theirs."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def plan_epoch_draws(
    *, base: bool, samplers: int, replay: torch.Tensor | None
) -> tuple[torch.Generator | None, list[int], torch.Tensor | None]:
    """The epoch-start draws: ``(base_seed_generator, sampler_seeds, start_state)``.

    Args:
        base: the loader draws its iterator's base seed from the global stream.
        samplers: how many generator-less ``RandomSampler`` seeds follow that draw.
        replay: the global state saved at this epoch's start (a resumed run): the draws
            are recomputed from it and the global stream is left alone. ``None``: the
            draws are taken from the global stream now, which advances as it would
            under a plain loader.

    Returns:
        A generator to hand the ``DataLoader`` for its base-seed draw (its first draw is
        the one the global stream would have given), the samplers' seeds, and the state
        the draws started from (to save in a checkpoint); ``(None, [], None)`` when the
        epoch draws nothing from the global stream.
    """
    if not base and not samplers:
        return None, [], None
    start = replay if replay is not None else torch.get_rng_state()
    follow = torch.Generator()
    follow.set_state(start)
    base_generator = None
    if base:
        base_generator = torch.Generator()
        base_generator.set_state(start)
        draw_seed(follow)
    seeds = [draw_seed(follow) for _ in range(samplers)]
    if replay is None:
        torch.set_rng_state(follow.get_state())  # the global stream, as the plain loader left it
    return base_generator, seeds, start


@dataclass
class LoaderProgress:
    """Epoch and position of a prepared loader; shared with its ``skip_first_batches`` views."""

    seed: int | None = None  # use_seedable_sampler: the sampler's initial seed
    # the generators' states at the start of the current iteration (to replay it)
    generator_states: list[torch.Tensor] | None = None
    # the global RNG state the current iteration's start drew from (to replay it)
    rng_at_start: torch.Tensor | None = None
    replay_rng: torch.Tensor | None = None  # set by load_state_dict: the next start replays
    epoch: int = 0  # epoch of the current (or last) iteration
    next_epoch: int = 0  # advances when an iteration ends (Accelerate's `iteration`)
    batches_yielded: int = 0
    in_progress: bool = False
    pending_skip: int = 0


__all__ = ["LoaderProgress", "draw_seed", "plan_epoch_draws"]
