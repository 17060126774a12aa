"""Nested structures of tensors: walk them, rebuild them, move them to a device.

Dicts, lists, tuples, namedtuples and dataclasses are walked; every tensor leaf is
visited in a fixed order, so the collectives in :mod:`nbaccel.runtime.collectives.ops` can pack
leaves and rebuild the same structure on every rank.

Example:
    >>> import torch
    >>> recursively_apply(lambda t: t * 2, {"a": [torch.ones(1)]})["a"][0].item()
    2.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _apply(fn: Callable[[Any], Any], data: Any, is_leaf: Callable[[Any], bool] | None) -> Any:
    if isinstance(data, torch.Tensor) if is_leaf is None else is_leaf(data):
        return fn(data)
    if _is_namedtuple(data):
        return type(data)(*(_apply(fn, v, is_leaf) for v in data))
    if isinstance(data, list | tuple):
        return type(data)(_apply(fn, v, is_leaf) for v in data)
    if isinstance(data, Mapping):
        items = {k: _apply(fn, v, is_leaf) for k, v in data.items()}
        try:
            return type(data)(items)  # type: ignore[call-arg]
        except TypeError:  # a Mapping type without a dict constructor
            return items
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        changes = {
            f.name: _apply(fn, getattr(data, f.name), is_leaf)
            for f in dataclasses.fields(data)
            if f.init
        }
        return dataclasses.replace(data, **changes)
    return data


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] | None = None,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Apply ``func(leaf, *args, **kwargs)`` to every tensor (every leaf for which
    ``test_type(leaf)`` is true) in ``data``, rebuilding containers of the same type.

    Args:
        func: applied to each leaf.
        data: a tensor, or lists/tuples/namedtuples/dicts/dataclasses of them.
        test_type: which leaves ``func`` applies to (default: tensors).
        error_on_other_type: raise ``TypeError`` for any other leaf instead of keeping it.
    """
    if not args and not kwargs and test_type is None and not error_on_other_type:
        return _apply(func, data, None)  # the common (and per-step) case
    test = test_type or (lambda x: isinstance(x, torch.Tensor))

    def leaf(x: Any) -> bool:
        if test(x):
            return True
        container = isinstance(x, list | tuple | Mapping) or (
            dataclasses.is_dataclass(x) and not isinstance(x, type)
        )
        if error_on_other_type and not container:
            raise TypeError(
                f"recursively_apply: {type(x).__name__} is neither a container nor accepted by "
                f"test_type; {getattr(func, '__name__', 'func')} applies to the latter only."
            )
        return False

    return _apply(lambda x: func(x, *args, **kwargs), data, leaf)


#: how a tree is walked: ``walk(fn, data)`` applies ``fn`` to each leaf, rebuilding containers
Walk = Callable[[Callable[[Any], Any], Any], Any]


def _leaves(data: Any, walk: Walk = recursively_apply) -> list[Any]:
    """The leaves of ``data`` in the order ``walk`` visits them (tensors, by default)."""
    found: list[Any] = []

    def collect(t: Any) -> Any:
        found.append(t)
        return t

    walk(collect, data)
    return found


def _rebuild(data: Any, values: Iterable[Any], walk: Walk = recursively_apply) -> Any:
    """``data`` with its leaves replaced by ``values``, in :func:`_leaves`' order."""
    it = iter(values)
    return walk(lambda _t: next(it), data)


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


def send_to_device(
    tensor: Any,
    device: torch.device | str,
    non_blocking: bool = False,
    skip_keys: str | list[str] | tuple[str, ...] | None = None,
) -> Any:
    """Move every tensor in ``tensor`` to ``device``; objects with a ``.to`` method move
    too; the entries of dicts named in ``skip_keys`` stay where they are.

    Example:
        >>> send_to_device({"a": (torch.ones(1),)}, "cpu")["a"][0].device.type
        'cpu'
    """
    data = tensor
    if skip_keys is not None and isinstance(data, Mapping):
        skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys)
        kept = {
            k: v if k in skip else send_to_device(v, device, non_blocking, skip_keys)
            for k, v in data.items()
        }
        try:
            return type(data)(kept)  # type: ignore[call-arg]
        except TypeError:
            return kept
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
