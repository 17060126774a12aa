"""Pre-flight GPU checks, on the CPU by pretending the machine has GPUs (NVML count).

More processes than GPUs must be refused before any process exists, naming the
CPU/gloo alternative (before: both ranks took cuda:0 and NCCL failed later with
"Duplicate GPU detected"). tests/gpu checks the same on a real GPU.
"""

from __future__ import annotations

import os

import pytest

from nbaccel import ConfigError, LaunchConfig, notebook_launcher
from nbaccel.launch.testing import plan_for
from nbaccel.platform import environment


def _never_called() -> None:
    raise AssertionError("the function must not run")


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    def install(n: int) -> None:
        monkeypatch.setattr(environment, "gpu_count", lambda: n)

    return install


@pytest.mark.parametrize(("processes", "visible"), [(2, 1), (3, 2)])
def test_more_processes_than_gpus_is_refused_before_anything_starts(
    gpus, monkeypatch, processes, visible
):
    gpus(visible)

    def no_fork() -> int:  # a launch that gets this far has started processes: too late
        raise AssertionError("the launcher forked before refusing")

    monkeypatch.setattr(os, "fork", no_fork)
    with pytest.raises(ConfigError) as err:
        notebook_launcher(_never_called, num_processes=processes)
    message = str(err.value)
    assert f"num_processes={processes}" in message and f"{visible} visible GPU" in message
    assert "config=LaunchConfig(compute_device='cpu')" in message and "gloo" in message


def test_gpu_ids_limit_the_usable_gpus(gpus):
    gpus(4)
    with pytest.raises(ConfigError, match="2 visible GPUs"):
        plan_for(print, num_processes=3, config=LaunchConfig(gpu_ids="0,1"))


def test_the_cpu_alternative_and_one_process_per_gpu_pass(gpus):
    gpus(1)
    plan = plan_for(
        print, num_processes=2, start_method="fork", config=LaunchConfig(compute_device="cpu")
    )
    assert plan.num_processes == 2 and plan.config.compute_device == "cpu"
    gpus(2)
    assert plan_for(print, num_processes=2, start_method="fork").num_processes == 2
    gpus(0)  # no GPU at all: CPU processes over gloo, as before
    assert plan_for(print, num_processes=2, start_method="fork").num_processes == 2
