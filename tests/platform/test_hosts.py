"""Colab and Kaggle as they are today, fed to detection as their environment markers."""

from __future__ import annotations

import pytest

from nbaccel.config import LaunchConfig
from nbaccel.config.store import with_host_defaults
from nbaccel.errors import ConfigError
from nbaccel.platform import environment, hardware
from nbaccel.platform.hardware import Hardware
from nbaccel.platform.hosts import detect_host, tpu_devices

COLAB = {"COLAB_RELEASE_TAG": "release-colab_20251101-060000_RC00"}
KAGGLE = {"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "KAGGLE_URL_BASE": "https://www.kaggle.com"}
COLAB_TPU = {**COLAB, "TPU_ACCELERATOR_TYPE": "v5litepod-1"}
KAGGLE_TPU = {**KAGGLE, "TPU_ACCELERATOR_TYPE": "v5litepod-8"}
T4X2 = ("Tesla T4", "Tesla T4")
MARKERS = ("COLAB_RELEASE_TAG", "KAGGLE_KERNEL_RUN_TYPE", "TPU_ACCELERATOR_TYPE", "COLAB_TPU_ADDR")


@pytest.mark.parametrize(
    ("environ", "gpus", "label", "defaults"),
    [
        (
            COLAB_TPU,
            (),
            "Google Colab, TPU v5e-1",
            {"compute_device": "tpu", "num_processes": 1, "mixed_precision": "bf16"},
        ),
        (
            KAGGLE_TPU,
            (),
            "Kaggle, TPU v5e-8",
            {"compute_device": "tpu", "num_processes": 8, "mixed_precision": "bf16"},
        ),
        (
            KAGGLE,
            T4X2,
            "Kaggle, GPU T4 x2",
            {"compute_device": "gpu", "num_processes": 2, "mixed_precision": "fp16"},
        ),
        (
            COLAB,
            ("NVIDIA A100-SXM4-40GB",),
            "Google Colab, GPU A100-SXM4-40GB",
            {"compute_device": "gpu", "num_processes": 1, "mixed_precision": "bf16"},
        ),
        (COLAB, (), "Google Colab, CPU only", {}),
        ({}, (), "this machine", {}),
        ({}, T4X2, "this machine, GPU T4 x2", {}),  # a lab's own machine: its own config
    ],
)
def test_each_host_is_detected_with_its_defaults(environ, gpus, label, defaults):
    host = detect_host(environ, gpus)
    assert host.label == label
    assert host.defaults() == defaults


def test_tpu_accelerator_types():
    assert tpu_devices("v5litepod-1") == ("v5e", 1)
    assert tpu_devices("v5litepod-8") == ("v5e", 8)
    assert tpu_devices("v6e-4") == ("v6e", 4)
    assert tpu_devices("v3-8") == ("v3", 8)  # one XLA device per TensorCore
    assert tpu_devices("v4-8") == ("v4", 4)  # megacore: one device per chip
    assert tpu_devices("") is None and tpu_devices("T4") is None


@pytest.mark.parametrize(("environ", "expected"), [(COLAB_TPU, 1), (KAGGLE_TPU, 8)])
def test_tpu_core_count_reads_the_accelerator_type(monkeypatch, environ, expected):
    for name in (*MARKERS, "TPU_NUM_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert environment.tpu_core_count() == expected


def test_user_choices_win_and_markers_without_the_devices_suggest_nothing():
    kaggle = detect_host(KAGGLE, T4X2)
    chosen = LaunchConfig(num_processes=1, mixed_precision="no")
    assert with_host_defaults(chosen, kaggle, "gpu").num_processes == 1
    assert (
        with_host_defaults(LaunchConfig(mixed_precision="bf16"), kaggle, "gpu").mixed_precision
        == "bf16"
    )
    # TPU markers but no torch_xla (the devices seen are the CPU): no TPU defaults
    assert with_host_defaults(LaunchConfig(), detect_host(KAGGLE_TPU), "cpu") == LaunchConfig()
    assert (
        with_host_defaults(LaunchConfig(compute_device="cpu"), kaggle, "gpu").num_processes is None
    )


def _pretend(monkeypatch, environ, gpus):
    for name in MARKERS:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(hardware, "cuda_device_count", lambda: len(gpus))
    monkeypatch.setattr(hardware, "_gpu_names", lambda count: tuple(gpus[:count]))


def test_nbaccel_env_names_the_host_and_its_defaults(monkeypatch):
    from nbaccel.cli import env

    _pretend(monkeypatch, KAGGLE, T4X2)
    rows = dict(env.report())
    assert rows["Notebook host"] == "Kaggle, GPU T4 x2"
    assert rows["Suggested defaults"] == (
        "compute_device='gpu', num_processes=2, mixed_precision='fp16'"
    )


def test_nbaccel_config_starts_from_the_host_defaults(monkeypatch, tmp_path):
    from nbaccel.cli import config

    _pretend(monkeypatch, KAGGLE, T4X2)
    monkeypatch.setattr(hardware, "detect_hardware", lambda: Hardware("gpu", 2, T4X2, 4))
    start = config._starting_point(tmp_path / "missing.yaml")
    assert (start.compute_device, start.num_processes, start.mixed_precision) == ("gpu", 2, "fp16")


@pytest.mark.parametrize(
    ("environ", "gpus", "kind", "expected"),
    [
        (COLAB_TPU, (), "tpu", (1, "bf16", "Google Colab, TPU v5e-1")),
        (KAGGLE_TPU, (), "tpu", (8, "bf16", "Kaggle, TPU v5e-8")),
        (KAGGLE, T4X2, "gpu", (2, "fp16", "Kaggle, GPU T4 x2")),
    ],
)
def test_panel_offers_the_host_defaults(monkeypatch, tmp_path, environ, gpus, kind, expected):
    pytest.importorskip("ipywidgets", reason="the panel needs the notebook extra")
    from nbaccel.ui.panel import LaunchPanel

    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(tmp_path / "none.yaml"))
    monkeypatch.setenv("HOME", str(tmp_path))
    _pretend(monkeypatch, environ, gpus)
    devices = Hardware(kind, expected[0], tuple(gpus), 4)
    panel = LaunchPanel(lambda: None, hardware=devices)
    assert (panel.config.num_processes, panel.config.mixed_precision) == expected[:2]
    assert expected[2] in panel.children[0].value


# ------------------------------------------------ Kaggle's 2 x T4: no bf16, fp16 offered


def _never_called():
    raise AssertionError("the function must not run")


def test_bf16_on_t4_warns_naming_fp16_before_any_process_starts(monkeypatch):
    import os

    from nbaccel import notebook_launcher

    _pretend(monkeypatch, KAGGLE, T4X2)
    from nbaccel.platform import environment as env_module

    monkeypatch.setattr(env_module, "gpu_count", lambda: 2)

    def no_fork():  # the warning must come before anything is started
        raise AssertionError("forked")

    monkeypatch.setattr(os, "fork", no_fork)
    with (
        pytest.warns(RuntimeWarning, match=r"'bf16' is not native on Tesla T4") as caught,
        pytest.raises(AssertionError, match="forked"),
    ):
        notebook_launcher(_never_called, num_processes=2, mixed_precision="bf16")
    assert "use mixed_precision='fp16'" in str(caught[0].message)


def test_fp8_on_t4_is_refused_and_fp16_passes_silently(monkeypatch):
    import warnings

    from nbaccel.launch.testing import plan_for

    _pretend(monkeypatch, KAGGLE, T4X2)
    from nbaccel.platform import environment as env_module

    monkeypatch.setattr(env_module, "gpu_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"'fp8' is not native on Tesla T4.*'fp16'"):
        plan_for(print, num_processes=2, mixed_precision="fp8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = plan_for(print, num_processes=2, mixed_precision="fp16")
        assert plan.config.mixed_precision == "fp16"
        plan_for(  # the CPU: no GPU question
            print,
            num_processes=2,
            mixed_precision="bf16",
            config=LaunchConfig(compute_device="cpu"),
        )


def test_panel_offers_fp16_on_t4_and_flags_a_saved_bf16(monkeypatch, tmp_path):
    pytest.importorskip("ipywidgets", reason="the panel needs the notebook extra")
    from nbaccel.ui.panel import LaunchPanel

    monkeypatch.setenv("HOME", str(tmp_path))
    _pretend(monkeypatch, KAGGLE, T4X2)
    t4 = Hardware("gpu", 2, T4X2, 4)
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(tmp_path / "none.yaml"))
    panel = LaunchPanel(lambda: None, hardware=t4)
    assert tuple(panel.controls["mixed_precision"].options) == ("no", "fp16")
    assert panel.controls["mixed_precision"].value == "fp16"
    assert not panel.launch_button.disabled
    saved = LaunchConfig(compute_device="gpu", num_processes=2, mixed_precision="bf16")
    panel = LaunchPanel(lambda: None, hardware=t4, config=saved)
    assert tuple(panel.controls["mixed_precision"].options) == ("no", "fp16", "bf16")
    assert "use mixed_precision=&#x27;fp16&#x27;" in panel.messages["mixed_precision"].value
    assert panel.launch_button.disabled
    a100 = Hardware("gpu", 1, ("NVIDIA A100-SXM4-40GB",), 4)
    assert "bf16" in LaunchPanel(lambda: None, hardware=a100).controls["mixed_precision"].options


@pytest.mark.parametrize(
    "name", ["Tesla T4", "Tesla V100-SXM2-16GB", "NVIDIA A100-SXM4-40GB", "NVIDIA L4"]
)
def test_bf16_by_name_and_by_compute_capability_is_one_decision(name):
    """A GPU known by name only (the pre-flight check without nvidia-smi's compute_cap, the
    host's defaults) gets the decision the compute capability gets (issue 50: it was made
    twice, by a name list and by a capability bound)."""
    from nbaccel.launch.start._freegpus import precision_line
    from nbaccel.platform.gpufacts import GpuFacts
    from nbaccel.platform.hosts import gpu_without_bf16, lacks_bf16, name_capability

    capability = name_capability(name)
    assert capability is not None, name
    by_capability = precision_line(GpuFacts((name,), (capability,)), [0], "bf16", False)
    assert (gpu_without_bf16([name]) is not None) is lacks_bf16(capability)
    assert (by_capability is not None) is lacks_bf16(capability), by_capability
