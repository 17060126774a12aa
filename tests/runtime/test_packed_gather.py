"""gather's one-collective wire format over a real 2-process gloo group.

Once a group has gathered, a gather whose data fits the agreed capacity costs one
``all_gather`` (shapes and data together); one that does not fit, or that is too big to
speculate on, costs two; a mismatch raises on every rank after the first. The
collectives are real: the count comes from a pass-through wrapper around
``torch.distributed.all_gather``.
"""

from __future__ import annotations

from typing import Any

import torch

from nbaccel.launch.testing import run_on_workers


def _counting_gathers() -> dict[str, Any]:
    import torch.distributed as dist

    from nbaccel.runtime.collectives import ops
    from nbaccel.runtime.process.state import get_state, reset_state

    reset_state()
    rank = get_state().rank
    calls = [0]
    real = dist.all_gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    dist.all_gather = counted  # the real collective, counted
    out: dict[str, Any] = {"steps": [], "wrong": []}

    def step(name: str, data: Any, want: Any, uneven: bool = False) -> None:
        before = calls[0]
        got = ops.gather(data, allow_uneven=uneven)
        out["steps"].append((name, calls[0] - before))
        for g, w in zip(ops._leaves(got), ops._leaves(want), strict=True):
            if g.dtype != w.dtype or not torch.equal(g, w):
                out["wrong"].append((name, g.tolist(), w.tolist()))

    def both(make: Any) -> torch.Tensor:
        return torch.cat([make(r) for r in (0, 1)])

    batch = lambda r, n=64: torch.arange(n) + 1000 * r  # noqa: E731
    logits = lambda r, n=64: torch.full((n, 10), float(r))  # noqa: E731
    step("first", (logits(rank), batch(rank)), (both(logits), both(batch)))
    for i in range(3):
        step(f"steady {i}", (logits(rank), batch(rank)), (both(logits), both(batch)))
    last = (63, 60)  # an uneven last batch fits the capacity
    step(
        "uneven",
        (logits(rank, last[rank]), batch(rank, last[rank])),
        (both(lambda r: logits(r, last[r])), both(lambda r: batch(r, last[r]))),
        uneven=True,
    )
    step("smaller", torch.tensor([rank]), both(lambda r: torch.tensor([r])))
    step("bigger", batch(rank, 1000), both(lambda r: batch(r, 1000)))
    step("bigger again", batch(rank, 1000), both(lambda r: batch(r, 1000)))
    huge = lambda r: torch.full((300_000,), r, dtype=torch.uint8)  # noqa: E731  # > 256 KiB
    step("huge", huge(rank), both(huge))
    step("huge again", huge(rank), both(huge))
    step("small after huge", batch(rank), both(batch))
    mixed = lambda r: (  # noqa: E731
        torch.tensor([r], dtype=torch.bool),
        torch.full((3,), r, dtype=torch.bfloat16),
        torch.full((2,), r, dtype=torch.float64),
        torch.full((1,), r, dtype=torch.complex64),
    )
    mine, theirs = mixed(rank), [mixed(0), mixed(1)]
    step("mixed dtypes", mine, tuple(torch.cat([a, b]) for a, b in zip(*theirs, strict=True)))
    before = calls[0]
    try:
        ops.gather(torch.zeros(rank + 1))  # shapes differ: found in the headers
        out["mismatch"] = None
    except ValueError as err:
        out["mismatch"] = (str(err), calls[0] - before)
    step("after the mismatch", batch(rank), both(batch))
    dist.all_gather = real
    return out


def test_a_gather_costs_one_collective_once_the_group_has_gathered():
    for out in run_on_workers(_counting_gathers, num_processes=2):
        assert out["wrong"] == []
        steps = dict(out["steps"])
        assert steps.pop("first") == 2  # shapes unknown: header round, then data
        assert steps.pop("bigger") == 2  # did not fit the capacity
        assert steps.pop("huge") == 2 and steps.pop("huge again") == 2  # never speculated
        assert steps == dict.fromkeys(steps, 1), steps
        message, collectives = out["mismatch"]
        assert "tensor shapes differ" in message and collectives == 1
