"""LaunchPanel in plain Python: controls, bounds, validation, Save and Launch.

The browser rendering is covered by tests/ui/test_browser.py; here the widget model
is driven directly (trait values, ``Button.click()``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("ipywidgets")

from waits import HANG_GUARD_S

from nbaccel.config import (
    COMPUTE_DEVICES,
    PRECISIONS,
    START_METHODS,
    LaunchConfig,
    field_names,
    load_config,
    save_config,
)
from nbaccel.errors import ConfigError
from nbaccel.platform.hardware import Hardware
from nbaccel.widgets import LaunchPanel

CPU = Hardware("cpu", 4, (), 4)
GPUS = Hardware("gpu", 2, ("Test GPU",), 16)


def train(x=1):
    rank = int(os.environ.get("RANK", "0"))
    print(f"hello from rank {rank}", flush=True)
    return rank * 10 + x


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path, monkeypatch):
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(tmp_path / "cfg.yaml"))
    for var in list(os.environ):
        if var.startswith("NBACCEL_") and var != "NBACCEL_CONFIG_FILE":
            monkeypatch.delenv(var)


def test_importing_widgets_package_does_not_import_ipywidgets():
    code = "import sys, nbaccel.widgets; assert 'ipywidgets' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_controls_are_derived_from_launch_config():
    panel = LaunchPanel(train, hardware=CPU)
    assert list(panel.controls) == list(field_names())
    assert tuple(panel.controls["mixed_precision"].options) == PRECISIONS
    assert tuple(panel.controls["start_method"].options) == START_METHODS
    assert tuple(panel.controls["compute_device"].options) == COMPUTE_DEVICES
    assert "Hardware:" in panel.children[0].value and "4 CPU cores" in panel.children[0].value
    assert panel.output in panel.children


def test_starting_values_come_from_file_and_environment(tmp_path, monkeypatch):
    save_config(
        LaunchConfig(num_processes=3, mixed_precision="bf16", gradient_accumulation_steps=4),
        tmp_path / "cfg.yaml",
    )
    monkeypatch.setenv("NBACCEL_MIXED_PRECISION", "fp16")
    panel = LaunchPanel(train, hardware=CPU)
    assert panel.controls["num_processes"].value == 3
    assert panel.controls["gradient_accumulation_steps"].value == 4
    assert panel.controls["mixed_precision"].value == "fp16"  # env beats file
    explicit = LaunchPanel(train, config=LaunchConfig(num_processes=5), hardware=CPU)
    assert explicit.config.num_processes == 5


def test_broken_config_file_still_shows_the_panel(tmp_path):
    (tmp_path / "cfg.yaml").write_text("num_gpus: 3\n")
    panel = LaunchPanel(train, hardware=CPU)
    assert "num_gpus" in panel.status.value
    assert panel.config.num_processes == 4  # CPU only: it starts at one process per core


def test_number_bounds():
    panel = LaunchPanel(train, hardware=CPU)
    c = panel.controls
    assert (c["num_processes"].min, c["gradient_accumulation_steps"].min) == (1, 1)
    assert (c["num_nodes"].min, c["max_restarts"].min) == (1, 0)
    assert (c["master_port"].min, c["master_port"].max) == (1, 65535)
    c["num_processes"].value = 0  # bounded widgets clamp instead of accepting
    assert c["num_processes"].value == 1


def test_node_rank_is_bounded_by_num_nodes_and_multi_node_rows_toggle():
    panel = LaunchPanel(train, hardware=CPU)
    c, rows = panel.controls, panel.rows
    assert c["node_rank"].max == 0
    assert all(
        rows[n].layout.display == "none" for n in ("node_rank", "master_addr", "master_port")
    )
    c["num_nodes"].value = 4
    assert c["node_rank"].max == 3
    assert all(rows[n].layout.display is None for n in ("node_rank", "master_addr", "master_port"))
    c["node_rank"].value = 3
    c["master_addr"].value = "10.0.0.1"
    cfg = panel.config
    assert (cfg.num_nodes, cfg.node_rank, cfg.master_addr, cfg.master_port) == (
        4,
        3,
        "10.0.0.1",
        29500,
    )
    c["num_nodes"].value = 2
    assert c["node_rank"].value == 1  # clamped to the new maximum
    c["num_nodes"].value = 1
    assert panel.config.master_port is None and panel.config.node_rank == 0


def test_the_cluster_field_places_the_nodes_itself():
    panel = LaunchPanel(train, hardware=CPU)
    c, rows = panel.controls, panel.rows
    c["num_nodes"].value = 2
    c["cluster"].value = "ray"
    # the cluster meets itself: no rendezvous address, port or node rank to ask for
    assert all(
        rows[n].layout.display == "none" for n in ("node_rank", "master_addr", "master_port")
    )
    cfg = panel.config
    assert (cfg.cluster, cfg.num_nodes, cfg.node_rank, cfg.master_port) == ("ray", 2, 0, None)
    c["cluster"].value = "  "
    assert panel.config.cluster is None and rows["master_port"].layout.display is None


def test_invalid_combination_disables_launch_and_says_why_next_to_the_field():
    panel = LaunchPanel(train, hardware=CPU)
    assert not panel.launch_button.disabled
    panel.controls["num_nodes"].value = 2
    panel.controls["master_addr"].value = ""
    assert panel.launch_button.disabled
    assert "master_addr" in panel.messages["master_addr"].value
    assert "master_addr" in panel.launch_button.tooltip
    with pytest.raises(ConfigError, match="master_addr"):
        panel.launch()
    panel.controls["master_addr"].value = "10.0.0.1"
    assert not panel.launch_button.disabled
    assert panel.messages["master_addr"].value == ""


def test_hardware_checks():
    panel = LaunchPanel(train, hardware=CPU)
    panel.controls["compute_device"].value = "gpu"
    assert panel.launch_button.disabled and "no CUDA GPU" in panel.messages["compute_device"].value
    gpu_panel = LaunchPanel(train, hardware=GPUS)
    assert gpu_panel.controls["num_processes"].value >= 1
    assert gpu_panel.rows["gpu_ids"].layout.display is None  # GPUs: gpu_ids offered
    assert LaunchPanel(train, hardware=CPU).rows["gpu_ids"].layout.display == "none"
    gpu_panel.controls["compute_device"].value = "gpu"
    gpu_panel.controls["num_processes"].value = 3
    assert gpu_panel.launch_button.disabled
    assert "only 2 GPU(s)" in gpu_panel.messages["num_processes"].value
    gpu_panel.controls["num_processes"].value = 2
    assert not gpu_panel.launch_button.disabled


def test_config_property_round_trips_every_field():
    cfg = LaunchConfig(
        compute_device="cpu",
        num_processes=3,
        mixed_precision="bf16",
        gradient_accumulation_steps=2,
        num_nodes=2,
        node_rank=1,
        master_addr="10.1.2.3",
        master_port=29511,
        start_method="spawn",
        max_restarts=1,
        timeout=30.0,
        debug=True,
        strategy="fsdp",
        fsdp_auto_wrap_policy="size_based_wrap",
        fsdp_transformer_cls_names_to_wrap="Block",
        fsdp_min_num_params=250_000_000,
        fsdp_reshard_after_forward=False,
        fsdp_cpu_offload=True,
        fsdp_activation_checkpointing=True,
        fsdp_state_dict_type="FULL_STATE_DICT",
        fsdp_cpu_ram_efficient_loading=True,
        deepspeed_zero_stage=3,
        deepspeed_offload_param_device="cpu",
        deepspeed_gradient_clipping=0.5,
        deepspeed_config_file="ds_config.json",
    )
    assert LaunchPanel(train, config=cfg, hardware=CPU).config == cfg


def test_save_as_default_button(tmp_path):
    panel = LaunchPanel(train, hardware=CPU)
    panel.controls["num_processes"].value = 2
    panel.controls["mixed_precision"].value = "bf16"
    panel.save_button.click()
    assert load_config(tmp_path / "cfg.yaml") == panel.config
    assert "Saved to" in panel.status.value


class FakeHandle:
    """What the panel needs of a LaunchHandle: events for the live view, then the result."""

    def __init__(self) -> None:
        self.listeners: list = []
        self.ranks = {0: {"state": "running", "step": 0, "scalars": {}}}

    def add_listener(self, callback, *, replay=False):
        self.listeners.append(callback)
        return callback

    def remove_listener(self, callback):
        self.listeners.remove(callback)

    def status(self):
        return {rank: dict(entry) for rank, entry in self.ranks.items()}

    def result(self, timeout=None):
        # a worker logs while the panel waits, then finishes
        self.ranks[0] = {"state": "running", "step": 3, "scalars": {"loss": 0.5}}
        for callback in list(self.listeners):
            callback(0, "log", {"step": 3, "values": {"loss": 0.5}})
        self.ranks[0] = dict(self.ranks[0], state="finished")
        for callback in list(self.listeners):
            callback(0, "state", {"state": "finished"})
        return "result"


def test_launch_button_calls_the_launcher_with_the_panels_config(monkeypatch):
    import nbaccel.launch.launcher

    calls = []

    def fake_launcher(function, args=(), **kwargs):
        calls.append((function, args, kwargs))
        print("fake run")
        return FakeHandle()

    monkeypatch.setattr(nbaccel.launch.launcher, "notebook_launcher", fake_launcher)
    panel = LaunchPanel(train, args=(7,), hardware=CPU, launcher_kwargs={"return_all_ranks": True})
    panel.controls["num_processes"].value = 2
    panel.controls["compute_device"].value = "cpu"
    panel.background.value = False  # the button waits for the result (the kernel is busy)
    panel.launch_button.click()
    (function, args, kwargs) = calls[0]
    assert function is train and args == (7,)
    assert kwargs["config"] == panel.config
    assert kwargs["return_all_ranks"] is True
    assert kwargs["output"] is panel.sink  # worker lines go to the panel's output area
    # started in the background so the live view follows it, then waited for
    assert kwargs["block"] is False
    assert panel.result == "result" and "Finished" in panel.status.value
    assert panel.monitor.widget in panel.children
    assert "loss" in panel.monitor.text() and "finished" in panel.monitor.text()
    assert not panel.launch_button.disabled
    assert panel.launch() == "result" and len(calls) == 2
    handle = panel.launch(block=False)  # returns the LaunchHandle at once
    assert isinstance(handle, FakeHandle) and "background" in panel.status.value


class SlowHandle(FakeHandle):
    """A run that goes on until the test lets it finish."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.release = threading.Event()

    def result(self, timeout=None):
        assert self.release.wait(HANG_GUARD_S)
        if self.ranks.get("fail"):
            raise ValueError("rank 1 failed")
        return super().result(timeout)


