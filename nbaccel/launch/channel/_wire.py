"""The channel between the kernel and one worker: frames both ways, CPU-only pickling.

One end of a Unix socket pair per worker carries the :mod:`._messages`; a frame is an
8-byte big-endian length and a pickle. :func:`dumps` moves every tensor to the CPU first
(the kernel never initialises CUDA) and avoids torch's shared-memory reducers; dill is the
fallback for lambdas and notebook classes.

Example:
    >>> import pickle, socket
    >>> kernel, worker = (Channel(s) for s in socket.socketpair())
    >>> from nbaccel.launch.channel._messages import Hello
    >>> worker.send(Hello(7))
    >>> kernel.receive(), loads(*dumps([1, 2]))
    ([Hello(pid=7)], [1, 2])
"""

from __future__ import annotations

import contextlib
import io
import pickle
import socket
import struct
import sys
import threading
from typing import Any

HEADER = struct.Struct("!Q")


def frame(message: Any) -> bytes:
    """One frame: the header and the pickled message (tensors moved to the CPU)."""
    data = _pickle(_CPUPickler, message)
    return HEADER.pack(len(data)) + data


class FrameReader:
    """Reassembles frames from a byte stream."""

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
            with contextlib.suppress(Exception):
                out.append(_CPUUnpickler(io.BytesIO(body)).load())
        return out


class Channel:
    """One end of a worker's channel. ``send`` from any thread (whole frames); ``receive``
    (what has arrived; None at the end) or ``next`` (blocking) from one thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self._lock, self._reader = sock, threading.Lock(), FrameReader()
        self._pending: list[Any] = []

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: Any) -> None:
        data = frame(message)
        with self._lock:
            self.sock.sendall(data)

    def receive(self) -> list[Any] | None:
        """The messages completed by one read (blocks only if nothing is readable)."""
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        return self._reader.feed(data) if data else None

    def next(self) -> Any | None:
        """The next message, waiting for it; None when the other end is gone."""
        while not self._pending:
            if (got := self.receive()) is None:
                return None
            self._pending += got
        return self._pending.pop(0)

    def close(self) -> None:
        self.sock.close()


def _to_cpu(tensor: Any) -> Any:
    return tensor


def _needs_move(obj: Any) -> bool:
    """A tensor whose storage is not on the CPU (CUDA, XLA, MPS...)."""
    # torch may be half imported (a probe answered while the job imports it): no Tensor yet
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    return tensor is not None and isinstance(obj, tensor) and obj.device.type != "cpu"


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


class _OnCPU:
    """Unpickler mixin, kernel side: whatever the worker's pickler did, storages are
    restored on the CPU."""

    def find_class(self, module: str, name: str) -> Any:
        # A tensor's storage is pickled as torch.save bytes that remember its device; loading
        # them as they are would initialise CUDA in the kernel (and forbid every later fork).
        if module == "torch.storage" and name == "_load_from_bytes":
            return _load_storage_on_cpu
        return super().find_class(module, name)  # type: ignore[misc]


class _CPUUnpickler(_OnCPU, pickle.Unpickler):
    pass


def _pickle(pickler: Any, value: Any, **kwargs: Any) -> bytes:
    buffer = io.BytesIO()
    pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL, **kwargs).dump(value)
    return buffer.getvalue()


def dumps(value: Any) -> tuple[str, bytes]:
    """Pickle ``value`` for the kernel, device tensors moved to the CPU: ``("pickle",
    bytes)``, or ``("dill", bytes)``."""
    try:
        return "pickle", _pickle(_CPUPickler, value)
    except Exception:
        import dill

        class _CPUDillPickler(dill.Pickler):
            reducer_override = _cpu_reduction

        return "dill", _pickle(_CPUDillPickler, value, recurse=True)


def loads(codec: str, data: bytes) -> Any:
    """Inverse of :func:`dumps` (runs in the kernel); tensors always come back on the CPU."""
    unpickler: Any = _CPUUnpickler
    if codec == "dill":
        import dill

        unpickler = type("_CPUDillUnpickler", (_OnCPU, dill.Unpickler), {})
    return unpickler(io.BytesIO(data)).load()


__all__ = ["HEADER", "Channel", "FrameReader", "dumps", "frame", "loads"]
