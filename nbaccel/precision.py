"""Mixed precision behind one small interface (CONTRACT STUB — being filled in).

A ``Precision`` answers three questions for the Accelerator: which context the
forward runs under, how ``backward`` treats the loss, and how the optimizer steps
(fp16 unscales and may skip the step on inf/nan).

Example:
    >>> import torch
    >>> p = make_precision("no", torch.device("cpu"))
    >>> with p.autocast():
    ...     pass
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from .config import normalize_precision


class Precision(Protocol):
    """What the Accelerator needs from a precision mode."""

    mode: str
    scaler: Any  # torch.amp.GradScaler for fp16, else None

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Context for the forward pass."""
        ...

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Run backward on ``loss`` (scaled for fp16)."""
        ...

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients in place (no-op except fp16); safe to call twice per step."""
        ...

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; return False when the step was skipped (inf/nan)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (the GradScaler's), empty if none."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Adapt ``model`` for this precision before wrapping (identity except fp8)."""
        ...


class FullPrecision:
    """fp32: plain autocast-free forward, plain backward and step."""

    mode = "no"
    scaler = None

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        return None

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model


def make_precision(
    mode: str | None,
    device: torch.device,
    *,
    scaler_kwargs: dict[str, Any] | None = None,
    autocast_kwargs: dict[str, Any] | None = None,
) -> Precision:
    """Build the :class:`Precision` for ``mode`` on ``device``; raise a clear error if unsupported."""
    canonical = normalize_precision(mode)
    if canonical == "no":
        return FullPrecision()
    raise NotImplementedError(f"mixed_precision={canonical!r} is not implemented yet")


__all__ = ["FullPrecision", "Precision", "make_precision"]
