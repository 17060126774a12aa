"""Alias of :mod:`nbaccel.ui.monitor`, kept so ``nbaccel.monitor.watch(handle)`` still works."""

from .ui.monitor import RunMonitor, watch

__all__ = ["RunMonitor", "watch"]
