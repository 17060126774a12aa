"""``ParallelismConfig`` without processes: sizes, validation, names, and the refusals
that come before any work (Accelerate's meaning; see nbaccel.runtime.parallel)."""

from __future__ import annotations

import pytest

from nbaccel import Accelerator, ParallelismConfig
from nbaccel.errors import ConfigError
from nbaccel.runtime.parallel.checks import check_runnable
from nbaccel.utils import TorchContextParallelConfig, TorchTensorParallelConfig


def test_sizes_default_to_one_and_read_accelerates_environment(monkeypatch):
    assert ParallelismConfig().total_size == 1
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    config = ParallelismConfig()
    assert (config.dp_shard_size, config.tp_size, config.total_size) == (2, 2, 4)
    assert isinstance(config.tp_handler, TorchTensorParallelConfig)  # made for tp > 1
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "two")
    with pytest.raises(ConfigError, match="PARALLELISM_CONFIG_CP_SIZE='two'"):
        ParallelismConfig()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_size": 0}, r"tp_size=0\): use an int >= 1"),
        ({"dp_shard_size": 1.5}, r"dp_shard_size=1.5"),
        ({"dp_replicate_size": True}, r"dp_replicate_size=True"),
        ({"dp_replicate_size": 2, "tp_size": 2}, "does not compose with pure replication"),
        ({"dp_replicate_size": 2, "cp_size": 2}, "does not compose with pure replication"),
    ],
)
def test_bad_sizes_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParallelismConfig(**kwargs)


def test_dimension_names_and_sizes_follow_accelerate():
    hsdp_tp = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    assert hsdp_tp.active_mesh_dims == ["dp_replicate", "dp_shard", "tp"]
    assert hsdp_tp.dp_dim_names == ["dp_replicate", "dp_shard"]
    assert hsdp_tp.non_dp_dim_names == ["tp"]
    assert hsdp_tp.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    assert (hsdp_tp.data_parallel_size, hsdp_tp.non_data_parallel_size) == (4, 2)
    # which data each rank reads comes from the mesh alone (data_parallel_share), one
    # computation for the Accelerator and prepare_data_loader: tests/parallel/test_mesh_training
    cp = ParallelismConfig(dp_shard_size=2, cp_size=2)
    assert (cp.dp_shard_cp_dim_names, cp.dp_cp_dim_names) == (
        ["dp_shard", "cp"],
        ["dp_shard", "cp"],
    )
    assert cp.fsdp_enabled and not ParallelismConfig(dp_replicate_size=4).fsdp_enabled
    assert TorchContextParallelConfig().cp_comm_strategy == "allgather"
    with pytest.raises(ConfigError, match="'allgather' or 'alltoall'"):
        TorchContextParallelConfig(cp_comm_strategy="ring")


def test_sizes_are_checked_against_the_process_count_before_anything_starts():
    with pytest.raises(ConfigError, match=r"multiplies to 4, but the launch has 2 process"):
        check_runnable(
            ParallelismConfig(dp_shard_size=2, tp_size=2), device_type="cpu", num_processes=2
        )
    with pytest.raises(ConfigError, match="CUDA's flash/efficient attention"):
        check_runnable(
            ParallelismConfig(dp_shard_size=2, cp_size=2), device_type="cpu", num_processes=4
        )
    with pytest.raises(ConfigError, match="DeepSpeed's sequence-parallel"):
        check_runnable(ParallelismConfig(sp_size=2), device_type="cuda", num_processes=2)
    check_runnable(ParallelismConfig(), device_type="cpu", num_processes=3)  # replicate: fine


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_async_tensor_parallel_is_refused_on_every_device_saying_why(device_type):
    """It only acts inside a torch.compile'd graph that nbaccel does not make: on CUDA it
    used to be accepted and change nothing."""
    handler = TorchTensorParallelConfig(enable_async_tp=True)
    config = ParallelismConfig(dp_shard_size=2, tp_size=2, tp_handler=handler)
    with pytest.raises(ConfigError, match=r"enable_async_tp=True\): .*torch\.compile.*"):
        check_runnable(config, device_type=device_type, num_processes=4)
    check_runnable(  # the default stays accepted
        ParallelismConfig(dp_shard_size=2, tp_size=2), device_type=device_type, num_processes=4
    )


