"""Accelerate names for what nbaccel does not do: each raises, at the call, naming the way.

nbaccel drives ``torch.distributed`` (DDP, FSDP2) and DeepSpeed only. Megatron-LM, tensor
parallelism, pipeline inference and big-model dispatch (``device_map="auto"``,
``dispatch_model``, ``infer_auto_device_map``, CPU/disk offload hooks) are other
engines: their classes and functions exist here so a ported script imports, and fails
where it uses them with a :class:`~nbaccel.errors.ConfigError` that names the
alternative, never an ``ImportError`` or ``AttributeError``. ``init_empty_weights`` /
``init_on_device`` do work (they are how FSDP builds a model too big for one process).

Example:
    >>> try:
    ...     MegatronLMPlugin(tp_degree=2)
    ... except ValueError as err:
    ...     print(str(err).split(":")[0])
    MegatronLMPlugin is not part of nbaccel
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from ...errors import ConfigError

_FSDP = "shard the model with FSDP2 instead: Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(...))"
_PLACE = (
    "load the weights with load_checkpoint_in_model(model, path) and move the model with "
    "model.to(device); for a model larger than one device, train it sharded with FSDP2 "
    "(Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(cpu_offload=True)))"
)
_AO = (
    "mixed_precision='fp8' runs through torchao; configure it with "
    "kwargs_handlers=[AORecipeKwargs(config=..., module_filter_func=...)]"
)
ALTERNATIVES: dict[str, str] = {
    "MegatronLMPlugin": _FSDP,
    "TorchTensorParallelPlugin": _FSDP,
    "FP8RecipeKwargs": _AO,
    "TERecipeKwargs": _AO,
    "MSAMPRecipeKwargs": _AO,
    "dispatch_model": _PLACE,
    "infer_auto_device_map": _PLACE,
    "load_checkpoint_and_dispatch": _PLACE,
    "cpu_offload": _PLACE,
    "cpu_offload_with_hook": _PLACE,
    "disk_offload": _PLACE,
    "get_balanced_memory": _PLACE,
    "prepare_pippy": "pipeline-parallel inference is not part of nbaccel; "
    "split_between_processes() spreads inputs over processes instead",
    "lomo_backward": "LOMO optimizers are not supported: use accelerator.backward(loss)",
}


def _refuse(name: str) -> NoReturn:
    raise ConfigError(f"{name} is not part of nbaccel: {ALTERNATIVES[name]}.")


def _refusing_class(name: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _refuse(name)

    return type(
        name, (), {"__init__": __init__, "__doc__": f"Not in nbaccel: {ALTERNATIVES[name]}."}
    )


def _refusing_function(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        _refuse(name)

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Not in nbaccel: {ALTERNATIVES[name]}."
    return refuse


REFUSED: dict[str, Any] = {
    name: (_refusing_class(name) if name[0].isupper() else _refusing_function(name))
    for name in ALTERNATIVES
}
MegatronLMPlugin = REFUSED["MegatronLMPlugin"]


@contextlib.contextmanager
def init_on_device(device: Any, include_buffers: bool = False) -> Iterator[None]:
    """Create the parameters (and with ``include_buffers`` the buffers) of modules built
    in the block on ``device`` (``"meta"``: no memory at all)."""
    import torch

    device = torch.device(device)
    if include_buffers:
        with device:
            yield
        return
    original = torch.nn.Module.register_parameter

    def register_parameter(module: Any, name: str, param: Any) -> None:
        original(module, name, param)
        if param is not None:
            moved = module._parameters[name]
            assert moved is not None
            kwargs = dict(moved.__dict__)
            kwargs["requires_grad"] = moved.requires_grad
            module._parameters[name] = type(moved)(moved.to(device), **kwargs)

    torch.nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def init_empty_weights(include_buffers: bool = False) -> contextlib.AbstractContextManager[None]:
    """Build models without allocating their parameters (on the ``meta`` device); prepare
    them under FSDP, or fill them with ``load_checkpoint_in_model``... after ``to_empty``.

    Example:
        >>> import torch
        >>> with init_empty_weights():
        ...     layer = torch.nn.Linear(1000, 1000)
        >>> layer.weight.device.type
        'meta'
    """
    return init_on_device("meta", include_buffers=include_buffers)


def __getattr__(name: str) -> Any:
    if name in REFUSED:
        return REFUSED[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ALTERNATIVES",
    "REFUSED",
    "MegatronLMPlugin",
    "init_empty_weights",
    "init_on_device",
]
