"""``dynamo_backend=``: ``torch.compile`` applied to every model ``prepare`` returns.

Example:
    >>> normalize_backend(None), normalize_backend("INDUCTOR")
    ('no', 'inductor')
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..errors import ConfigError


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


def is_compiled(model: Any) -> bool:
    """True for the module ``torch.compile`` returns."""
    return isinstance(getattr(model, "_orig_mod", None), torch.nn.Module)


def compile_model(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    """``torch.compile(model, backend=backend)`` unless off or already compiled."""
    if backend == "no" or is_compiled(model):
        return model
    compiled: torch.nn.Module = torch.compile(model, backend=backend)  # type: ignore[assignment]
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


__all__ = ["compile_model", "is_compiled", "normalize_backend", "unwrap"]
