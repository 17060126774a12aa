"""What differs between ipywidgets 7 (Colab ships 7.7.1) and 8, in one place.

The panel and the monitor use these helpers instead of the few ipywidgets 8 names
that 7 lacks, so both render and behave the same on either major version:

* a control's hover text is ``tooltip`` in 8 and ``description_tooltip`` in 7 (7
  ignores ``tooltip`` with a traitlets ``DeprecationWarning`` on every widget);
* a widget shows itself through ``_repr_mimebundle_`` in 8 and through
  ``_ipython_display_`` in 7, so the monitor builds the widget-view bundle itself there.

ipywidgets is imported only when a helper is called (no import-time side effects).

Example:
    >>> tooltip_kwargs("help text") in ({"tooltip": "help text"},
    ...                                 {"description_tooltip": "help text"})
    True
"""

from __future__ import annotations

import functools
from typing import Any

#: ``version_major`` of the widget-view MIME type that ipywidgets 7 front ends expect.
_VIEW_MIME = "application/vnd.jupyter.widget-view+json"


@functools.lru_cache(maxsize=1)
def ipywidgets_major() -> int:
    """The installed ipywidgets major version (7 or 8)."""
    import ipywidgets

    return int(str(ipywidgets.__version__).split(".")[0])


def tooltip_kwargs(text: str) -> dict[str, str]:
    """The keyword that sets a control's hover text on this ipywidgets version."""
    if ipywidgets_major() >= 8:
        return {"tooltip": text}
    return {"description_tooltip": text}


def widget_mimebundle(widget: Any, **kwargs: Any) -> dict[str, Any]:
    """The MIME bundle that displays ``widget`` (a view of its model) in a cell.

    Args:
        widget: an ipywidgets ``DOMWidget``.
        **kwargs: what IPython passes to ``_repr_mimebundle_`` (include/exclude).
    """
    own = getattr(widget, "_repr_mimebundle_", None)
    if own is not None:  # ipywidgets 8
        return dict(own(**kwargs) or {})
    bundle: dict[str, Any] = {"text/plain": repr(widget)}
    if getattr(widget, "_view_name", None) is not None:  # what 7's _ipython_display_ sends
        bundle[_VIEW_MIME] = {"version_major": 2, "version_minor": 0, "model_id": widget.model_id}
    return bundle


__all__ = ["ipywidgets_major", "tooltip_kwargs", "widget_mimebundle"]