def test_accelerator_takes_the_config_and_refuses_a_mismatch_on_one_process():
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    acc = Accelerator(cpu=True, parallelism_config=ParallelismConfig())
    assert acc.parallelism_config.total_size == 1
    assert acc.torch_device_mesh is None and not acc.is_composable_parallelism_enabled
    assert acc.context_parallel_rank == 0
    with acc.maybe_context_parallel(buffers=[]):
        pass
    with pytest.raises(ConfigError, match="multiplies to 2, but the launch has 1"):
        Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=2))
    with pytest.raises(TypeError, match="pass a ParallelismConfig"):
        Accelerator(cpu=True, parallelism_config=object())


def test_importable_where_accelerate_scripts_look():
    from nbaccel import accelerate

    assert accelerate.parallelism_config.ParallelismConfig is ParallelismConfig
    assert accelerate.utils.TorchTensorParallelConfig is TorchTensorParallelConfig


def test_nbaccel_launch_reads_accelerates_section_and_checks_it_before_starting(tmp_path):
    """Accelerate's tp_hsdp.yaml (8 processes' sizes) with --num_processes 4: refused by the
    launcher, naming the sizes; the script never runs."""
    import os
    import subprocess
    import sys

    config = tmp_path / "tp_hsdp.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nfsdp_config:\n"
        "  fsdp_version: 2\n  fsdp_state_dict_type: SHARDED_STATE_DICT\nnum_processes: 4\n"
        "parallelism_config:\n  parallelism_config_cp_size: 1\n"
        "  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 2\n"
        "  parallelism_config_tp_size: 2\nuse_cpu: true\n"
    )
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBACCEL_", "ACCELERATE_"))}
    cmd = [sys.executable, "-m", "nbaccel", "launch", "--config_file", str(config), str(script)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode != 0
    assert "multiplies to 8, but the launch has 4 process(es)" in out.stderr + out.stdout
    assert not marker.exists()


def test_an_older_torch_is_refused_naming_the_version_to_install(monkeypatch):
    import dataclasses

    from nbaccel.platform import torchcompat
    from nbaccel.runtime.parallel.api import resolve_parallelism
    from nbaccel.runtime.process.state import get_state

    monkeypatch.setattr(torchcompat, "fsdp_supported", lambda: False)
    two = dataclasses.replace(get_state(cpu=True), world_size=2)
    with pytest.raises(ConfigError, match=r"parallelism_config needs torch>=2\.9"):
        resolve_parallelism(ParallelismConfig(dp_shard_size=2), two)


def test_the_callers_config_is_never_written_to(monkeypatch):
    """resolve_parallelism completes sizes (all 1 on 2 processes: replicate 2) on a copy:
    the caller's object may serve another Accelerator or launch with other sizes."""
    import dataclasses

    from nbaccel.runtime.parallel.api import resolve_parallelism
    from nbaccel.runtime.process.state import get_state

    two = dataclasses.replace(get_state(cpu=True), world_size=2)
    config = ParallelismConfig()
    with pytest.raises(ConfigError, match="deepspeed_plugin"):  # refused after completing
        resolve_parallelism(config, two, deepspeed_plugin=object())
    assert (config.dp_replicate_size, config.total_size, config.device_mesh) == (1, 1, None)


def test_strategy_deepspeed_next_to_sharding_sizes_is_refused_naming_both(monkeypatch):
    """The mesh strategy used to win silently over the launch configuration's
    strategy='deepspeed' (an explicit deepspeed_plugin is refused the same way)."""
    from nbaccel.config import LaunchConfig
    from nbaccel.runtime.parallel.from_launch import check_launch
    from nbaccel.runtime.process.state import get_state
    from nbaccel.runtime.strategy import select_strategy

    monkeypatch.setenv("NBACCEL_STRATEGY", "deepspeed")
    with pytest.raises(ConfigError, match=r"strategy='deepspeed'.*set strategy='fsdp'"):
        select_strategy(get_state(cpu=True), parallelism=ParallelismConfig(dp_shard_size=2))
    cfg = LaunchConfig(strategy="deepspeed", parallelism_config_tp_size=2, compute_device="cpu")
    with pytest.raises(ConfigError, match=r"parallelism_config_\* fields 1"):
        check_launch(cfg, num_processes=2)  # the launcher: before any process starts
    check_launch(  # pure replication is data parallel, which DeepSpeed does: accepted
        LaunchConfig(strategy="deepspeed", parallelism_config_dp_replicate_size=2),
        num_processes=2,
    )
