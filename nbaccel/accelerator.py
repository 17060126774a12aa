"""Alias of :mod:`nbaccel.runtime.accelerator`, kept so ``import nbaccel.accelerator`` works."""

from .runtime.accelerator import Accelerator, DistributedType

__all__ = ["Accelerator", "DistributedType"]
