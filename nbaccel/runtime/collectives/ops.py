"""Collective operations on (nested) tensors and Python objects; no-ops at world size 1.

Every function accepts a tensor or a nested structure of tensors (dicts, lists,
tuples, namedtuples, dataclasses) and returns the same structure. Shapes travel
with (or ahead of) the data, so mismatched shapes raise a clear
``ValueError`` on every rank instead of hanging.

Example:
    >>> import torch
    >>> from nbaccel.runtime.collectives.ops import gather, send_to_device
    >>> gather({"x": torch.ones(2)})["x"].shape    # one process: unchanged
    torch.Size([2])
    >>> send_to_device([torch.zeros(1)], torch.device("cpu"))[0].device.type
    'cpu'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...platform.process_env import distributed_active
from ..process import rank_check
from ..process.state import barrier_kwargs
from . import _packed_gather as packing
from .splitting import split_between_processes
from .tree import _leaves, _rebuild, is_tensor_tree, recursively_apply, send_to_device

# ----------------------------------------------------------------------------- group helpers


def world_size() -> int:
    """Processes in the default group (1 when no group is initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def process_index() -> int:
    """This process's global rank (0 when no group is initialised)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _comm_device(tensor: torch.Tensor) -> torch.device:
    """nccl communicates CUDA tensors only; gloo handles CPU (and CUDA) tensors."""
    if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return tensor.device


# gloo lacks collectives for a few dtypes; communicate them in a wider type
_WIRE_DTYPE = {torch.bool: torch.uint8, torch.float16: torch.float32, torch.bfloat16: torch.float32}


def _to_wire(tensor: torch.Tensor) -> torch.Tensor:
    device = _comm_device(tensor)
    wire = tensor.to(device)
    if device.type == "cpu" and tensor.dtype in _WIRE_DTYPE:
        wire = wire.to(_WIRE_DTYPE[tensor.dtype])
    return wire.contiguous()


def _exchange_metadata(data: Any) -> list[Any]:
    """all_gather every rank's tree signature (tensor shapes and dtypes), nothing else."""
    leaves = _leaves(data)
    encoded = packing.encode_signature(leaves)
    header = torch.full((packing.HEADER_SLOTS,), -1, dtype=torch.int64)
    header[: len(encoded)] = torch.tensor(encoded, dtype=torch.int64)
    header = header.to(packing.comm_device())
    headers = [torch.empty_like(header) for _ in range(dist.get_world_size())]
    dist.all_gather(headers, header)
    rows = [h.tolist() for h in headers]
    if any(row[0] == packing.OVERFLOW for row in rows):
        # a deep structure or an exotic dtype: every rank takes the general path together
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [(tuple(t.shape), t.dtype) for t in leaves])
        return everyone
    return [packing.decode_signature(row) for row in rows]


def _mismatch_error(what: str, everyone: list[Any], detail: str, fix: str) -> ValueError:
    per_rank = "; ".join(
        f"rank {r}: {[(list(s), str(d).replace('torch.', '')) for s, d in sig]}"
        for r, sig in enumerate(everyone)
    )
    return ValueError(f"{what}: {detail} across processes ({per_rank}). {fix}")


# ----------------------------------------------------------------------------- collectives


@rank_check.names_timeouts("gather")
def gather(tensor: Any, *, allow_uneven: bool = False) -> Any:
    """Concatenate every rank's tensors along dim 0 (0-d tensors become 1-d first).

    Args:
        tensor: a tensor or nested structure of tensors, same structure on every rank.
        allow_uneven: accept different sizes along dim 0 (other dims must match); the
            result is still the rank-ordered concatenation.

    Raises:
        ValueError: on every rank, when structures, dtypes or shapes differ.

    Example:
        >>> gather(torch.tensor(3.0))
        tensor([3.])
    """
    data = tensor
    data = recursively_apply(lambda t: t.reshape(1) if t.dim() == 0 else t, data)
    if not distributed_active():
        return data
    leaves = _leaves(data)
    everyone, handle = packing.exchange(leaves)
    fix = (
        "Every rank must pass tensors of the same shape: pad them first with "
        "accelerator.pad_across_processes(tensor, dim=0), or use gather_for_metrics / "
        "gather_object."
    )
    first = everyone[0]
    for sig in everyone[1:]:
        if len(sig) != len(first) or any(
            d != d0 for (_, d), (_, d0) in zip(sig, first, strict=True)
        ):
            raise _mismatch_error("gather", everyone, "tensor structures or dtypes differ", fix)
        for (shape, _), (shape0, _) in zip(sig, first, strict=True):
            rest_differs = len(shape) != len(shape0) or shape[1:] != shape0[1:]
            if rest_differs or (not allow_uneven and shape != shape0):
                raise _mismatch_error("gather", everyone, "tensor shapes differ", fix)
    return _rebuild(data, packing.collect(leaves, everyone, handle))


@rank_check.names_timeouts("gather_object")
def gather_object(object: Any) -> list[Any]:
    """Gather picklable objects: lists/tuples are concatenated, anything else is listed per rank.

    Example:
        >>> gather_object(["a", "b"])
        ['a', 'b']
    """
    obj = object
    is_seq = isinstance(obj, list | tuple)
    if not distributed_active():
        return list(obj) if is_seq else [obj]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    if is_seq:
        return [item for part in everyone for item in part]
    return everyone


