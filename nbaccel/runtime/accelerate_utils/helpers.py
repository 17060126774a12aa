"""Small helpers scripts import from ``accelerate.utils``: trees, files, environment, memory.

Example:
    >>> import torch
    >>> listify({"loss": torch.tensor(0.5), "ids": torch.tensor([1, 2])})
    {'loss': 0.5, 'ids': [1, 2]}
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

from ..collectives.tree import recursively_apply


def listify(data: Any) -> Any:
    """Tensors in ``data`` become Python numbers / (nested) lists (for logging, JSON)."""
    return recursively_apply(lambda t: t.tolist(), data)


def slice_tensors(
    data: Any, tensor_slice: Any, process_index: int | None = None, num_processes: int | None = None
) -> Any:
    """Every tensor in ``data`` indexed by ``tensor_slice`` (e.g. ``slice(0, 4)``)."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a forward function so that float16/bfloat16 outputs come back as float32."""
    from ..training.wrappers import convert_to_fp32

    @functools.wraps(model_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(model_forward(*args, **kwargs))

    return forward


def save(
    obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False
) -> None:
    """Save ``obj`` once (the main process; each node's with ``save_on_each_node``),
    atomically for paths (see ``Accelerator.save``)."""
    from types import SimpleNamespace

    from ..process.state import current_state, get_state
    from ..saving.model_io import save as save_once

    state = current_state() or get_state()
    writer = state.is_local_main_process if save_on_each_node else state.is_main_process
    view = SimpleNamespace(state=SimpleNamespace(is_local_main_process=writer))
    save_once(view, obj, f, safe_serialization=safe_serialization)


def load(f: Any, map_location: Any = None, weights_only: bool = True, **kwargs: Any) -> Any:
    """``torch.load`` (tensors only unless ``weights_only=False``, for trusted files)."""
    import torch

    return torch.load(f, map_location=map_location, weights_only=weights_only, **kwargs)


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """Run the block with an empty ``os.environ``; the environment comes back afterwards."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def get_max_memory(max_memory: dict[Any, Any] | None = None) -> dict[Any, int]:
    """Free memory per device in bytes: each visible GPU (by index) and ``"cpu"``."""
    if max_memory is not None:
        return dict(max_memory)
    import psutil
    import torch

    memory: dict[Any, int] = {}
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            memory[index] = int(torch.cuda.mem_get_info(index)[0])
    memory["cpu"] = int(psutil.virtual_memory().available)
    return memory


__all__ = [
    "clear_environment",
    "convert_outputs_to_fp32",
    "get_max_memory",
    "listify",
    "load",
    "save",
    "slice_tensors",
]
