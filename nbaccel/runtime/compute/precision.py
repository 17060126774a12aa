"""Mixed precision behind one small interface.

A ``Precision`` answers four questions for the Accelerator: how the model is
adapted before wrapping (fp8 swaps its Linear layers), which context the forward
runs under, how ``backward`` treats the loss, and how the optimizer steps (fp16
unscales and may skip the step on inf/nan).

Modes: ``"no"`` (fp32), ``"bf16"`` (autocast on CPU and GPU), ``"fp16"`` (autocast
plus ``torch.amp.GradScaler``), ``"fp8"`` (torchao float8 training on GPUs of compute
capability >= 8.9, with bf16 autocast around it). A mode that cannot run here is a
:class:`~nbaccel.errors.ConfigError` at construction, never a silent fallback.

Example:
    >>> import torch
    >>> p = make_precision("bf16", torch.device("cpu"))
    >>> with p.autocast():
    ...     y = torch.nn.Linear(2, 2)(torch.ones(1, 2))
    >>> y.dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from ...config import normalize_precision
from ...errors import ConfigError
from . import fp8


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

    mode: str = "no"
    scaler: Any = None

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


class AutocastPrecision(FullPrecision):
    """bf16 (or fp16 without a scaler, used as a base): forward under ``torch.autocast``."""

    def __init__(
        self,
        mode: str,
        device: torch.device,
        dtype: torch.dtype,
        autocast_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.mode = mode
        self.device_type = device.type
        self.dtype = dtype
        # AutocastKwargs carries cache_enabled=None meaning "torch's default".
        self.autocast_kwargs = {k: v for k, v in (autocast_kwargs or {}).items() if v is not None}
        # Older torch builds *warn* and disable autocast for an unsupported dtype;
        # turn that silent fallback into an error here, at construction.
        problem = None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.autocast(self.device_type, dtype=dtype, **self.autocast_kwargs):
                    active = torch.is_autocast_enabled(self.device_type)
            if self.autocast_kwargs.get("enabled", True) and not active:
                problem = "; ".join(str(w.message) for w in caught) or "autocast stayed off"
        except TypeError as err:
            raise ConfigError(
                f"autocast_kwargs={self.autocast_kwargs!r} rejected by torch.autocast: {err}. "
                "Pass only AutocastKwargs(enabled=..., cache_enabled=...)."
            ) from err
        except (RuntimeError, ValueError) as err:
            problem = str(err)
        if problem is not None:
            raise ConfigError(
                f"mixed_precision={mode!r} is not supported on device {device} by torch "
                f"{torch.__version__}: {problem}. Use mixed_precision='no' (or 'bf16')."
            )

    def autocast(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return torch.autocast(self.device_type, dtype=self.dtype, **self.autocast_kwargs)


class Fp16Precision(AutocastPrecision):
    """fp16: autocast plus a ``torch.amp.GradScaler``.

    ``backward`` scales the loss; ``unscale_`` divides the gradients by the scale
    once per step (a second call before :meth:`step` is a no-op, so clipping and
    stepping can both ask for it); ``step`` skips the update when a gradient is
    inf/nan and returns False.

    The scale is updated once per iteration, after *every* registered optimizer has
    stepped (PyTorch's AMP rule): updating between two optimizers' steps would reset the
    scaler's record of which gradients are already unscaled, and the second optimizer
    would step with gradients still multiplied by the loss scale. An iteration in which
    some optimizer does not step (GAN-style alternation) is closed by the next
    ``backward``.
    """

    def __init__(
        self,
        device: torch.device,
        scaler_kwargs: dict[str, Any] | None = None,
        autocast_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__("fp16", device, torch.float16, autocast_kwargs)
        try:
            self.scaler = torch.amp.GradScaler(device.type, **(scaler_kwargs or {}))
        except (RuntimeError, TypeError, ValueError, AttributeError) as err:
            raise ConfigError(
                f"mixed_precision='fp16' needs torch.amp.GradScaler on {device.type!r}, which "
                f"torch {torch.__version__} rejected: {err}. Use mixed_precision='bf16' "
                "or check GradScalerKwargs."
            ) from err
        self._unscaled: set[int] = set()
        self._optimizers: set[int] = set()  # registered by the prepared optimizers
        self._stepped: set[int] = set()  # stepped since the last scale update

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer`` among those that step before each scale update."""
        self._optimizers.add(id(optimizer))

    def forget_optimizers(self) -> None:
        """Drop the registered optimizers (``Accelerator.free_memory`` released them)."""
        self._update()
        self._optimizers.clear()

    def _update(self) -> None:
        if self._stepped:
            self.scaler.update()
            self._stepped.clear()
            self._unscaled.clear()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self._update()  # an iteration in which not every optimizer stepped ends here
        self.scaler.scale(loss).backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._unscaled:
            return
        self.scaler.unscale_(optimizer)
        self._unscaled.add(id(optimizer))

    def _found_inf(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """Whether ``scaler.step`` skipped ``optimizer`` (None if torch hides it)."""
        states = getattr(self.scaler, "_per_optimizer_states", None)
        found = (states or {}).get(id(optimizer), {}).get("found_inf_per_device")
        if not found:
            return None
        return bool(sum(v.item() for v in found.values()))

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        self._unscaled.discard(id(optimizer))
        if not self.scaler.is_enabled():
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        found_inf = self._found_inf(optimizer)
        self._stepped.add(id(optimizer))
        if self._optimizers <= self._stepped:  # every optimizer of the iteration stepped
            self._update()
        if found_inf is not None:
            return not found_inf
        # update() lowers the scale exactly when a step was skipped for inf/nan
        return bool(self.scaler.get_scale() >= before)

    def state_dict(self) -> dict[str, Any]:
        self._update()
        return dict(self.scaler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.scaler.load_state_dict(state)


class Fp8Precision(AutocastPrecision):
    """fp8 via torchao's float8 training: the layers :func:`~nbaccel.runtime.compute.fp8.fp8_layers` names (or
    ``recipe.module_filter_func``'s) become ``Float8Linear`` with ``recipe.config``; the rest
    of the model runs under bf16 autocast; no loss scaling is needed.

    fp8 pays only on large layers and compiled (``dynamo_backend="inductor"``): before
    training, one warning says so where a model has no layer that gains, or is prepared
    without compilation.
    """

    def __init__(
        self,
        device: torch.device,
        autocast_kwargs: dict[str, Any] | None = None,
        recipe: Any = None,
    ) -> None:
        reason = fp8.unavailable_reason(device)
        if reason is not None:
            raise ConfigError(
                f"mixed_precision='fp8' cannot run here: {reason}. Use mixed_precision='bf16' "
                "(or run on an H100/H200/L4/RTX 40xx-class GPU with torchao installed)."
            )
        super().__init__("fp8", device, torch.bfloat16, autocast_kwargs)
        self.recipe = recipe  # an AORecipeKwargs, or None
        self.converted = 0  # Linear layers made Float8Linear, over every prepared model

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = fp8.convert(model, self.recipe)
        self.converted += sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        return model

    def check_compiled(self, compiled: bool) -> None:
        """After ``prepare``: warn once where fp8 layers will run without compilation."""
        if compiled or not self.converted or getattr(self, "_warned_eager", False):
            return
        self._warned_eager = True
        warnings.warn(
            f"mixed_precision='fp8' without torch.compile: {fp8.EAGER}. Pass "
            "Accelerator(mixed_precision='fp8', dynamo_backend='inductor'), or torch.compile "
            "the prepared model yourself.",
            RuntimeWarning,
            stacklevel=4,
        )


def autocast_context(precision: Any, handler: Any = None) -> contextlib.AbstractContextManager[Any]:
    """``precision``'s autocast, with ``handler``'s (an ``AutocastKwargs``) settings if given."""
    if handler is None or not hasattr(precision, "device_type"):
        return precision.autocast()
    kwargs = {**getattr(precision, "autocast_kwargs", {}), **handler.to_kwargs()}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return torch.autocast(precision.device_type, dtype=precision.dtype, **kwargs)


def make_precision(
    mode: str | None,
    device: torch.device,
    *,
    scaler_kwargs: dict[str, Any] | None = None,
    autocast_kwargs: dict[str, Any] | None = None,
    fp8_recipe: Any = None,
) -> Precision:
    """Build the :class:`Precision` for ``mode`` on ``device``; raise a clear error if unsupported.

    Args:
        mode: "no"/None/"fp32", "bf16", "fp16" or "fp8" (case-insensitive).
        device: the device this process computes on.
        scaler_kwargs: forwarded to ``torch.amp.GradScaler`` (fp16 only).
        autocast_kwargs: forwarded to ``torch.autocast`` (e.g. ``cache_enabled``);
            ``enabled=False`` turns autocast off while keeping the mode.
        fp8_recipe: an ``AORecipeKwargs`` (fp8 only).

    Raises:
        ConfigError: unknown mode, or a mode this machine cannot run.

    Example:
        >>> make_precision("fp16", torch.device("cpu")).scaler is not None
        True
    """
    canonical = normalize_precision(mode)
    device = torch.device(device)
    if canonical == "no":
        return FullPrecision()
    if canonical == "bf16":
        return AutocastPrecision("bf16", device, torch.bfloat16, autocast_kwargs)
    if canonical == "fp16":
        return Fp16Precision(device, scaler_kwargs, autocast_kwargs)
    return Fp8Precision(device, autocast_kwargs, fp8_recipe)


__all__ = [
    "AutocastPrecision",
    "Fp8Precision",
    "Fp16Precision",
    "FullPrecision",
    "Precision",
    "make_precision",
]
