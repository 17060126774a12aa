"""nbaccel.platform.environment: pure detection, no CUDA/XLA initialisation, no torch import."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from nbaccel.platform import environment


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_cpu_count_is_positive_and_respects_affinity():
    import os

    assert 1 <= environment.cpu_count() <= (os.cpu_count() or 1)


def test_detection_does_not_import_torch_or_touch_cuda():
    out = _run(
        """
        import sys
        import nbaccel.launcher, nbaccel.platform.environment as env
        print(env.cuda_initialized(), env.in_notebook(), "torch" in sys.modules)
        env.gpu_count()  # may import torch, must not initialise CUDA
        import torch
        print(torch.cuda.is_initialized())
        """
    )
    assert out.splitlines() == ["False False False", "False"]


def test_importing_the_launcher_patches_nothing():
    # the CUDA-initialisation recorder is installed by a launch (tests/test_import.py)
    out = _run(
        """
        import sys
        import nbaccel.launcher
        assert "torch" not in sys.modules
        import torch
        print(getattr(torch.cuda._lazy_init, "_nbaccel_cudatrace", False))
        """
    )
    assert out == "False"


def test_gpu_count_honours_hidden_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert environment.gpu_count() == 0


def test_loopback_helpers():
    assert environment.is_loopback("127.0.0.1")
    assert environment.is_loopback("localhost")
    assert not environment.is_loopback("192.0.2.1")
    assert environment.loopback_interface()


def test_xla_needs_torch_xla(monkeypatch):
    import importlib.util

    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    expected = importlib.util.find_spec("torch_xla") is not None
    assert environment.xla_requested() is expected


@pytest.mark.parametrize(
    ("env", "expected"),
    [({"TPU_NUM_DEVICES": "4"}, 4), ({"COLAB_TPU_ADDR": "10.0.0.2:8470"}, 8), ({}, None)],
)
def test_tpu_core_count(monkeypatch, env, expected):
    for name in ("TPU_NUM_DEVICES", "COLAB_TPU_ADDR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert environment.tpu_core_count() == expected


def test_summary_keys():
    info = environment.summary()
    assert {"cpu_count", "gpu_count", "cuda_initialized", "fork_preferred"} <= set(info)


def _cuda_build_without_nvml(monkeypatch, driver_files: set[str]):
    import torch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)  # no libnvidia-ml
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(environment.sys, "platform", "linux")
    real_exists = environment.os.path.exists
    monkeypatch.setattr(
        environment.os.path,
        "exists",
        lambda p: (
            p in driver_files or (p not in environment._NVIDIA_DRIVER_FILES and real_exists(p))
        ),
    )
    calls = []
    monkeypatch.setattr(environment, "_gpu_count_in_subprocess", lambda: calls.append(1) or 3)
    return calls


def test_cuda_torch_without_a_driver_counts_no_gpu_without_a_subprocess(monkeypatch):
    # PyPI's CUDA torch on a machine without GPUs: no NVML, no driver files. Counting in
    # a subprocess cost every launch seconds there (found by the torch-matrix CI runs).
    calls = _cuda_build_without_nvml(monkeypatch, set())
    assert environment.gpu_count() == 0
    assert calls == []


@pytest.mark.parametrize("driver_file", ["/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg"])
def test_a_driver_without_nvml_is_still_counted_in_a_subprocess(monkeypatch, driver_file):
    calls = _cuda_build_without_nvml(monkeypatch, {driver_file})
    assert environment.gpu_count() == 3
    assert calls == [1]
