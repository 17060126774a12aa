"""A config file written by ``accelerate config`` gives the same launch under nbaccel.

Real files (YAML and JSON, in the shapes ``accelerate config`` writes), read through every
door nbaccel reads a config file by (``load_config``, ``resolve_launch_config``'s
``config_file`` and ``NBACCEL_CONFIG_FILE``), and ``nbaccel launch`` as a real subprocess
falling back to Accelerate's default file under ``$HF_HOME``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from nbaccel.cli.launch import config_file_to_read
from nbaccel.config import load_config, resolve_launch_config
from nbaccel.config.accelerate_file import ACCELERATE_KEYS, DEEPSPEED_KEYS, FSDP_KEYS
from nbaccel.errors import ConfigError

# the documentation page with the table (it was the README's "One configuration, three faces")
PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "accelerate-config.md"

# the keys `accelerate config` writes for every machine type
COMMON = {
    "compute_environment": "LOCAL_MACHINE",
    "debug": False,
    "downcast_bf16": "no",
    "enable_cpu_affinity": False,
    "machine_rank": 0,
    "main_training_function": "main",
    "mixed_precision": "no",
    "num_machines": 1,
    "rdzv_backend": "static",
    "same_network": True,
    "tpu_env": [],
    "tpu_use_cluster": False,
    "tpu_use_sudo": False,
    "use_cpu": False,
}

MULTI_CPU = {**COMMON, "distributed_type": "MULTI_CPU", "num_processes": 2, "use_cpu": True}
# older `accelerate config` versions wrote these for CPUs: off, so accepted
OLD_CPU = {**MULTI_CPU, "ipex_config": {"ipex": False}, "mpirun_config": {}, "fsdp_config": {}}


def _write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    else:
        path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (OLD_CPU, {"compute_device": "cpu", "num_processes": 2, "strategy": "ddp"}),
        (  # on the CPU torch's collective check crashes DDP: debug only
            {**MULTI_CPU, "debug": True},
            {"compute_device": "cpu", "debug": True, "debug_collectives": False},
        ),
        (
            {**COMMON, "distributed_type": "NO", "mixed_precision": "bf16", "gpu_ids": "all"},
            {"num_processes": 1, "compute_device": "auto", "mixed_precision": "bf16"},
        ),
        (  # two machines: Accelerate's 8 processes are 4 per machine here
            {
                **COMMON,
                "distributed_type": "MULTI_GPU",
                "num_processes": 8,
                "num_machines": 2,
                "machine_rank": 1,
                "main_process_ip": "10.0.0.1",
                "main_process_port": 29500,
                "gpu_ids": "0,1, 2,3",
                "mixed_precision": "fp16",
                "debug": True,
            },
            {
                "compute_device": "gpu",
                "num_processes": 4,
                "num_nodes": 2,
                "node_rank": 1,
                "master_addr": "10.0.0.1",
                "master_port": 29500,
                "gpu_ids": "0,1,2,3",
                "mixed_precision": "fp16",
                "debug": True,
                "debug_collectives": True,
            },
        ),
        (  # fsdp_version 2, as `accelerate config` writes it
            {
                **COMMON,
                "distributed_type": "FSDP",
                "num_processes": 2,
                "fsdp_config": {
                    "fsdp_activation_checkpointing": True,
                    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                    "fsdp_cpu_ram_efficient_loading": True,
                    "fsdp_offload_params": True,
                    "fsdp_reshard_after_forward": False,
                    "fsdp_state_dict_type": "FULL_STATE_DICT",
                    "fsdp_transformer_layer_cls_to_wrap": "GPT2Block",
                    "fsdp_version": 2,
                },
            },
            {
                "strategy": "fsdp",
                "fsdp_activation_checkpointing": True,
                "fsdp_auto_wrap_policy": "transformer_based_wrap",
                "fsdp_cpu_ram_efficient_loading": True,
                "fsdp_cpu_offload": True,
                "fsdp_reshard_after_forward": False,
                "fsdp_state_dict_type": "FULL_STATE_DICT",
                "fsdp_transformer_cls_names_to_wrap": "GPT2Block",
            },
        ),
        (  # fsdp_version 1: its options with an FSDP2 meaning
            {
                **COMMON,
                "distributed_type": "FSDP",
                "num_processes": 2,
                "fsdp_config": {
                    "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                    "fsdp_backward_prefetch": "BACKWARD_PRE",
                    "fsdp_forward_prefetch": False,
                    "fsdp_min_num_params": 1000,
                    "fsdp_sharding_strategy": "SHARD_GRAD_OP",
                    "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                    "fsdp_sync_module_states": True,
                    "fsdp_use_orig_params": True,
                },
            },
            {
                "fsdp_auto_wrap_policy": "size_based_wrap",
                "fsdp_min_num_params": 1000,
                "fsdp_reshard_after_forward": False,
                "fsdp_cpu_ram_efficient_loading": True,  # rank 0's weights, as sync did
            },
        ),
        (
            {
                **COMMON,
                "distributed_type": "DEEPSPEED",
                "num_processes": 2,
                "deepspeed_config": {
                    "gradient_accumulation_steps": 4,
                    "gradient_clipping": 0.5,
                    "offload_optimizer_device": "cpu",
                    "offload_param_device": "cpu",
                    "zero3_init_flag": False,
                    "zero3_save_16bit_model": False,
                    "zero_stage": 3,
                },
            },
            {
                "strategy": "deepspeed",
                "gradient_accumulation_steps": 4,
                "deepspeed_gradient_clipping": 0.5,
                "deepspeed_offload_optimizer_device": "cpu",
                "deepspeed_offload_param_device": "cpu",
                "deepspeed_zero_stage": 3,
            },
        ),
        (
            {
                **COMMON,
                "distributed_type": "XLA",
                "num_processes": 8,
                "downcast_bf16": False,
                "dynamo_config": {"dynamo_backend": "NO"},
            },
            {"compute_device": "tpu", "num_processes": 8},
        ),
    ],
    ids=[
        "multi_cpu",
        "multi_cpu_debug",
        "no",
        "multi_gpu_2_machines",
        "fsdp2",
        "fsdp1",
        "deepspeed",
        "xla",
    ],
)
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_accelerate_files_translate_to_the_same_launch(tmp_path, data, expected, suffix):
    path = _write(tmp_path / f"accel{suffix}", data)
    cfg = load_config(path)
    for name, value in expected.items():
        assert getattr(cfg, name) == value, name
    # the other doors read it the same way
    assert resolve_launch_config(environ={}, config_file=path) == cfg
    assert resolve_launch_config(environ={"NBACCEL_CONFIG_FILE": str(path)}) == cfg


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        ({"distributed_type": "MEGATRON_LM"}, ["distributed_type: 'MEGATRON_LM'", "use one of"]),
        ({"distributed_type": "MULTI_NPU"}, ["distributed_type: 'MULTI_NPU'", "MULTI_GPU"]),
        ({"compute_environment": "AMAZON_SAGEMAKER"}, ["compute_environment", "LOCAL_MACHINE"]),
        ({"dynamo_config": {"dynamo_backend": "INDUCTOR"}}, ["dynamo_config", "'inductor'"]),
        ({"num_processes": 3, "num_machines": 2, "main_process_port": 1}, ["num_processes: 3"]),
        ({"rdzv_backend": "etcd"}, ["rdzv_backend: 'etcd'", "static or c10d"]),
        ({"enable_cpu_affinity": True}, ["enable_cpu_affinity: True", "set it false"]),
        ({"downcast_bf16": "fp32"}, ["downcast_bf16", "set 'no'"]),
        ({"tpu_use_cluster": True}, ["tpu_use_cluster", "false"]),
        ({"megatron_lm_config": {"megatron_lm_tp_degree": 2}}, ["megatron_lm_config"]),
        ({"fp8_config": {"backend": "TE"}}, ["fp8_config", "AORecipeKwargs"]),
        ({"num_gpus": 2}, ["unknown key 'num_gpus'", "nbaccel config"]),
        (
            {"fsdp_config": {"fsdp_sharding_strategy": "HYBRID_SHARD"}},
            ["fsdp_config.fsdp_sharding_strategy: 'HYBRID_SHARD'", "FULL_SHARD"],
        ),
        (
            {"fsdp_config": {"fsdp_state_dict_type": "LOCAL_STATE_DICT"}},
            ["fsdp_config.fsdp_state_dict_type", "SHARDED_STATE_DICT"],
        ),
        (
            {"fsdp_config": {"fsdp_use_orig_params": False}},
            ["fsdp_config.fsdp_use_orig_params: False", "set it to true"],
        ),
        ({"fsdp_config": {"fsdp_wrap_everything": 1}}, ["unknown key 'fsdp_config.fsdp_wrap"]),
        (
            {"deepspeed_config": {"deepspeed_multinode_launcher": "pdsh"}},
            ["deepspeed_config.deepspeed_multinode_launcher: 'pdsh'", "standard"],
        ),
        (
            {"deepspeed_config": {"zero3_init_flag": True}},
            ["deepspeed_config.zero3_init_flag: True", "set it false"],
        ),
        (
            {"deepspeed_config": {"offload_param_nvme_path": "/nvme"}},
            ["offload_param_nvme_path", "deepspeed_config_file"],
        ),
    ],
)
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_what_nbaccel_cannot_honour_is_an_error_naming_key_file_and_fix(
    tmp_path, change, fragments, suffix
):
    path = _write(tmp_path / f"accel{suffix}", {**MULTI_CPU, **change})
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"Accelerate config file {path}" in message
    for fragment in fragments:
        assert fragment in message


def test_an_accelerate_file_without_distributed_type_says_so(tmp_path):
    path = _write(tmp_path / "accel.yaml", {"compute_environment": "LOCAL_MACHINE"})
    with pytest.raises(ConfigError, match="has no distributed_type"):
        load_config(path)


def test_nbaccel_launch_alone_falls_back_to_accelerates_default_file(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert config_file_to_read(None, env) is None  # neither file: the defaults
    peer = _write(tmp_path / "xdg" / "huggingface" / "accelerate" / "default_config.yaml", {})
    assert config_file_to_read(None, env) == str(peer)
    hf_peer = _write(tmp_path / "hf" / "accelerate" / "default_config.yaml", MULTI_CPU)
    env["HF_HOME"] = str(tmp_path / "hf")  # HF_HOME comes first, as in Accelerate
    assert config_file_to_read(None, env) == str(hf_peer)
    # a notebook launch (the precedence rules themselves) never reads Accelerate's file
    assert resolve_launch_config(environ=env).num_processes is None
    # an nbaccel file anywhere wins: --config_file, NBACCEL_CONFIG_FILE, the default file
    assert config_file_to_read("mine.yaml", env) == "mine.yaml"
    assert config_file_to_read(None, {**env, "NBACCEL_CONFIG_FILE": "x.yaml"}) is None
    _write(tmp_path / "xdg" / "nbaccel" / "default_config.yaml", {"num_processes": 3})
    assert config_file_to_read(None, env) is None


def test_the_documented_table_is_the_code_table():
    text = PAGE.read_text(encoding="utf-8")
    table = text[text.index("| Accelerate key |") :]
    table = table.split("\n\n", 1)[0]  # the table may end the page
    listed = dict(re.findall(r"^\| `([a-z0-9_.]+)` \| (.*) \|$", table, flags=re.M))
    rules = {
        **ACCELERATE_KEYS,
        **{f"fsdp_config.{k}": r for k, r in FSDP_KEYS.items()},
        **{f"deepspeed_config.{k}": r for k, r in DEEPSPEED_KEYS.items()},
    }
    assert listed == {key: rule.becomes for key, rule in rules.items()}


SCRIPT = """
import json, sys
from nbaccel import Accelerator
accelerator = Accelerator()
sys.stdout.write("RESULT " + json.dumps({
    "rank": accelerator.process_index,
    "world": accelerator.num_processes,
    "device": accelerator.device.type,
    "steps": accelerator.gradient_accumulation_steps,
}) + "\\n")
sys.stdout.flush()
"""


@pytest.mark.integration
def test_nbaccel_launch_runs_the_accelerate_default_file_and_flags_win(tmp_path):
    """`accelerate config` wrote MULTI_CPU, 2 processes; no nbaccel file anywhere."""
    hf_home = tmp_path / "hf"
    peer = _write(
        hf_home / "accelerate" / "default_config.yaml",
        {**MULTI_CPU, "gradient_accumulation_steps": 4},
    )
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBACCEL_", "HF_"))}
    env.update(HF_HOME=str(hf_home), XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    out = subprocess.run(
        [sys.executable, "-m", "nbaccel", "launch", "--gradient_accumulation_steps", "2", str(script)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"reading Accelerate's config file {peer}" in out.stderr
    rows = sorted(
        (json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")),
        key=lambda r: r["rank"],
    )
    assert rows == [
        {"rank": rank, "world": 2, "device": "cpu", "steps": 2}  # the flag beats the file's 4
        for rank in (0, 1)
    ]


def test_nbaccel_config_never_overwrites_an_accelerate_file(tmp_path):
    path = _write(tmp_path / "accel.yaml", MULTI_CPU)
    before = path.read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBACCEL_")}
    env.update(NBACCEL_CONFIG_FILE=str(path), XDG_CACHE_HOME=str(tmp_path / "cache"))
    for extra in (["--default", "--force"], []):
        out = subprocess.run(
            [sys.executable, "-m", "nbaccel", "config", *extra],
            env=env, input="\n" * 20, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"{path} is Accelerate's config file" in out.stderr
        assert path.read_text() == before
