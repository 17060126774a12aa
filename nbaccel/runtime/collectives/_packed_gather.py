"""``gather``'s wire format: every leaf of a tree in one ``all_gather``, shapes included.

A gather has to agree on shapes before it can move data (an ``all_gather`` needs the
same byte count on every rank, and a mismatch must raise on every rank, not hang).
Sending the shapes first costs a collective round trip: on a CPU group that is as much
as the data itself for the small tensors of an evaluation loop. So each rank sends its
signature (a fixed-size int64 header: dtypes and shapes) *and* its data in the same
buffer, the data padded to a capacity every rank agrees on without talking: the largest
payload of the group's recent gathers (bounded, see ``_SPECULATE_BYTES``). Every rank
updates that capacity from the same gathered headers, so it stays identical across
ranks as long as gathers pair with gathers (a gather meeting another collective is a
mismatch gloo aborts on, whatever the sizes). When some rank's data did not fit (the
first gather, a bigger batch, a payload too large to speculate on), every rank sees it
in the headers and all send their data again, sized from the headers. A mismatch found
in the headers raises on every rank before any data round.

Example:
    >>> import torch
    >>> from nbaccel.runtime.collectives._packed_gather import encode_signature
    >>> encode_signature([torch.zeros(2, 3)])        # 1 leaf: float32, 2-d, (2, 3)
    [1, 0, 2, 2, 3]
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

HEADER_SLOTS = 64  # int64 values per rank: the capacity, then the signature
OVERFLOW = -2  # a signature that does not fit the header (or an exotic dtype)
_ALIGN = 16  # bytes: every leaf starts at a multiple of the largest element size
_SPECULATE_BYTES = 256 * 1024  # never pad a gather beyond this on speculation
_HISTORY = 16  # gathers whose largest payload sets the capacity

DTYPE_CODES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip

Signature = list[tuple[tuple[int, ...], torch.dtype]]


def encode_signature(leaves: list[torch.Tensor], slots: int = HEADER_SLOTS) -> list[int]:
    """``[count, (dtype code, ndim, *shape) per leaf]``, or ``[OVERFLOW]`` if it won't fit."""
    values = [len(leaves)]
    for t in leaves:
        if t.dtype not in DTYPE_CODES:
            return [OVERFLOW]
        values += [DTYPE_CODES.index(t.dtype), t.dim(), *t.shape]
    return values if len(values) <= slots else [OVERFLOW]


def decode_signature(values: list[int]) -> Signature:
    """Inverse of :func:`encode_signature` (trailing padding ignored)."""
    sig, pos = [], 1
    for _ in range(values[0]):
        dtype, ndim = DTYPE_CODES[values[pos]], values[pos + 1]
        sig.append((tuple(values[pos + 2 : pos + 2 + ndim]), dtype))
        pos += 2 + ndim
    return sig


def comm_device() -> torch.device:
    """Where a packed buffer lives: nccl moves CUDA tensors only, gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _padded(nbytes: int) -> int:
    return nbytes + (-nbytes % _ALIGN)


def _payload_bytes(sig: Signature) -> int:
    total = 0
    for shape, dtype in sig:
        total += _padded(torch.Size(shape).numel() * dtype.itemsize)
    return total


class _Capacity:
    """The speculative payload size of one process group, identical on every rank."""

    def __init__(self) -> None:
        self.recent: deque[int] = deque(maxlen=_HISTORY)

    def current(self) -> int:
        return min(max(self.recent, default=0), _SPECULATE_BYTES)


# Keyed by the group object: a new group (a new launch in a warm worker) starts afresh on
# every rank, and a destroyed group's entry goes with it.
_capacities: weakref.WeakKeyDictionary[Any, _Capacity] = weakref.WeakKeyDictionary()


def _capacity() -> _Capacity:
    group = dist.group.WORLD
    found = _capacities.get(group)
    if found is None:
        found = _capacities[group] = _Capacity()
    return found


def _pack(leaves: list[torch.Tensor], device: torch.device, size: int, offset: int) -> torch.Tensor:
    """A zeroed ``size``-byte buffer with the leaves' bytes from ``offset`` on, each aligned."""
    buffer = torch.zeros(size, dtype=torch.uint8, device=device)
    for tensor in leaves:
        raw = tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
        buffer[offset : offset + raw.numel()].copy_(raw)
        offset += _padded(raw.numel())
    return buffer


def _all_gather(buffer: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(buffer) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, buffer)
    return parts


def exchange(leaves: list[torch.Tensor]) -> tuple[list[Signature], Any]:
    """All-gather signatures and, where they fit the agreed capacity, the data.

    Returns every rank's signature and an opaque handle for :func:`collect` (call it
    only once the signatures are accepted: every rank must make the same decision).
    """
    capacity = _capacity()
    cap = capacity.current()
    device = comm_device()
    header = torch.full((HEADER_SLOTS,), -1, dtype=torch.int64)
    encoded = encode_signature(leaves, HEADER_SLOTS - 1)
    header[0] = cap  # for a reader of the wire; every rank computed the same
    header[1 : 1 + len(encoded)] = torch.tensor(encoded, dtype=torch.int64)
    head_bytes = HEADER_SLOTS * 8
    own_sig: Signature = [(tuple(t.shape), t.dtype) for t in leaves]
    fits = encoded[0] != OVERFLOW and _payload_bytes(own_sig) <= cap
    buffer = _pack(leaves if fits else [], device, head_bytes + cap, head_bytes)
    buffer[:head_bytes].copy_(header.view(torch.uint8))
    parts = _all_gather(buffer)
    rows = torch.stack([p[:head_bytes] for p in parts]).view(torch.int64).cpu().tolist()
    everyone: list[Signature]
    if any(row[1] == OVERFLOW for row in rows):
        # a deep structure or an exotic dtype somewhere: every rank takes the general path
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, own_sig)
        everyone, in_first = gathered, False
    else:
        everyone = [decode_signature(row[1:]) for row in rows]
        in_first = True
    largest = max(_payload_bytes(sig) for sig in everyone)
    capacity.recent.append(largest)
    in_first = in_first and largest <= cap
    return everyone, (parts if in_first else None, head_bytes if in_first else 0, largest)


def collect(
    leaves: list[torch.Tensor], everyone: list[Signature], handle: Any
) -> list[torch.Tensor]:
    """Every leaf concatenated over ranks along dim 0, on the leaf's own device."""
    parts, start, largest = handle
    if parts is None:  # somebody's data did not fit: everyone sends it again, sized to fit
        parts, start = _all_gather(_pack(leaves, comm_device(), largest, 0)), 0
    offsets = [start] * len(everyone)
    gathered = []
    for i, tensor in enumerate(leaves):
        pieces = []
        for rank, (part, sig) in enumerate(zip(parts, everyone, strict=True)):
            shape, dtype = sig[i]
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            chunk = part[offsets[rank] : offsets[rank] + nbytes]
            pieces.append(chunk.view(dtype).reshape(shape))
            offsets[rank] += _padded(nbytes)
        gathered.append(torch.cat(pieces).to(tensor.device))
    return gathered
