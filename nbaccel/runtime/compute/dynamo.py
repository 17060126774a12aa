"""``dynamo_backend=`` / ``dynamo_plugin=``: ``torch.compile`` applied to every prepared model.

Example:
    >>> normalize_backend(None), normalize_backend("INDUCTOR")
    ('no', 'inductor')
    >>> TorchDynamoPlugin(backend="inductor", mode="max-autotune").compile_kwargs()
    {'backend': 'inductor', 'mode': 'max-autotune', 'fullgraph': False, 'dynamic': None}
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from ...config.choices import ChoiceEnum
from ...errors import ConfigError


def normalize_backend(backend: Any) -> str:
    """``"no"`` for None/"no"/"NO"; otherwise the lower-case backend name, checked."""
    name = str(getattr(backend, "value", backend) or "no").lower()
    if name == "no":
        return name
    import torch._dynamo  # the list of backends lives there (imported only when asked)

    known = sorted(torch._dynamo.list_backends(exclude_tags=()))
    if name not in known:
        raise ConfigError(
            f"dynamo_backend={backend!r} is not a torch.compile backend here; use one of "
            f"{known} or 'no'."
        )
    return name


class DynamoBackend(ChoiceEnum):
    """``torch.compile`` backends by Accelerate's names (``dynamo_backend=DynamoBackend.INDUCTOR``)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    CUDAGRAPHS = "CUDAGRAPHS"
    ONNXRT = "ONNXRT"
    TVM = "TVM"
    IPEX = "IPEX"
    TENSORRT = "TENSORRT"


@dataclass(kw_only=True)
class TorchDynamoPlugin:
    """How prepared models are compiled (``Accelerator(dynamo_plugin=...)``): the arguments
    of ``torch.compile``. ``backend="no"`` (the default) compiles nothing.

    Raises:
        ConfigError: an unknown backend, ``mode`` together with ``options`` (torch.compile
            takes one of them), or ``use_regional_compilation`` (not supported: compile
            the repeated blocks yourself with ``torch.compile``).
    """

    backend: Any = "no"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: dict[str, Any] | None = field(default=None)
    disable: bool = False
    use_regional_compilation: bool = False

    def __post_init__(self) -> None:
        self.backend = normalize_backend(self.backend)
        if self.mode is not None and self.options:
            raise ConfigError(
                "TorchDynamoPlugin(mode=..., options=...): torch.compile accepts one of them; "
                "drop mode or put its settings into options."
            )
        if self.use_regional_compilation:
            raise ConfigError(
                "TorchDynamoPlugin(use_regional_compilation=True) is not supported: compile the "
                "repeated blocks with torch.compile(block) before prepare(), or compile the model."
            )

    def compile_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for ``torch.compile``."""
        kwargs: dict[str, Any] = {"backend": self.backend}
        if self.mode is not None:
            kwargs["mode"] = self.mode
        if self.options:
            kwargs["options"] = dict(self.options)
        kwargs.update(fullgraph=self.fullgraph, dynamic=self.dynamic)
        if self.disable:
            kwargs["disable"] = True
        return kwargs


def resolve_plugin(backend: Any, plugin: Any) -> TorchDynamoPlugin:
    """One ``TorchDynamoPlugin`` from ``dynamo_backend=`` and ``dynamo_plugin=`` (not both)."""
    if plugin is None:
        return TorchDynamoPlugin(backend=backend)
    if not isinstance(plugin, TorchDynamoPlugin):
        raise TypeError(f"dynamo_plugin={plugin!r}: pass a TorchDynamoPlugin(...).")
    if backend is not None and normalize_backend(backend) != plugin.backend:
        raise ConfigError(
            f"dynamo_backend={backend!r} conflicts with dynamo_plugin.backend="
            f"{plugin.backend!r}; set the backend in one place only."
        )
    return plugin


def is_compiled(model: Any) -> bool:
    """True for the module ``torch.compile`` returns."""
    return isinstance(getattr(model, "_orig_mod", None), torch.nn.Module)


def compile_model(model: torch.nn.Module, plugin: TorchDynamoPlugin | str) -> torch.nn.Module:
    """``torch.compile(model, ...)`` as ``plugin`` (or a backend name) says, unless off or
    already compiled."""
    if isinstance(plugin, str):
        plugin = TorchDynamoPlugin(backend=plugin)
    if plugin.backend == "no" or is_compiled(model):
        return model
    compiled: torch.nn.Module = torch.compile(model, **plugin.compile_kwargs())  # type: ignore[assignment]
    return compiled


def unwrap(model: Any, unwrap_inner: Any, keep_torch_compile: bool) -> Any:
    """Unwrap DDP & co. with ``unwrap_inner``; with ``keep_torch_compile`` a compiled model
    comes back as a compiled module around the user's module.

    The prepared model is never modified (it keeps training through DDP): the result is
    a shallow copy of the compiled wrapper, re-pointed at the unwrapped module.
    """
    if not is_compiled(model):
        return unwrap_inner(model)
    inner = unwrap_inner(model._orig_mod)
    if not keep_torch_compile:
        return inner
    wrapper = copy.copy(model)
    wrapper.__dict__["_modules"] = dict(model._modules)
    wrapper._orig_mod = inner
    rebind = getattr(wrapper, "_initialize", None)
    if callable(rebind):  # forward is bound to _orig_mod at construction
        rebind()
    return wrapper


__all__ = [
    "DynamoBackend",
    "TorchDynamoPlugin",
    "compile_model",
    "is_compiled",
    "normalize_backend",
    "resolve_plugin",
    "unwrap",
]