_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


@rank_check.names_timeouts("reduce")
def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """All-reduce every tensor across ranks; returns copies multiplied by ``scale``.

    Args:
        tensor: a tensor or nested tensors (same shapes on every rank).
        reduction: ``"mean"``, ``"sum"``, ``"none"`` (this rank's values, unreduced) or
            ``"max"``, ``"min"``, ``"product"``; case-insensitive.
        scale: factor applied after the reduction.

    Example:
        >>> reduce(torch.tensor([2.0]), "mean")
        tensor([2.])
    """
    data = tensor
    mode = reduction.lower() if isinstance(reduction, str) else reduction
    if mode not in (*_REDUCE_OPS, "none"):
        raise ValueError(
            f"reduce(reduction={reduction!r}): use 'mean', 'sum' or 'none' "
            "(or 'max', 'min', 'product')."
        )

    def one(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        if distributed_active() and mode != "none":
            wire = _to_wire(out)
            dist.all_reduce(wire, op=getattr(dist.ReduceOp, _REDUCE_OPS[mode]))
            out = wire.to(device=tensor.device, dtype=tensor.dtype)
        if mode == "mean":
            out = out / world_size()
        return out * scale if scale != 1.0 else out

    if distributed_active() and mode != "none":
        _check_same(data, "reduce")
    return recursively_apply(one, data)


def _check_same(data: Any, what: str) -> None:
    everyone = _exchange_metadata(data)
    if any(sig != everyone[0] for sig in everyone):
        raise _mismatch_error(
            what,
            everyone,
            "tensor shapes or dtypes differ",
            f"{what} needs the same shapes on every rank; pad them first with "
            "accelerator.pad_across_processes.",
        )


@rank_check.names_timeouts("broadcast")
def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Send ``from_process``'s tensors to every rank (in place where possible); returns ``data``.

    Example:
        >>> broadcast(torch.tensor([1.0]))
        tensor([1.])
    """
    data = tensor
    if not distributed_active():
        return data
    _check_same(data, "broadcast")

    def one(tensor: torch.Tensor) -> torch.Tensor:
        wire = _to_wire(tensor)
        dist.broadcast(wire, src=from_process)
        with torch.no_grad():
            tensor.copy_(wire)
        return tensor

    return recursively_apply(one, data)


@rank_check.names_timeouts("broadcast_object_list")
def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace ``objects``' items in place with ``from_process``'s; returns the list."""
    objects = object_list
    if distributed_active():
        dist.broadcast_object_list(objects, src=from_process)
    return objects


@rank_check.names_timeouts("pad_across_processes")
def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    """Pad every tensor along ``dim`` to the largest size any rank has, so it can be gathered.

    Args:
        tensor: a tensor or nested tensors (same structure on every rank).
        dim: the dimension to pad.
        pad_index: the fill value.
        pad_first: pad at the beginning instead of the end.

    Example:
        >>> pad_across_processes(torch.ones(2, 3), dim=1).shape
        torch.Size([2, 3])
    """
    data = tensor
    leaves = _leaves(data)
    if not distributed_active() or not leaves:
        return data
    everyone = _exchange_metadata(data)
    padded = []
    for i, tensor in enumerate(leaves):
        d = dim if dim >= 0 else tensor.dim() + dim
        if not 0 <= d < tensor.dim():
            raise ValueError(
                f"pad_across_processes(dim={dim}) is out of range for a tensor of shape "
                f"{list(tensor.shape)}."
            )
        longest = max(sig[i][0][d] for sig in everyone)
        if tensor.shape[d] == longest:
            padded.append(tensor)
            continue
        shape = list(tensor.shape)
        shape[d] = longest - tensor.shape[d]
        filler = tensor.new_full(shape, pad_index)
        parts = [filler, tensor] if pad_first else [tensor, filler]
        padded.append(torch.cat(parts, dim=d))
    return _rebuild(data, padded)


def barrier(operation: str = "wait_for_everyone") -> None:
    """Wait until every process arrives (no-op without a multi-process group).

    The ranks meet in a monitored barrier first (:mod:`nbaccel.runtime.process.rank_check`): one
    called inside ``if accelerator.is_main_process:`` raises, naming ``operation`` and
    the ranks that never came, instead of waiting forever. On NCCL a device barrier
    follows, so the GPU streams are in step as after a plain barrier.
    """
    if distributed_active():
        rank_check.all_ranks_enter(
            operation,
            f"call {operation} on every rank, not inside `if accelerator.is_main_process:` "
            "or another block that only some ranks run.",
        )
        backend = str(dist.get_backend())
        if "nccl" in backend:
            dist.barrier(**barrier_kwargs(backend))


@contextlib.contextmanager
def first(goes_first: bool, operation: str = "main_process_first") -> Iterator[None]:
    """Context: processes with ``goes_first`` run the block, then the others do."""
    if not goes_first:
        barrier(operation)
    yield
    if goes_first:
        barrier(operation)


__all__ = [
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "first",
    "gather",
    "gather_object",
    "is_tensor_tree",
    "pad_across_processes",
    "process_index",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "split_between_processes",
    "world_size",
]
