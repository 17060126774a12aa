"""Which rank is slow? The rule the live monitor marks stragglers by.

A rank is a **straggler** when the median of its last :data:`~nbaccel.ui._history.RECENT`
(5) step-time reports is more than :data:`FACTOR` (1.5) times the median of the other
ranks' medians, *and* more than :data:`FLOOR` (10 ms) above it -- the floor keeps
scheduler jitter on millisecond steps from being flagged. Each rank needs 2 reports
and the run at least 2 ranks.

The step time compared is the step clock's ``busy`` time: per optimizer update, the
wall time outside ``accelerator.backward`` (data, forward, optimizer, the user's own
code). Wall time per step cannot tell: under DDP the fast ranks wait for the slow one
inside the backward pass (the gradient all-reduce), so every rank takes as long as
the slowest. A rank that is slow *inside* the backward pass itself (a slower device
computing the gradients) is therefore not told apart. Without the step clock (no
prepared optimizer) the seconds per step between two ``Accelerator.log`` calls are
compared instead.

Example:
    >>> find_stragglers({0: [0.5, 0.5], 1: [0.25, 0.25], 2: [2.0, 2.0]})
    {2: (2.0, 0.375)}
"""

from __future__ import annotations

import statistics

FACTOR = 1.5
FLOOR = 0.010


def find_stragglers(
    recent: dict[int, list[float]], *, factor: float = FACTOR, floor: float = FLOOR
) -> dict[int, tuple[float, float]]:
    """``{rank: (its median, the others' median)}`` for every rank the rule marks."""
    medians = {rank: statistics.median(v) for rank, v in recent.items() if len(v) >= 2}
    if len(medians) < 2:
        return {}
    marked = {}
    for rank, mine in medians.items():
        others = statistics.median(m for r, m in medians.items() if r != rank)
        if mine > factor * others and mine - others > floor:
            marked[rank] = (mine, others)
    return marked


__all__ = ["FACTOR", "FLOOR", "find_stragglers"]
