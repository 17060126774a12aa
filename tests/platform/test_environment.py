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
        print(torch.cuda.is_initialized(), env.cuda_driver_loaded())
        """
    )
    assert out.splitlines() == ["False False False", "False False"]


def test_launcher_import_wraps_cuda_lazy_init_when_torch_comes_later():
    out = _run(
        """
        import sys
        import nbaccel.launcher
        assert "torch" not in sys.modules
        import torch
        print(getattr(torch.cuda._lazy_init, "_nbaccel_cudatrace", False))
        """
    )
    assert out == "True"


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
