"""nbaccel.runtime.loading.dispatch: concatenating and slicing collated batches (pure, one process)."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from nbaccel.runtime.loading.dispatch import BatchDispatcher, concatenate

Pair = namedtuple("Pair", ["x", "names"])


def test_concatenate_keeps_structure_and_lists_of_values():
    a = {"p": Pair(torch.arange(2), ["a", "b"]), "n": 7}
    b = {"p": Pair(torch.arange(2, 3), ["c"]), "n": 7}
    merged = concatenate([a, b])
    assert isinstance(merged["p"], Pair) and merged["n"] == 7
    assert merged["p"].x.tolist() == [0, 1, 2] and merged["p"].names == ["a", "b", "c"]


def test_slices_even_and_uneven():
    batch = (torch.arange(5), ["a", "b", "c", "d", "e"])
    even = [BatchDispatcher(2, r, split_batches=True) for r in range(2)]
    pieces = [d.slice(batch) for d in even]
    assert [p[0].tolist() for p in pieces] == [[0, 1, 2], [3, 4, 0]]  # completed with sample 0
    assert pieces[1][1] == ["d", "e", "a"] and even[1].remainder == 5
    uneven = [BatchDispatcher(4, r, split_batches=True, even_batches=False) for r in range(4)]
    assert [None if p is None else p[0].tolist() for p in (d.slice(batch) for d in uneven)] == [
        [0, 1],
        [2, 3],
        [4],
        None,  # the last rank gets no rows of this batch
    ]
    assert BatchDispatcher(2, 0).steps(5) == 3 and BatchDispatcher(2, 0, True).steps(5) == 5
    with pytest.raises(TypeError, match="dispatch_batches cannot split"):
        BatchDispatcher(2, 0).slice(3)


def test_stream_in_one_process_skips_consumed_steps():
    dispatcher = BatchDispatcher(1, 0)
    batches = [torch.tensor([i]) for i in range(4)]
    assert [b.tolist() for b in dispatcher.stream(lambda: batches, consume=1)] == [[1], [2], [3]]
