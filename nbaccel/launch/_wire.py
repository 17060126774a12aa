"""Bytes between a worker and the kernel: frames, and CPU-only pickling of results.

A frame is an 8-byte big-endian length followed by a pickle. Workers write
frames with :class:`Channel`; the kernel reassembles them with
:class:`FrameReader`. Values are pickled with :func:`dumps`, which moves every
tensor to the CPU first (the kernel must never initialise CUDA) and uses plain
pickle bytes rather than torch's shared-memory reducers; dill is the fallback
for values plain pickle cannot handle (lambdas, classes defined in a notebook).

Example:
    >>> from nbaccel.launch._wire import FrameReader, dumps, loads, HEADER
    >>> import pickle
    >>> data = pickle.dumps(("hello", 0))
    >>> FrameReader().feed(HEADER.pack(len(data)) + data)
    [('hello', 0)]
    >>> loads(*dumps([1, 2]))
    [1, 2]
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
import threading
from typing import Any

from ..tracking import events

HEADER = struct.Struct("!Q")


class Channel:
    """Frames written to the control pipe; a lock keeps concurrent publishers whole."""

    def __init__(self, fd: int, rank: int) -> None:
        self.fd, self.rank, self.lock = fd, rank, threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        if message[0] != "event":  # queued events (Accelerator.log...) arrive before a result
            events.flush()
        buffer = io.BytesIO()  # tensors in events/results reach the kernel on the CPU
        _CPUPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
        data = buffer.getvalue()
        frame = memoryview(HEADER.pack(len(data)) + data)
        with self.lock:
            while frame:
                frame = frame[os.write(self.fd, frame) :]


class FrameReader:
    """Reassembles frames from the bytes of one control pipe (kernel side)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        """Add bytes; return the messages completed by them (undecodable ones skipped)."""
        self._buffer += data
        out = []
        while len(self._buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buffer)
            if len(self._buffer) < HEADER.size + size:
                break
            body = bytes(self._buffer[HEADER.size : HEADER.size + size])
            del self._buffer[: HEADER.size + size]
            try:
                out.append(_CPUUnpickler(io.BytesIO(body)).load())
            except Exception:
                continue
        return out


def _to_cpu(tensor: Any) -> Any:
    return tensor


def _needs_move(obj: Any) -> bool:
    """A tensor whose storage is not on the CPU (CUDA, XLA, MPS...)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu"


def _cpu_reduction(pickler: Any, obj: Any) -> Any:
    """``reducer_override`` of both picklers: device tensors travel as CPU tensors."""
    if not _needs_move(obj):
        return NotImplemented
    torch = sys.modules["torch"]
    cpu = obj.detach().to("cpu")
    if isinstance(obj, torch.nn.Parameter):
        cpu = torch.nn.Parameter(cpu, requires_grad=obj.requires_grad)
    return _to_cpu, (cpu,)


class _CPUPickler(pickle.Pickler):
    """Moves tensors on any device to the CPU while pickling (no CUDA in the kernel)."""

    reducer_override = _cpu_reduction


def _load_storage_on_cpu(data: bytes) -> Any:
    """Stand-in for ``torch.storage._load_from_bytes`` that never restores onto a GPU."""
    import torch

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def _find_class(module: str, name: str) -> Any | None:
    # A tensor's storage is pickled as torch.save bytes that remember its device; loading
    # them as they are would initialise CUDA in the kernel (and forbid every later fork).
    if module == "torch.storage" and name == "_load_from_bytes":
        return _load_storage_on_cpu
    return None


class _CPUUnpickler(pickle.Unpickler):
    """Kernel side: whatever the worker's pickler did, storages are restored on the CPU."""

    def find_class(self, module: str, name: str) -> Any:
        return _find_class(module, name) or super().find_class(module, name)


def dumps(value: Any) -> tuple[str, bytes]:
    """Pickle ``value`` for the kernel: ``("pickle", bytes)``, or ``("dill", bytes)``.

    Both picklers move device tensors to the CPU first, so neither can ship a CUDA
    tensor to the kernel.
    """
    buffer = io.BytesIO()
    try:
        _CPUPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        return "pickle", buffer.getvalue()
    except Exception:
        import dill

        class _CPUDillPickler(dill.Pickler):
            reducer_override = _cpu_reduction

        buffer = io.BytesIO()
        _CPUDillPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL, recurse=True).dump(value)
        return "dill", buffer.getvalue()


def loads(codec: str, data: bytes) -> Any:
    """Inverse of :func:`dumps` (runs in the kernel); tensors always come back on the CPU."""
    if codec == "dill":
        import dill

        class _CPUDillUnpickler(dill.Unpickler):
            def find_class(self, module: str, name: str) -> Any:
                return _find_class(module, name) or super().find_class(module, name)

        return _CPUDillUnpickler(io.BytesIO(data)).load()
    return _CPUUnpickler(io.BytesIO(data)).load()


__all__ = ["HEADER", "Channel", "FrameReader", "dumps", "loads"]
