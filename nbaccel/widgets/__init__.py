"""ipywidgets front-ends of nbaccel. ipywidgets is imported only when a widget is used.

Example:
    >>> from nbaccel.widgets import LaunchPanel  # doctest: +SKIP
    >>> def train():
    ...     ...
    >>> LaunchPanel(train)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"LaunchPanel": "nbaccel.ui.panel"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from ..ui.panel import LaunchPanel as LaunchPanel


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nbaccel.widgets' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] == "ipywidgets":
            raise ImportError(
                "nbaccel.widgets needs ipywidgets>=8: pip install 'nbaccel[notebook]'"
            ) from err
        raise
    globals()[name] = value
    return value
