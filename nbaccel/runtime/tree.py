"""Nested structures of tensors: walk them, rebuild them, move them to a device.

Dicts, lists, tuples, namedtuples and dataclasses are walked; every tensor leaf is
visited in a fixed order, so the collectives in :mod:`nbaccel.runtime.ops` can pack
leaves and rebuild the same structure on every rank.

Example:
    >>> import torch
    >>> recursively_apply(lambda t: t * 2, {"a": [torch.ones(1)]})["a"][0].item()
    2.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def recursively_apply(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Apply ``fn`` to every tensor in ``data``, rebuilding containers of the same type."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if _is_namedtuple(data):
        return type(data)(*(recursively_apply(fn, v) for v in data))
    if isinstance(data, list | tuple):
        return type(data)(recursively_apply(fn, v) for v in data)
    if isinstance(data, Mapping):
        items = {k: recursively_apply(fn, v) for k, v in data.items()}
        try:
            return type(data)(items)  # type: ignore[call-arg]
        except TypeError:  # a Mapping type without a dict constructor
            return items
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        changes = {
            f.name: recursively_apply(fn, getattr(data, f.name))
            for f in dataclasses.fields(data)
            if f.init
        }
        return dataclasses.replace(data, **changes)
    return data


def _leaves(data: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    recursively_apply(collect, data)
    return found


def _rebuild(data: Any, values: Sequence[Any]) -> Any:
    it = iter(values)
    return recursively_apply(lambda _t: next(it), data)


def is_tensor_tree(data: Any) -> bool:
    """True if ``data`` is a tensor or a (nested) list/tuple/dict of tensors, none empty."""
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, list | tuple):
        return bool(data) and all(is_tensor_tree(v) for v in data)
    if isinstance(data, Mapping):
        return bool(data) and all(is_tensor_tree(v) for v in data.values())
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return all(is_tensor_tree(getattr(data, f.name)) for f in dataclasses.fields(data))
    return False


def send_to_device(data: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Move every tensor in ``data`` to ``device``; objects with a ``.to`` method move too.

    Example:
        >>> send_to_device({"a": (torch.ones(1),)}, "cpu")["a"][0].device.type
        'cpu'
    """
    kind = type(data)
    if kind is torch.Tensor:
        return data.to(device, non_blocking=non_blocking)
    if kind is tuple or kind is list:  # the usual batch, moved on every step: no tree walk
        moved = []
        for t in data:
            if type(t) is not torch.Tensor:
                break
            moved.append(t.to(device, non_blocking=non_blocking))
        else:
            return moved if kind is list else tuple(moved)
    movable = callable(getattr(data, "to", None))
    if movable and not isinstance(data, torch.Tensor | torch.nn.Module):
        try:  # e.g. a tokenizer's BatchEncoding
            return data.to(device, non_blocking=non_blocking)
        except TypeError:
            return data.to(device)
    return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), data)


__all__ = ["is_tensor_tree", "recursively_apply", "send_to_device"]
