"""Make a module a view of :mod:`nbaccel.utils` (for ``accelerate.utils.<submodule>``).

Example:
    >>> getattr_, dir_ = delegate()
    >>> getattr_("set_seed").__name__
    'set_seed'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def delegate() -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for a module whose names are those of ``nbaccel.utils``."""

    def getattr_(name: str) -> Any:
        return getattr(importlib.import_module("nbaccel.utils"), name)

    def dir_() -> list[str]:
        return list(importlib.import_module("nbaccel.utils").__all__)

    return getattr_, dir_


__all__ = ["delegate"]
