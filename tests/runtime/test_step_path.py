"""The per-step fast paths (issue 16) behave exactly like the general code they bypass."""

from __future__ import annotations

import contextlib
from collections import namedtuple

import pytest
import torch

from nbaccel.runtime.collectives.tree import send_to_device
from nbaccel.runtime.training.accumulation import GradientState, accumulate
from nbaccel.runtime.training.wrappers import convert_to_fp32

Pair = namedtuple("Pair", "x y")


class TensorList(list):
    pass


@pytest.mark.parametrize(
    "batch",
    [
        torch.ones(2),
        [torch.ones(2), torch.zeros(1)],
        (torch.ones(2), torch.zeros(1, dtype=torch.long)),
        [],
        (),
        [torch.ones(1), "label"],  # not all tensors: the tree walk keeps the string
        (torch.ones(1), [torch.zeros(1)]),  # nested
        Pair(torch.ones(1), torch.zeros(1)),  # a tuple subclass keeps its type
        TensorList([torch.ones(1)]),
    ],
)
def test_send_to_device_keeps_type_and_values(batch):
    moved = send_to_device(batch, torch.device("cpu"))
    assert type(moved) is type(batch)
    flat_in = batch if isinstance(batch, list | tuple) else [batch]
    flat_out = moved if isinstance(moved, list | tuple) else [moved]
    assert len(flat_in) == len(flat_out)
    for a, b in zip(flat_in, flat_out, strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and a.dtype == b.dtype
        else:
            assert a == b or (isinstance(a, list) and torch.equal(a[0], b[0]))


def test_send_to_device_does_not_mutate_a_list_batch():
    batch = [torch.ones(1)]
    moved = send_to_device(batch, "cpu")
    assert moved is not batch and batch[0] is moved[0]  # same tensor: already on the device


def test_convert_to_fp32_tensor_and_tree():
    assert convert_to_fp32(torch.ones(1, dtype=torch.bfloat16)).dtype == torch.float32
    ints = torch.ones(1, dtype=torch.long)
    assert convert_to_fp32(ints) is ints
    out = convert_to_fp32({"a": torch.ones(1, dtype=torch.float16), "b": [ints]})
    assert out["a"].dtype == torch.float32 and out["b"][0] is ints


class _Recorder:
    def __init__(self, fail_on=None):
        self.events, self.fail_on = [], fail_on

    @contextlib.contextmanager
    def no_sync(self, model):
        if model == self.fail_on:
            raise RuntimeError(f"cannot suspend {model}")
        self.events.append(("enter", model))
        try:
            yield
        finally:
            self.events.append(("exit", model))


def test_accumulate_enters_no_sync_only_on_accumulating_steps():
    state, rec = GradientState(num_steps=2), _Recorder()
    for _ in range(2):
        with accumulate(state, ["m1", "m2"], rec.no_sync):
            rec.events.append(("body", state.sync_gradients))
    assert rec.events == [
        ("enter", "m1"),
        ("enter", "m2"),
        ("body", False),
        ("exit", "m2"),
        ("exit", "m1"),
        ("body", True),
    ]


def test_accumulate_exits_no_sync_on_an_exception_and_lets_it_through():
    state, rec = GradientState(num_steps=2), _Recorder()
    with pytest.raises(KeyError), accumulate(state, ["m"], rec.no_sync):
        raise KeyError("boom")
    assert rec.events == [("enter", "m"), ("exit", "m")]


def test_accumulate_unwinds_when_a_no_sync_fails_to_enter():
    state, rec = GradientState(num_steps=2), _Recorder(fail_on="m2")
    with (
        pytest.raises(RuntimeError, match="cannot suspend m2"),
        accumulate(state, ["m1", "m2"], rec.no_sync),
    ):
        pytest.fail("the body must not run")
    assert rec.events == [("enter", "m1"), ("exit", "m1")]


def test_accumulate_syncs_on_the_last_batch_of_the_active_loader():
    class Loader:
        end_of_dataloader = False

    state, loader = GradientState(num_steps=4), Loader()
    state.enter(loader)
    flags = []
    for last in (False, True, False):
        loader.end_of_dataloader = last
        with accumulate(state, []):
            flags.append(state.sync_gradients)
    state.exit(loader)
    assert flags == [False, True, False]