def _until_the_run_ends(panel):
    """Wait for a background run's last step: the panel's waiting thread sets the result and
    the status, then enables Launch again, so the button is the event to wait for (the
    status or result alone came first: fc12's Colab stack saw Finished with Launch still
    disabled). The bound is a hang guard, never a speed bound."""
    import time

    guard = time.monotonic() + HANG_GUARD_S
    while panel.launch_button.disabled and time.monotonic() < guard:
        time.sleep(0.01)


def test_launch_button_runs_in_the_background_by_default(monkeypatch):
    import nbaccel.launch.launcher

    handles = []

    def fake_launcher(function, args=(), **kwargs):
        handles.append(SlowHandle())
        return handles[-1]

    monkeypatch.setattr(nbaccel.launch.launcher, "notebook_launcher", fake_launcher)
    panel = LaunchPanel(train, hardware=CPU)
    assert panel.background.value is True
    panel.launch_button.click()  # returns while the run goes on: the kernel stays free
    assert not handles[0].release.is_set() and panel.handle is handles[0]
    assert "background" in panel.status.value and panel.launch_button.disabled
    handles[0].release.set()
    _until_the_run_ends(panel)
    assert panel.result == "result" and "Finished" in panel.status.value
    assert not panel.launch_button.disabled
    assert "finished" in panel.monitor.text()
    panel.launch_button.click()  # a failing run: its error in the output area
    handles[1].ranks["fail"] = True
    handles[1].release.set()
    _until_the_run_ends(panel)
    assert "ValueError" in panel.status.value and "rank 1 failed" in panel.sink.getvalue()
    assert not panel.launch_button.disabled


