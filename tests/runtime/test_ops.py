"""nbaccel.runtime.collectives.ops: structure handling in one process, collectives over a real 2-process group."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import pytest
import torch

from nbaccel.launch.testing import run_on_workers
from nbaccel.runtime.collectives import ops
from nbaccel.runtime.process.state import get_state, reset_state

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Batch:
    inputs: torch.Tensor
    labels: list
    name: str = "b"


def test_send_to_device_keeps_every_container_type():
    batch = {
        "t": torch.ones(2),
        "pair": Pair(torch.zeros(1), [torch.ones(1), "keep"]),
        "tuple": (torch.ones(1),),
        "dc": Batch(torch.ones(3), [torch.zeros(2)]),
        "n": 3,
    }
    moved = ops.send_to_device(batch, torch.device("cpu"))
    assert isinstance(moved["pair"], Pair) and moved["pair"].y[1] == "keep"
    assert isinstance(moved["tuple"], tuple) and isinstance(moved["dc"], Batch)
    assert moved["dc"].name == "b" and moved["n"] == 3
    assert torch.equal(moved["dc"].inputs, torch.ones(3))

    class HasTo:  # e.g. a tokenizer's BatchEncoding
        def to(self, device, non_blocking=False):
            return ("moved", str(device))

    assert ops.send_to_device(HasTo(), "cpu") == ("moved", "cpu")


def test_single_process_collectives_are_identity():
    t = torch.arange(3)
    assert ops.gather(torch.tensor(2.0)).tolist() == [2.0]  # 0-d becomes 1-d
    assert ops.gather({"a": t})["a"] is t
    assert ops.gather_object([1, 2]) == [1, 2] and ops.gather_object("x") == ["x"]
    assert ops.reduce(t.float(), "mean").tolist() == [0.0, 1.0, 2.0]
    assert ops.broadcast(t) is t and ops.pad_across_processes(t) is t
    assert ops.reduce(t, "MAX").tolist() == [0, 1, 2]  # one process: unchanged copies
    with pytest.raises(ValueError, match="reduction='avg'"):
        ops.reduce(t, "avg")


@pytest.mark.parametrize(
    ("inputs", "shares"),
    [
        ([1, 2, 3, 4, 5], [[1, 2], [3, 4], [5]]),
        ((1, 2), [(1,), (2,), ()]),
        (
            {"a": [1, 2, 3, 4], "b": "wxyz"},
            [{"a": [1, 2], "b": "wx"}, {"a": [3], "b": "y"}, {"a": [4], "b": "z"}],
        ),
    ],
)
def test_split_between_processes_uneven(inputs, shares):
    assert [ops.split_between_processes(inputs, 3, r) for r in range(3)] == shares


def test_split_between_processes_padding_and_tensors():
    data = torch.arange(5)
    parts = [ops.split_between_processes(data, 3, r) for r in range(3)]
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3], [4]]
    padded = [ops.split_between_processes(data, 3, r, apply_padding=True) for r in range(3)]
    assert [p.tolist() for p in padded] == [[0, 1], [2, 3], [4, 4]]
    few = [ops.split_between_processes([7], 2, r, apply_padding=True) for r in range(2)]
    assert few == [[7], [7]]
    with pytest.raises(ValueError, match="same length"):
        ops.split_between_processes({"a": [1], "b": [1, 2]}, 2, 0)
    with pytest.raises(TypeError, match="split_between_processes got int"):
        ops.split_between_processes(5, 2, 0)


def _collectives():
    reset_state()
    rank = get_state().rank
    out: dict = {}
    out["gather"] = ops.gather(torch.tensor([rank, rank])).tolist()
    out["gather_scalar"] = ops.gather(torch.tensor(float(rank))).tolist()
    nested = ops.gather(
        {"h": torch.full((1, 2), rank, dtype=torch.float16), "b": (torch.tensor([rank == 1]),)}
    )
    out["gather_nested"] = (nested["h"].dtype, nested["h"].tolist(), nested["b"][0].tolist())
    out["uneven"] = ops.gather(torch.arange(rank + 1), allow_uneven=True).tolist()
    out["objects"] = (ops.gather_object([f"r{rank}"]), ops.gather_object({"rank": rank}))
    out["sum"] = ops.reduce(torch.tensor([1.0, rank]), "sum").tolist()
    out["reductions"] = {
        name: ops.reduce(torch.tensor([rank + 2]), name).tolist()
        for name in ("max", "min", "product", "none", "mean")
    }
    out["mean"] = ops.reduce({"m": torch.tensor([2.0 * rank])}, "mean", scale=10.0)["m"].tolist()
    t = torch.tensor([rank + 5.0])
    out["broadcast"] = (ops.broadcast(t, from_process=1) is t, t.tolist())
    lst = [f"from {rank}"]
    out["broadcast_obj"] = ops.broadcast_object_list(lst, from_process=0)
    ragged = torch.ones(2, rank + 1)
    out["pad_end"] = ops.pad_across_processes(ragged, dim=1, pad_index=-1).tolist()
    out["pad_first"] = ops.pad_across_processes(torch.ones(rank + 1), pad_first=True).tolist()
    errors = []
    for bad in (
        lambda: ops.gather(torch.zeros(rank + 1)),  # shapes differ
        lambda: ops.gather(torch.zeros(2, dtype=torch.float32 if rank else torch.int64)),
        lambda: ops.gather([torch.zeros(1)] * (rank + 1)),  # structures differ
        lambda: ops.gather(torch.zeros(2, rank + 1), allow_uneven=True),  # non-leading dim
        lambda: ops.reduce(torch.zeros(rank + 1)),
        lambda: ops.broadcast(torch.zeros(rank + 1)),
    ):
        try:
            bad()
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    out["errors"] = errors
    out["still_works"] = ops.gather(torch.tensor([rank])).tolist()  # the group is not poisoned
    # a structure too large for the fixed-size signature header takes the general path
    wide = ops.gather({f"k{i}": torch.full((1, 1, 1), rank + i) for i in range(20)})
    out["wide"] = [wide[f"k{i}"].flatten().tolist() for i in (0, 19)]
    try:  # the general path still detects mismatches
        ops.gather({f"k{i}": torch.zeros(1, 1, rank + 1) for i in range(20)})
        out["wide_error"] = None
    except ValueError as err:
        out["wide_error"] = str(err)
    return out


def test_collectives_on_two_processes():
    results = run_on_workers(_collectives, num_processes=2)
    for rank, out in enumerate(results):
        assert out["gather"] == [0, 0, 1, 1]
        assert out["gather_scalar"] == [0.0, 1.0]
        assert out["gather_nested"] == (torch.float16, [[0.0, 0.0], [1.0, 1.0]], [False, True])
        assert out["uneven"] == [0, 0, 1]
        assert out["objects"] == (["r0", "r1"], [{"rank": 0}, {"rank": 1}])
        assert out["sum"] == [2.0, 1.0] and out["mean"] == [10.0]
        assert out["reductions"] == {
            "max": [3],
            "min": [2],
            "product": [6],
            "none": [rank + 2],
            "mean": [2.5],
        }
        assert out["broadcast"] == (True, [6.0])
        assert out["broadcast_obj"] == ["from 0"]
        assert out["pad_end"] == (
            [[1.0, -1.0], [1.0, -1.0]] if rank == 0 else [[1.0, 1.0], [1.0, 1.0]]
        )
        assert out["pad_first"] == ([0.0, 1.0] if rank == 0 else [1.0, 1.0])
        shapes, dtypes, structure, inner, red, bcast = out["errors"]
        assert "gather: tensor shapes differ across processes" in shapes
        assert "rank 0: [([1], 'float32')]; rank 1: [([2], 'float32')]" in shapes
        assert "pad_across_processes" in shapes  # names the fix
        assert "dtypes differ" in dtypes and "structures or dtypes differ" in structure
        assert "shapes differ" in inner
        assert red.startswith("reduce:") and bcast.startswith("broadcast:")
        assert out["still_works"] == [0, 1]
        assert out["wide"] == [[0, 1], [19, 20]]
        assert "shapes differ" in out["wide_error"]
