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

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# (first fetch, how many, global RNG state before the first): what a batch read ahead drew
Lookahead = tuple[int, int, torch.Tensor]


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
    lookahead: Lookahead | None = None  # the fetches read ahead of the last batch yielded
    replay_fetch: Lookahead | None = None  # set by load_state_dict: the next iteration replays
    epoch: int = 0  # epoch of the current (or last) iteration
    next_epoch: int = 0  # advances when an iteration ends (Accelerate's `iteration`)
    batches_yielded: int = 0
    in_progress: bool = False
    at_end: bool = False  # the last batch was yielded (the iteration may not have ended)
    pending_skip: int = 0


class FetchLog:
    """A loader's raw batches, counted, with the global RNG state before the recent ones.

    The prepared loader reads one batch ahead (to know the last one, as Accelerate's does),
    so a checkpoint taken inside a step already holds the global draws of loading the
    *next* batch (a masking collate function, an augmenting dataset, without workers).
    :meth:`lookahead` names those fetches and the state before them; an iteration resumed
    with them (``replay``) loads them again from that state -- and whatever it loads before
    them from a scratch copy of it -- then puts the checkpoint's state back, so the global
    stream goes on exactly as in the uninterrupted run.
    """

    def __init__(self, source: Iterator[Any], *, start: int, replay: Lookahead | None) -> None:
        self._source = source
        self.count = start  # fetches made in this epoch (skipped indices count)
        self._before: deque[tuple[int, torch.Tensor]] = deque(maxlen=64)
        self._replay = replay
        self._resume: torch.Tensor | None = None

    def __iter__(self) -> FetchLog:
        return self

    def __next__(self) -> Any:
        fetch = self.count + 1
        if self._replay is not None:
            self._enter_replay(fetch)
        self._before.append((fetch, torch.get_rng_state()))
        try:
            item = next(self._source)
        except StopIteration:
            self.finish()
            raise
        self.count = fetch
        return item

    def _enter_replay(self, fetch: int) -> None:
        first, many, state = self._replay  # type: ignore[misc]
        if self._resume is None:
            self._resume = torch.get_rng_state()  # the checkpoint's stream: put back after
            if fetch < first:
                torch.set_rng_state(state)  # batches the script skips: a scratch stream
        if fetch == first:
            torch.set_rng_state(state)
        elif fetch >= first + many:
            self.finish()

    def finish(self) -> None:
        """End a replay: the global stream is the checkpoint's again."""
        if self._resume is not None:
            torch.set_rng_state(self._resume)
        self._replay = self._resume = None

    def lookahead(self, mark: int) -> Lookahead | None:
        """The fetches made after the first ``mark`` (read ahead), and the state before them."""
        state = next((s for n, s in self._before if n == mark + 1), None)
        return None if self.count <= mark or state is None else (mark + 1, self.count - mark, state)


__all__ = ["FetchLog", "LoaderProgress", "Lookahead", "draw_seed", "plan_epoch_draws"]
