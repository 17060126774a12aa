"""Results and events reach the kernel with every tensor on the CPU, whatever the pickler."""

from __future__ import annotations

import pickle
import sys

import pytest
import torch
import torch.serialization

from nbaccel.launch.channel import _wire


def _gpu_tagged(value, monkeypatch):
    """Pickle ``value`` as a worker without nbaccel's pickler would on a GPU machine:
    the storages' torch.save bytes say "cuda:0" (what a CUDA tensor records)."""
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        return pickle.dumps(value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_plain_loading_of_such_bytes_would_touch_cuda(monkeypatch):
    data = _gpu_tagged(torch.arange(3.0), monkeypatch)
    with pytest.raises(RuntimeError, match="CUDA"):
        pickle.loads(data)


@pytest.mark.parametrize("codec", ["pickle", "dill"])
def test_kernel_side_loading_restores_storages_on_the_cpu(codec, monkeypatch):
    value = {"w": torch.arange(3.0)}
    if codec == "dill":
        import dill

        with monkeypatch.context() as patch:
            patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
            data = dill.dumps(value)
    else:
        data = _gpu_tagged(value, monkeypatch)
    loaded = _wire.loads(codec, data)
    assert loaded["w"].device.type == "cpu" and loaded["w"].tolist() == [0.0, 1.0, 2.0]


def test_the_dill_fallback_moves_device_tensors_too(monkeypatch):
    moved = []
    tensor = torch.ones(2, 5)

    def needs_move(obj):
        if obj is tensor:  # stands for "on a GPU" on this CPU-only machine
            moved.append(tuple(obj.shape))
            return True
        return False

    monkeypatch.setattr(_wire, "_needs_move", needs_move)
    codec, data = _wire.dumps(lambda: tensor)  # a lambda: plain pickle refuses, dill runs
    assert codec == "dill"
    assert (2, 5) in moved, "dill pickled the tensor with torch's own (device-keeping) reducer"
    assert _wire.loads(codec, data)().tolist() == tensor.tolist()


def test_frames_are_decoded_on_the_cpu(monkeypatch):
    body = _gpu_tagged(("result", 0, torch.ones(2)), monkeypatch)
    [message] = _wire.FrameReader().feed(_wire.HEADER.pack(len(body)) + body)
    assert message[2].device.type == "cpu"


def test_every_message_is_a_small_frozen_dataclass_that_crosses_the_channel():
    import dataclasses
    import socket

    from nbaccel.launch.channel import _messages

    kernel, worker = (_wire.Channel(s) for s in socket.socketpair())
    try:
        sent = [
            _messages.Job(3, "call", {0}, (len, ([1],), {})),
            _messages.Done(3, True, ("pickle", b""), 2),
            _messages.PdbOutput(1, "ask", "text\n", "(Pdb) "),
            _messages.Exit(),
        ]
        for message in sent:
            worker.send(message)
        got = [kernel.next() for _ in sent]
        assert got == sent and [type(m) for m in got] == [type(m) for m in sent]
    finally:
        kernel.close()
        worker.close()
    for name in _messages.__all__:
        cls = getattr(_messages, name)
        assert dataclasses.is_dataclass(cls), name
        assert cls.__dataclass_params__.frozen, f"{name} is not frozen"


def test_no_launch_module_speaks_in_positional_tuples():
    # Messages are dispatched by type: a tuple sent on a channel, or a message read by
    # index (message[0] == "done"), is the protocol this replaced.
    import ast
    import pathlib

    import nbaccel.launch

    offenders = []
    for path in sorted(pathlib.Path(nbaccel.launch.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            sends = (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "send"
                and any(isinstance(a, ast.Tuple) for a in node.args)
            )
            indexed = (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("message", "job")
                and isinstance(node.slice, ast.Constant)
            )
            if sends or indexed:
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


def test_a_probe_answered_while_torch_is_half_imported_is_sent(monkeypatch):
    # The channel thread answers probes while the job may be importing torch: the
    # pickler must not need torch.Tensor then (the thread died, and with it the channel)
    import types

    from nbaccel.launch.channel._messages import ProbeAnswer

    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))  # no Tensor yet
    message = ProbeAnswer(3, {"stack": "...", "waiting": None})
    assert _wire.FrameReader().feed(_wire.frame(message)) == [message]
