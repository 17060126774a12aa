"""The TPU backend interface (nbaccel.platform.tpu): a second backend is a module and a
registration, and the hosted TPUs (Colab's v5e-1, Kaggle's v5e-8) launch through it.

``FakeTpu`` below is such a second backend, written only against the protocol: nbaccel's
engine starts one real worker per device and the backend sets each up (its rank); its
device is the CPU. Registered first, it carries ``notebook_launcher``, ``block=False``,
the warm pool, the watchdog and ``nbaccel.debug()`` on Kaggle's and Colab's TPU markers. The torch_xla
backend itself trains on the CPU (``PJRT_DEVICE=CPU``) in tests/launch/test_xla.py, on
torch_xla 2.9 (.xla-venv) and 2.8 (the Kaggle-like stack).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

import nbaccel
from nbaccel import notebook_launcher, start_workers
from nbaccel.errors import ConfigError
from nbaccel.launch.start._tpu import check_process_count
from nbaccel.platform import hardware, tpu
from nbaccel.platform.tpu.torch_xla_backend import TorchXlaBackend

COLAB_TPU = {"COLAB_RELEASE_TAG": "release-colab_20251101-060000_RC00",
             "TPU_ACCELERATOR_TYPE": "v5litepod-1"}  # fmt: skip
KAGGLE_TPU = {"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "TPU_ACCELERATOR_TYPE": "v5litepod-8"}
MARKERS = ("COLAB_RELEASE_TAG", "KAGGLE_KERNEL_RUN_TYPE", "TPU_ACCELERATOR_TYPE",
           "COLAB_TPU_ADDR", "TPU_NAME", "TPU_WORKER_ID", "PJRT_DEVICE", "TPU_NUM_DEVICES")  # fmt: skip
_RANK = "FAKE_TPU_RANK"


class FakeTpu:
    """A TPU backend implemented against the protocol alone (no torch_xla)."""

    name = "faketpu"
    package = "faketpu"
    device_type = "faketpu"
    process_group_backend = "gloo"

    def available(self) -> bool:
        return True

    def requested(self, environ: Mapping[str, str] | None = None) -> bool:
        return tpu.tpu_present(environ)

    def loaded(self) -> bool:
        return _RANK in os.environ

    def version(self) -> str | None:
        return "0.1"

    def runtime_initialized(self) -> bool:
        return False

    def device_count(self, environ: Mapping[str, str] | None = None) -> int | None:
        return TorchXlaBackend().device_count(environ)  # the same markers

    def setup_process(self, local_rank: int, local_world_size: int) -> None:
        os.environ[_RANK] = f"{local_rank}/{local_world_size}"

    def device(self) -> torch.device:
        return torch.device("cpu")

    def world(self) -> tpu.TpuWorld:
        rank, size = (int(v) for v in os.environ.get(_RANK, "0/1").split("/"))
        return tpu.TpuWorld(rank, size, rank, size, 0)

    def init_process_group_kwargs(self) -> dict[str, Any]:
        return {}

    def after_step(self) -> None:
        pass

    def tensor_id(self, tensor: torch.Tensor) -> int:
        return id(tensor)

    def rng_state(self) -> Any:
        return None

    def set_rng_state(self, state: Any) -> None:
        pass


def where_am_i() -> tuple[str, int]:
    return os.environ.get(_RANK, "kernel"), os.getpid()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTpu]:
    for name in MARKERS:
        monkeypatch.delenv(name, raising=False)
    backend = FakeTpu()
    tpu.register_backend(backend, first=True)
    try:
        yield backend
    finally:
        tpu.unregister_backend(backend.name)


def _markers(monkeypatch: pytest.MonkeyPatch, environ: Mapping[str, str]) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)


def test_torch_xla_is_the_first_backend_and_implements_the_protocol() -> None:
    assert isinstance(tpu.backends()[0], TorchXlaBackend)
    assert isinstance(TorchXlaBackend(), tpu.TpuBackend)
    assert tpu.backend_for("xla") is tpu.backends()[0]
    with pytest.raises(TypeError, match="not a TpuBackend"):
        tpu.register_backend(object())  # type: ignore[arg-type]


def test_a_registered_backend_is_what_every_layer_uses(fake: FakeTpu, monkeypatch) -> None:
    assert [b.name for b in tpu.backends()][:2] == ["faketpu", "torch_xla"]
    assert not tpu.xla_requested({})
    _markers(monkeypatch, KAGGLE_TPU)
    assert tpu.xla_requested() and tpu.active_backend() is fake  # platform
    assert tpu.require_backend().device() == torch.device("cpu")  # runtime: the device
    assert tpu.training_backend() is fake and tpu.backend_for("meta") is None
    assert hardware.tpu_device_count() == 8  # `nbaccel env` and the panel count its devices
    assert hardware.detect_hardware().summary().startswith("8 x TPU (v5e, faketpu 0.1)")


def fails_on_rank_3() -> None:
    secret = os.environ[_RANK]
    if secret.startswith("3/"):
        raise KeyError(f"missing {secret}")


def busy_alone(flag: str) -> int:
    import torch.distributed as dist

    from nbaccel import Accelerator

    accelerator = Accelerator()  # the backend's device (the CPU) and world: gloo here
    if accelerator.is_main_process:
        while not os.path.exists(flag):
            sum(range(10_000))
    dist.barrier()
    return accelerator.process_index


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_kaggle_v5e_8_runs_8_workers_of_the_one_engine(fake, monkeypatch, capsys, tmp_path):
    _markers(monkeypatch, KAGGLE_TPU)
    results = notebook_launcher(where_am_i, return_all_ranks=True)
    assert [rank for rank, _ in results] == [f"{i}/8" for i in range(8)]  # set up by it
    assert len({pid for _, pid in results} | {os.getpid()}) == 9  # 8 worker processes
    handle = notebook_launcher(where_am_i, block=False)  # background runs, handles
    assert handle.result(timeout=120)[0] == "0/8"
    with start_workers() as pool:  # the warm pool: 8 workers, many calls, post-mortem
        assert [r for r, _ in pool.call(where_am_i, return_all_ranks=True)] == [
            f"{i}/8" for i in range(8)
        ]
        with pytest.raises(KeyError, match="missing 3/8"):
            pool.call(fails_on_rank_3)
        nbaccel.debug(rank=3, commands=["p secret", "q"])
        assert "'3/8'" in capsys.readouterr().out
        # the watchdog: 7 ranks wait in a barrier for rank 0, which works (never ended)
        flag, lines = tmp_path / "go", []

        def output(rank: int, stream: str, line: str) -> None:
            lines.append(line)
            # the report repeats (2 s, 4 s more, ...): on a loaded machine an early one may
            # still see a rank starting up, a later one all seven waiting
            if "rank(s) 1, 2, 3, 4, 5, 6, 7 wait for rank 0, which is busy in" in line:
                flag.touch()

        ranks = pool.call(busy_alone, (str(flag),), hang_after=2, on_hang="raise",
                          output=output, return_all_ranks=True)  # fmt: skip
        assert ranks == list(range(8)), lines
        assert any("rank(s) 1, 2, 3, 4, 5, 6, 7 wait for rank 0" in ln for ln in lines), lines
        assert pool.restarts == 0


def test_colab_v5e_1_runs_one_worker_and_refuses_8_naming_the_runtime(fake, monkeypatch):
    _markers(monkeypatch, COLAB_TPU)
    rank, pid = notebook_launcher(where_am_i)
    assert (rank, pid != os.getpid()) == ("0/1", True)  # a worker, never the kernel
    with pytest.raises(ConfigError) as err:
        notebook_launcher(where_am_i, num_processes=8)
    message = str(err.value)
    assert "num_processes=8" in message and "Google Colab, TPU v5e-1" in message
    assert "num_processes=1" in message


def test_check_process_count_reads_the_markers() -> None:
    assert check_process_count(None, KAGGLE_TPU) == 8
    assert check_process_count(1, KAGGLE_TPU) == 1
    # torch_xla starts 1 process or one per device: 4 would run 8, refused before start
    with pytest.raises(ConfigError, match=r"num_processes=4, but Kaggle.*8 TPU device.*"
                       r"num_processes=8 .*or num_processes=1"):  # fmt: skip
        check_process_count(4, KAGGLE_TPU)
    assert check_process_count(None, COLAB_TPU) == 1
    assert check_process_count(None, {}) is None  # unknown: the backend decides
    with pytest.raises(ConfigError, match=r"Kaggle, TPU v5e-8 has 8 TPU device"):
        check_process_count(16, KAGGLE_TPU)


def test_the_xla_cpu_runtime_refuses_more_processes_than_its_devices() -> None:
    # PJRT_DEVICE=CPU, no TPU markers: 2 processes on 1 CPU device would each see a world
    # of one (two separate trainings, both rank 0 of 1): refused before start, both counts named
    cpu = {"PJRT_DEVICE": "CPU"}
    with pytest.raises(ConfigError, match=r"num_processes=2, but PJRT_DEVICE=CPU gives 1 XLA "
                       r"CPU device.*CPU_NUM_DEVICES=2"):  # fmt: skip
        check_process_count(2, cpu)
    assert check_process_count(1, cpu) == 1
    assert check_process_count(None, cpu) is None  # one process, as before
    assert check_process_count(2, {**cpu, "CPU_NUM_DEVICES": "2"}) == 2
    with pytest.raises(ConfigError, match=r"num_processes=3, but PJRT_DEVICE=CPU gives 2 XLA"):
        check_process_count(3, {**cpu, "CPU_NUM_DEVICES": "2"})


@pytest.mark.parametrize(
    ("environ", "devices", "host"),
    [(COLAB_TPU, "1 x TPU (v5e, faketpu 0.1)", "Google Colab, TPU v5e-1"),
     (KAGGLE_TPU, "8 x TPU (v5e, faketpu 0.1)", "Kaggle, TPU v5e-8")],
)  # fmt: skip
def test_nbaccel_env_and_the_panel_show_the_tpu_runtime(fake, monkeypatch, tmp_path, environ,
                                                        devices, host):  # fmt: skip
    from nbaccel.cli import env

    _markers(monkeypatch, environ)
    monkeypatch.setattr(hardware, "cuda_device_count", lambda: 0)
    rows = dict(env.report())
    assert rows["Devices"].startswith(devices) and rows["Notebook host"] == host
    pytest.importorskip("ipywidgets", reason="the panel needs the notebook extra")
    from nbaccel.ui.panel import LaunchPanel

    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(tmp_path / "none.yaml"))
    panel = LaunchPanel(lambda: None)
    header = panel.children[0].value
    assert devices in header and host in header
    assert (panel.config.num_processes, panel.config.mixed_precision) == (int(devices[0]), "bf16")
