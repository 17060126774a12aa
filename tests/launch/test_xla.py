"""The torch_xla (TPU) path.

Unit tests of :mod:`nbaccel.platform.tpu`'s answers run here, without
torch_xla. The tests marked ``xla`` run ``tests/xla_scenarios.py`` with
``PJRT_DEVICE=CPU`` in an interpreter that has torch_xla: this one when it does (the
Kaggle-like stack: torch/torch_xla 2.8, scripts/stacks.env), else the separate ``.xla-venv``
(torch 2.9.0 + torch_xla 2.9.0, made by ``scripts/setup_xla.sh``). The one engine
trains through the ``Accelerator`` on the XLA device in workers the TPU backend sets up
(as torch_xla's ``xmp.spawn`` would): ``notebook_launcher``, ``block=False`` with its
status, the warm pool, a failure and ``nbaccel.debug()``; the launching process never
starts the XLA runtime; once it has, a launch is refused; Colab's TPU markers (v5e-1)
refuse 8 processes. One process each: CPU-XLA collectives
across processes do not work, so multi-process XLA needs a TPU (the 8-process start on
Kaggle's markers is tests/platform/test_tpu_backend.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from nbaccel import LaunchConfig, notebook_launcher
from nbaccel.errors import LaunchError
from nbaccel.platform import tpu
from nbaccel.platform.tpu.torch_xla_backend import TorchXlaBackend

ROOT = Path(__file__).resolve().parents[2]
# torch_xla here (a stack), else the .xla-venv of scripts/setup_xla.sh
XLA_PYTHON = (
    Path(sys.executable)
    if importlib.util.find_spec("torch_xla") is not None
    else ROOT / ".xla-venv" / "bin" / "python"
)


# ---------------------------------------------------------------- unit tests (no torch_xla)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, False),
        ({"PJRT_DEVICE": "CPU"}, True),
        ({"PJRT_DEVICE": "TPU"}, True),
        ({"PJRT_DEVICE": " "}, False),
        ({"COLAB_TPU_ADDR": "10.0.0.2:8470"}, True),
        ({"TPU_NAME": "v4-8"}, True),
    ],
)
def test_xla_requested_reads_the_given_environment(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], expected: bool
) -> None:
    monkeypatch.setattr(TorchXlaBackend, "available", lambda self: True)
    assert tpu.xla_requested(environ) is expected


def test_nothing_is_requested_without_torch_xla(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TorchXlaBackend, "available", lambda self: False)
    assert tpu.xla_requested({"PJRT_DEVICE": "TPU", "COLAB_TPU_ADDR": "x"}) is False


def test_launch_without_torch_xla_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TorchXlaBackend, "available", lambda self: False)
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    with pytest.raises(LaunchError, match="torch_xla is not installed: pip install torch_xla"):
        notebook_launcher(print, config=LaunchConfig(compute_device="tpu"))


def test_helpers_do_nothing_when_torch_xla_is_not_loaded() -> None:
    import torch

    if "torch_xla" in __import__("sys").modules:
        pytest.skip("torch_xla is loaded in this interpreter")
    assert tpu.runtime_initialized() is False
    tpu.after_step()  # no-op
    assert tpu.loaded_backend() is None
    assert tpu.backend_for(torch.device("cpu").type) is None
    assert tpu.backend_for(torch.device("xla", 0).type) is tpu.backends()[0]


# ---------------------------------------------------------------- the real thing, in .xla-venv


#: A hang guard, not a speed bound: CI's whole run stops at 90 minutes. The set-up is waited for
#: as an event (its exit status in NBACCEL_XLA_SETUP): on a busy machine it took 48 minutes
#: (a fixed 20 minutes here failed every xla test of that run), on an idle one about 3.
XLA_SETUP_GUARD_S = 5400


def _xla_setup_status() -> str | None:
    """scripts/test.sh sets .xla-venv up beside the main run and names, in
    NBACCEL_XLA_SETUP, the file that holds its exit status once done: that status, "0"
    when the set-up is not run beside (a venv set up by hand), None while it runs."""
    done = os.environ.get("NBACCEL_XLA_SETUP")
    if not done:
        return "0"
    return Path(done).read_text().strip() if os.path.exists(done) else None


@pytest.mark.xla
@pytest.mark.timeout(XLA_SETUP_GUARD_S + 60)
def test_the_xla_venvs_set_up_beside_the_run_ends_well() -> None:
    """The first of the module's xla tests (a module runs in order, in one worker): it waits
    for the set-up's end, however long a slow machine takes, so the others need not."""
    deadline = time.monotonic() + XLA_SETUP_GUARD_S
    while (code := _xla_setup_status()) is None and time.monotonic() < deadline:
        time.sleep(1)
    assert code == "0", f"scripts/setup_xla.sh failed ({code}): its log is in the run's output"


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # the set-up's end was waited for by the test above; if it has not ended, that test
    # failed and says why
    assert _xla_setup_status() == "0", "scripts/setup_xla.sh has not ended well (see above)"
    if not XLA_PYTHON.exists():
        pytest.skip(f"{XLA_PYTHON.parent.parent} is missing: run `bash scripts/setup_xla.sh`")
    out = tmp_path_factory.mktemp("xla") / "scenarios.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBACCEL_", "XLA_"))}
    env.update(PJRT_DEVICE="CPU", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [str(XLA_PYTHON), str(ROOT / "tests" / "xla_scenarios.py"), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0 and out.exists(), (
        f"xla_scenarios.py exited with {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    )
    return json.loads(out.read_text())


def _trained_on_xla(run: dict[str, Any]) -> None:
    assert "crashed" not in run, run.get("crashed")
    assert run["distributed_type"] == "XLA"
    assert run["device"].startswith("xla")
    assert run["param_device"] == "xla" and run["batch_devices"] == ["xla"]
    assert (run["num_processes"], run["process_index"]) == (1, 0)
    losses = run["losses"]
    assert len(losses) == 12  # 3 epochs x 4 batches
    assert losses[-1] < losses[0] / 10, losses
    assert run["weight_device"] == "cpu"  # the returned XLA tensor arrives on the CPU
    assert run["weight"][0][1] == pytest.approx(-2.0, abs=0.5)
    assert run["environ_restored"] and not run["state_left_behind"]
    assert run["checkpoint_restored"]  # save_state/load_state of XLA tensors


@pytest.mark.xla
def test_importing_nbaccel_does_not_import_torch_xla(scenarios: dict[str, Any]) -> None:
    assert scenarios["imported_torch_xla_at_import"] is False


@pytest.mark.xla
def test_notebook_launcher_trains_in_a_worker_the_backend_set_up(scenarios: dict[str, Any]) -> None:
    run = scenarios["spawned"]
    _trained_on_xla(run)
    assert run["pid"] != run["launcher_pid"]  # a worker process trained
    assert scenarios["runtime_after_spawn"] is False  # the "kernel" never touched XLA


@pytest.mark.xla
def test_a_worker_failure_arrives_as_the_original_type(scenarios: dict[str, Any]) -> None:
    failure = scenarios["failure"]
    assert failure["types"][:2] == ["ValueError", "ValueError"]  # also a WorkerError
    assert "WorkerError" in failure["types"]
    assert failure["rank"] == 0
    assert "bad value 7 on xla:0" in failure["message"]
    assert 'xla_scenarios.py", line' in failure["message"]  # the remote traceback
    assert "nbaccel/xla.py" not in failure["message"]  # starting in the user's code


@pytest.mark.xla
def test_one_process_is_a_worker_too_and_the_kernel_never_starts_xla(scenarios) -> None:
    run = scenarios["one_worker"]
    _trained_on_xla(run)
    assert run["pid"] != run["launcher_pid"]
    assert run["losses"] == scenarios["spawned"]["losses"]  # same seed, same device: same run
    assert scenarios["runtime_after_workers"] is False


@pytest.mark.xla
def test_block_false_the_pool_and_post_mortem_serve_xla_workers(scenarios) -> None:
    engine = scenarios["engine"]
    assert "crashed" not in engine, engine.get("crashed")
    assert engine["background_device"].startswith("xla") and engine["logged_loss"]
    assert engine["background_pid"] != scenarios["spawned"]["launcher_pid"]
    first, second = engine["pool_pids"]
    assert first == second and engine["pool_device"].startswith("xla")  # one warm worker
    assert engine["pool_failure"]["types"][0] == "ValueError"
    assert "bad value 5 on xla:0" in engine["pool_failure"]["message"]
    assert "(Pdb) p value + 1\n6\n" in engine["debug_output"], engine["debug_output"]
    assert engine["restarts"] == 0


@pytest.mark.xla
def test_a_launch_after_the_kernel_started_the_runtime_is_refused_clearly(scenarios) -> None:
    assert scenarios["runtime_started_here"] is True
    refused = scenarios["refused"]
    assert refused["types"][0] == "ConfigError", refused
    assert "runtime is already started in this kernel" in refused["message"]
    assert "Restart the kernel" in refused["message"]


@pytest.mark.xla
def test_two_processes_on_the_one_xla_cpu_device_are_refused_before_start(scenarios) -> None:
    # not two ranks that each see num_processes == 1: refused, naming both counts
    refused = scenarios["cpu_2"]
    assert "ConfigError" in refused["types"], refused
    assert "num_processes=2" in refused["message"] and "gives 1 XLA CPU" in refused["message"]


def test_colab_v5e_1_refuses_8_processes_naming_the_runtime(scenarios: dict[str, Any]) -> None:
    refused = scenarios["colab_8"]
    assert refused["types"][0] == "ConfigError", refused
    assert "num_processes=8" in refused["message"]
    assert "Google Colab, TPU v5e-1" in refused["message"]
    assert "torch_xla runs one process per device" in refused["message"]
    assert scenarios["torch_xla_version"].startswith(("2.8", "2.9")), scenarios
