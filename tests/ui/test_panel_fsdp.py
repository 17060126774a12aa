"""The panel's strategy switch: FSDP options appear only when fsdp is chosen, and a
one-process FSDP launch is refused next to the field before anything starts."""

from __future__ import annotations

import pytest

from nbaccel.config import LaunchConfig
from nbaccel.platform.hardware import Hardware

pytest.importorskip("ipywidgets")
from nbaccel.widgets import LaunchPanel

CPU = Hardware("cpu", 4, (), 4)


def test_panel_shows_fsdp_options_only_for_fsdp_and_refuses_one_process():
    panel = LaunchPanel(print, config=LaunchConfig(num_processes=1), hardware=CPU)
    assert panel.rows["fsdp_auto_wrap_policy"].layout.display == "none"
    panel.controls["strategy"].value = "fsdp"
    assert panel.rows["fsdp_auto_wrap_policy"].layout.display is None
    assert "2 or more processes" in panel.messages["strategy"].value
    assert panel.launch_button.disabled
    panel.controls["num_processes"].value = 2
    assert not panel.launch_button.disabled
    assert panel.config.strategy == "fsdp"
    assert panel.config.fsdp_transformer_cls_names_to_wrap is None  # empty text means none
