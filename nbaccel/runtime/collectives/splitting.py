"""``split_between_processes``: each process's contiguous share of a list, tensor or dict.

Example:
    >>> split_between_processes(["a", "b", "c"], 2, 0)
    ['a', 'b']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def split_between_processes(
    inputs: Any, num_processes: int, process_index: int, apply_padding: bool = False
) -> Any:
    """Return this rank's contiguous share of ``inputs`` (list, tuple, tensor, dict of those).

    The first ``len % num_processes`` ranks get one extra item. With ``apply_padding``
    every rank gets the same length, shorter shares repeating their last item (or the
    input's last item when a share is empty), so the results can be gathered.

    Example:
        >>> split_between_processes([1, 2, 3], 2, 1)
        [3]
        >>> split_between_processes([1, 2, 3], 2, 1, apply_padding=True)
        [3, 3]
    """
    if isinstance(inputs, Mapping):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(
                "split_between_processes(dict): every value must have the same length, got "
                f"{ {k: len(v) for k, v in inputs.items()} }."
            )
        return type(inputs)(  # type: ignore[call-arg]
            {
                k: split_between_processes(v, num_processes, process_index, apply_padding)
                for k, v in inputs.items()
            }
        )
    if not isinstance(inputs, torch.Tensor | list | tuple) and not hasattr(inputs, "__getitem__"):
        raise TypeError(
            f"split_between_processes got {type(inputs).__name__}; pass a list, tuple, tensor "
            "or a dict of those."
        )
    total = len(inputs)
    base, extra = divmod(total, num_processes)
    start = process_index * base + min(process_index, extra)
    end = start + base + (1 if process_index < extra else 0)
    share = inputs[start:end]
    if not apply_padding or total == 0:
        return share
    want = base + (1 if extra else 0)
    missing = want - (end - start)
    if missing <= 0:
        return share
    last = inputs[end - 1 : end] if end > start else inputs[total - 1 : total]
    if isinstance(inputs, torch.Tensor):
        return torch.cat([share, *([last] * missing)])
    return share + type(share)(last) * missing


__all__ = ["split_between_processes"]