def test_more_processes_than_cores_or_tpu_cores_is_a_warning():
    two_cores = Hardware("cpu", 0, (), 2)
    panel = LaunchPanel(train, hardware=two_cores, config=LaunchConfig(num_processes=2))
    assert panel.warnings() == {} and panel.messages["num_processes"].value == ""
    panel.controls["num_processes"].value = 3
    assert "3 processes on 2 CPU core(s)" in panel.messages["num_processes"].value
    assert "#e65100" in panel.messages["num_processes"].value  # advice, not an error
    assert not panel.launch_button.disabled
    tpu = LaunchPanel(
        train, hardware=Hardware("tpu", 4, (), 96), config=LaunchConfig(num_processes=8)
    )
    assert "8 processes for 4 TPU core(s)" in tpu.warnings()["num_processes"]
    gpus = LaunchPanel(train, hardware=GPUS, config=LaunchConfig(num_processes=3))
    assert "only 2 GPU(s)" in gpus.messages["num_processes"].value  # an error there
    assert gpus.launch_button.disabled


def test_every_label_and_choice_fits_its_control():
    from nbaccel.ui._panel_parts import LABEL_CH, VALUE_CH, label

    panel = LaunchPanel(train, hardware=CPU)
    for name, control in panel.controls.items():
        assert control.description == label(name)
        assert len(control.description) + 2 <= LABEL_CH
        assert control.style.description_width == f"{LABEL_CH}ch"
        assert control.layout.width == f"{LABEL_CH + VALUE_CH}ch"
        for choice in getattr(control, "options", ()):
            assert len(str(choice)) + 4 <= VALUE_CH  # room for the dropdown's arrow


