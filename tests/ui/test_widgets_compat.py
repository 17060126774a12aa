"""The panel and the monitor on ipywidgets 7 (Colab ships 7.7.1) and 8, in plain Python.

The dev venv has ipywidgets 8; the Colab-like stack (scripts/stacks.env) runs this file,
test_widgets.py and test_monitor.py on 7.7.1. The browser side of 7 is
tests/stacks/test_browser_widgets7.py.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("ipywidgets")
import ipywidgets

from nbaccel.config import field_help
from nbaccel.platform.hardware import Hardware
from nbaccel.ui._widgets_compat import ipywidgets_major, widget_mimebundle
from nbaccel.ui.monitor import RunMonitor
from nbaccel.widgets import LaunchPanel

CPU = Hardware("cpu", 4, (), 4)
VIEW = "application/vnd.jupyter.widget-view+json"


def test_every_control_shows_its_help_text_without_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(tmp_path / "none.yaml"))
    with warnings.catch_warnings():
        # ipywidgets 7 ignores unknown keywords (tooltip=) with a traitlets DeprecationWarning
        warnings.simplefilter("error", DeprecationWarning)
        panel = LaunchPanel(lambda: None, hardware=CPU)
    name = "tooltip" if ipywidgets_major() >= 8 else "description_tooltip"
    for field, control in panel.controls.items():
        assert getattr(control, name) == field_help().get(field, ""), field
    assert ipywidgets_major() == int(ipywidgets.__version__.split(".")[0])


def test_the_monitor_displays_as_a_widget_view():
    monitor = RunMonitor(widget=True, stream=None)
    bundle = monitor._repr_mimebundle_()
    assert bundle[VIEW]["model_id"] == monitor.widget.model_id
    assert bundle[VIEW]["version_major"] == 2
    assert "state" in bundle["text/plain"]  # the text table, not the widget's repr
    assert widget_mimebundle(monitor.widget)[VIEW] == bundle[VIEW]
