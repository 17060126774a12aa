"""Unit tests of LaunchConfig, its YAML storage and the precedence of its sources.

No process group, no workers: everything here is pure logic and files in tmp_path.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nbaccel.config import (
    COMPUTE_DEVICES,
    CONFIG_VERSION,
    ENV_VARS,
    PRECISIONS,
    START_METHODS,
    LaunchConfig,
    default_config_path,
    field_names,
    load_config,
    resolve_launch_config,
    save_config,
    write_basic_config,
)
from nbaccel.config.file import RENAMED_KEYS
from nbaccel.errors import ConfigError

# ------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"num_processes": 0}, "num_processes=0"),
        ({"num_processes": True}, "num_processes=True"),
        ({"mixed_precision": "fp64"}, "mixed_precision='fp64'"),
        ({"compute_device": "npu"}, "compute_device='npu'"),
        ({"start_method": "forkserver"}, "start_method='forkserver'"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0"),
        (
            {"num_nodes": 2, "node_rank": 2, "master_port": 29500},
            "node_rank=2 must be < num_nodes=2",
        ),
        ({"num_nodes": 2}, "master_port=None with num_nodes > 1"),
        ({"master_port": 70000}, "master_port=70000"),
        ({"master_addr": ""}, "master_addr=''"),
        ({"max_restarts": -1}, "max_restarts=-1"),
        ({"timeout": 0}, "timeout=0"),
        ({"debug": "yes"}, "debug='yes'"),
        ({"gpu_ids": 3}, "gpu_ids=3"),
    ],
)
def test_invalid_values_name_the_field(changes, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        LaunchConfig(**changes)


def test_precision_aliases_are_normalised():
    assert LaunchConfig(mixed_precision="FP32").mixed_precision == "no"  # type: ignore[arg-type]
    assert LaunchConfig(mixed_precision=None).mixed_precision == "no"  # type: ignore[arg-type]
    assert LaunchConfig(mixed_precision="BF16").mixed_precision == "bf16"  # type: ignore[arg-type]


def test_config_is_frozen_and_keyword_only():
    cfg = LaunchConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_processes = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        LaunchConfig("cpu")  # type: ignore[misc]


def test_replace_validates_and_rejects_unknown_fields():
    assert LaunchConfig().replace(num_processes=4).num_processes == 4
    with pytest.raises(ConfigError, match="unknown LaunchConfig field"):
        LaunchConfig().replace(num_gpus=4)
    with pytest.raises(ConfigError, match="num_processes=0"):
        LaunchConfig().replace(num_processes=0)


def test_choices_are_defined_once():
    assert PRECISIONS == ("no", "fp16", "bf16", "fp8")
    assert "auto" in START_METHODS and "cpu" in COMPUTE_DEVICES
    assert field_names()[0] == "compute_device"
    # every field has exactly one environment variable
    assert sorted(ENV_VARS.values()) == sorted(field_names())
    assert ENV_VARS["NBACCEL_DEBUG_MODE"] == "debug"


# ----------------------------------------------------------------------------- YAML


def test_yaml_round_trip(tmp_path):
    cfg = LaunchConfig(
        compute_device="cpu",
        num_processes=3,
        mixed_precision="bf16",
        gradient_accumulation_steps=4,
        num_nodes=2,
        node_rank=1,
        master_addr="10.0.0.7",
        master_port=29555,
        start_method="spawn",
        gpu_ids="0,1",
        max_restarts=2,
        timeout=90.5,
        debug=True,
    )
    path = save_config(cfg, tmp_path / "sub" / "cfg.yaml")
    assert path == tmp_path / "sub" / "cfg.yaml"
    data = yaml.safe_load(path.read_text())
    assert data["config_version"] == CONFIG_VERSION
    assert next(iter(data)) == "config_version"
    assert load_config(path) == cfg
    # the default precision "no" must survive YAML 1.1 (bare `no` is a boolean there)
    save_config(LaunchConfig(), path)
    assert load_config(path).mixed_precision == "no"


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path, monkeypatch):
    path = save_config(LaunchConfig(num_processes=2), tmp_path / "c.yaml")
    import nbaccel.config.file as cf

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(cf.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        save_config(LaunchConfig(num_processes=5), path)
    # the old file is intact and no temporary is left behind
    assert load_config(path).num_processes == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_hand_written_yaml_with_bare_no_and_missing_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mixed_precision: no\nnum_processes: 2\n")
    cfg = load_config(path)
    assert (cfg.mixed_precision, cfg.num_processes, cfg.num_nodes) == ("no", 2, 1)


def test_old_version_file_still_loads(tmp_path):
    # version 0: no config_version, the peer's key names, use_cpu instead of compute_device
    path = tmp_path / "old.yaml"
    path.write_text(
        "num_machines: 2\nmachine_rank: 1\nmain_process_ip: 10.1.1.1\n"
        "main_process_port: 29501\ndebug_mode: true\nuse_cpu: true\nmixed_precision: bf16\n"
    )
    cfg = load_config(path)
    assert cfg == LaunchConfig(
        compute_device="cpu",
        num_nodes=2,
        node_rank=1,
        master_addr="10.1.1.1",
        master_port=29501,
        debug=True,
        mixed_precision="bf16",
    )
    assert set(RENAMED_KEYS.values()) <= set(field_names())


def test_old_and_new_name_together_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_machines: 2\nnum_nodes: 2\nmaster_port: 1\n")
    with pytest.raises(ConfigError, match=r"'num_machines'.*'num_nodes'"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("num_gpus: 2\n", ["unknown key 'num_gpus'", "valid keys:", "num_processes"]),
        ("num_processes: '4'\n", ["num_processes='4'", "wrong type", "int"]),
        ("debug: 1\n", ["debug=1", "wrong type", "bool"]),
        ("mixed_precision: 16\n", ["mixed_precision=16"]),
        ("compute_device: quantum\n", ["compute_device='quantum'", "cpu"]),
        ("num_processes: [\n", ["not valid YAML", "line"]),
        ("- a\n- b\n", ["must hold a YAML mapping", "list"]),
        ("config_version: 99\nnew_key: 1\n", ["unknown key 'new_key'", "newer nbaccel"]),
        ("config_version: x\n", ["config_version='x'"]),
        ("num_nodes: 2\nnode_rank: 5\nmaster_port: 29500\n", ["node_rank=5"]),
    ],
)
def test_bad_files_name_key_and_file(tmp_path, text, fragments):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message


def test_binary_and_empty_files(tmp_path):
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\x00\xff\xfe\x01")
    with pytest.raises(ConfigError, match=str(binary)):
        load_config(binary)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == LaunchConfig()


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_launch_config(environ={}, config_file=tmp_path / "nope.yaml")


# ------------------------------------------------------------------------ locations


def test_default_config_path_order(tmp_path):
    assert default_config_path({"NBACCEL_CONFIG_FILE": str(tmp_path / "x.yaml")}) == (
        tmp_path / "x.yaml"
    )
    assert default_config_path({"XDG_CACHE_HOME": str(tmp_path)}) == (
        tmp_path / "nbaccel" / "default_config.yaml"
    )
    assert default_config_path({}) == Path.home() / ".cache" / "nbaccel" / "default_config.yaml"
    both = {"NBACCEL_CONFIG_FILE": "/a.yaml", "XDG_CACHE_HOME": "/b"}
    assert default_config_path(both) == Path("/a.yaml")


def test_write_basic_config_detects_hardware_and_never_overwrites(tmp_path):
    path = tmp_path / "basic.yaml"
    assert write_basic_config(mixed_precision="bf16", save_location=path) == path
    cfg = load_config(path)
    assert cfg.mixed_precision == "bf16"
    assert cfg.compute_device in ("cpu", "gpu", "tpu")
    assert cfg.num_processes is not None and cfg.num_processes >= 1
    before = path.read_text()
    assert write_basic_config(mixed_precision="fp16", save_location=path) is None
    assert path.read_text() == before
    with pytest.raises(ConfigError, match="mixed_precision='fp7'"):
        write_basic_config(mixed_precision="fp7", save_location=tmp_path / "other.yaml")


def test_write_basic_config_uses_default_path_and_does_not_initialise_cuda(tmp_path):
    code = (
        "import sys, torch\n"
        "from nbaccel.config import write_basic_config\n"
        "p = write_basic_config()\n"
        "assert p is not None and p.exists(), p\n"
        "assert not torch.cuda.is_initialized()\n"
        "print(p)\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("NBACCEL_CONFIG_FILE", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(tmp_path / "nbaccel" / "default_config.yaml")


# ----------------------------------------------------------------------- precedence


def test_precedence_arguments_env_file_defaults(tmp_path):
    path = save_config(
        LaunchConfig(num_processes=3, mixed_precision="fp16", gradient_accumulation_steps=5),
        tmp_path / "c.yaml",
    )
    env = {
        "NBACCEL_CONFIG_FILE": str(path),
        "NBACCEL_MIXED_PRECISION": "bf16",
        "NBACCEL_NUM_PROCESSES": "4",
    }
    # file only
    assert resolve_launch_config(environ={"NBACCEL_CONFIG_FILE": str(path)}).num_processes == 3
    # env beats file
    cfg = resolve_launch_config(environ=env)
    assert (cfg.num_processes, cfg.mixed_precision, cfg.gradient_accumulation_steps) == (
        4,
        "bf16",
        5,
    )
    # arguments beat env; None arguments are ignored
    cfg = resolve_launch_config({"num_processes": 2, "mixed_precision": None}, environ=env)
    assert (cfg.num_processes, cfg.mixed_precision) == (2, "bf16")
    # config_file=False ignores the file, defaults fill in
    cfg = resolve_launch_config(environ=env, config_file=False)
    assert (cfg.gradient_accumulation_steps, cfg.num_processes) == (1, 4)
    # an explicit config_file wins over NBACCEL_CONFIG_FILE
    other = save_config(LaunchConfig(gradient_accumulation_steps=7), tmp_path / "o.yaml")
    assert resolve_launch_config(environ=env, config_file=other).gradient_accumulation_steps == 7


def test_missing_default_file_means_no_values(tmp_path):
    env = {"NBACCEL_CONFIG_FILE": str(tmp_path / "absent.yaml")}
    assert resolve_launch_config(environ=env) == LaunchConfig()
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    assert resolve_launch_config(environ=env) == LaunchConfig()


def test_environment_variables(tmp_path):
    env = {
        "NBACCEL_USE_CPU": "1",
        "NBACCEL_DEBUG_MODE": "true",
        "NBACCEL_TIMEOUT": "12.5",
        "NBACCEL_GRADIENT_ACCUMULATION_STEPS": "8",
        "NBACCEL_GPU_IDS": "0,1",
        "NBACCEL_MASTER_PORT": "",  # empty means unset
    }
    cfg = resolve_launch_config(environ=env, config_file=False)
    assert cfg.compute_device == "cpu"
    assert cfg.debug is True and cfg.timeout == 12.5
    assert cfg.gradient_accumulation_steps == 8 and cfg.gpu_ids == "0,1"
    assert cfg.master_port is None
    assert (
        resolve_launch_config(environ={"NBACCEL_USE_CPU": "0"}, config_file=False).compute_device
        == "auto"
    )


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"NBACCEL_NUM_PROCESSES": "two"}, "NBACCEL_NUM_PROCESSES"),
        ({"NBACCEL_DEBUG_MODE": "maybe"}, "NBACCEL_DEBUG_MODE"),
        ({"NBACCEL_MIXED_PRECISION": "fp64"}, "NBACCEL_MIXED_PRECISION"),
        ({"NBACCEL_USE_CPU": "perhaps"}, "NBACCEL_USE_CPU"),
        ({"NBACCEL_USE_CPU": "1", "NBACCEL_COMPUTE_DEVICE": "gpu"}, "contradicts"),
        ({"NBACCEL_NUM_PROCESSES": "0"}, "environment variable NBACCEL_NUM_PROCESSES"),
    ],
)
def test_bad_environment_names_the_variable(env, fragment):
    with pytest.raises(ConfigError, match=fragment):
        resolve_launch_config(environ=env, config_file=False)


def test_errors_say_where_each_value_came_from(tmp_path):
    path = save_config(LaunchConfig(num_nodes=2, master_port=29500), tmp_path / "c.yaml")
    with pytest.raises(ConfigError) as info:
        resolve_launch_config({"node_rank": 2}, environ={}, config_file=path)
    message = str(info.value)
    assert "node_rank came from the arguments" in message
    assert f"num_nodes came from config file {path}" in message


def test_unknown_override_is_rejected():
    with pytest.raises(ConfigError, match="unknown launch setting 'num_gpus'"):
        resolve_launch_config({"num_gpus": 2}, environ={}, config_file=False)


def test_resolve_reads_os_environ_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(tmp_path / "none.yaml"))
    monkeypatch.setenv("NBACCEL_MIXED_PRECISION", "bf16")
    assert resolve_launch_config().mixed_precision == "bf16"


def test_importing_config_does_not_import_torch():
    code = "import sys, nbaccel.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