def test_launch_failure_is_shown_in_the_output_area(monkeypatch):
    import nbaccel.launch.launcher

    def failing_launcher(function, args=(), **kwargs):
        raise RuntimeError("workers exploded")

    monkeypatch.setattr(nbaccel.launch.launcher, "notebook_launcher", failing_launcher)
    panel = LaunchPanel(train, hardware=CPU)
    panel.launch_button.click()  # must not raise into the front-end
    assert "Failed" in panel.status.value
    with pytest.raises(RuntimeError, match="workers exploded"):
        panel.launch()
    assert not panel.launch_button.disabled


@pytest.mark.integration
def test_real_two_process_cpu_launch():
    panel = LaunchPanel(train, args=(1,), hardware=CPU)
    panel.controls["compute_device"].value = "cpu"
    panel.controls["num_processes"].value = 2
    assert panel.launch(return_all_ranks=True) == [1, 11]
    assert "Finished" in panel.status.value
    shown = panel.sink.getvalue()
    assert "[rank0] hello from rank 0" in shown and "[rank1] hello from rank 1" in shown
    assert panel.output.outputs[0]["text"] == shown


def test_output_sink_redraws_carriage_returns_and_trims():
    import ipywidgets

    from nbaccel.ui.panel import OutputSink

    out = ipywidgets.Output()
    sink = OutputSink(out, max_lines=3)
    sink.write("start\n")
    for pct in (10, 50, 100):
        sink.write(f"{pct}%|bar\r")
    assert sink.getvalue() == "start\n100%|bar"
    sink.write("\ndone\r\nend\n")
    assert sink.getvalue() == "done\nend\n"  # only the last 3 lines are kept
    assert out.outputs == ({"output_type": "stream", "name": "stdout", "text": "done\nend\n"},)
    sink.clear()
    assert out.outputs == () and sink.getvalue() == ""
