"""Alias of :mod:`nbaccel.runtime.facade.accelerator`, kept so ``import nbaccel.accelerator`` works."""

from .runtime.facade.accelerator import Accelerator, DistributedType

__all__ = ["Accelerator", "DistributedType"]
