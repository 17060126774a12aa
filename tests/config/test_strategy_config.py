"""``strategy`` and the ``fsdp_*``/``deepspeed_*`` fields of LaunchConfig: validation, environment, YAML
and what the workers receive."""

from __future__ import annotations

import pytest

from nbaccel.config import (
    ENV_VARS,
    STRATEGIES,
    LaunchConfig,
    field_help,
    load_config,
    resolve_launch_config,
    save_config,
    strategy_environment,
    strategy_fields,
)
from nbaccel.errors import ConfigError


def test_strategy_defaults_to_ddp_and_every_strategy_field_has_help():
    cfg = LaunchConfig()
    assert cfg.strategy == "ddp" and STRATEGIES == ("ddp", "fsdp", "deepspeed")
    assert strategy_fields()[0] == "strategy" and len(strategy_fields()) == 14
    assert all(field_help()[name] for name in strategy_fields())
    assert {"NBACCEL_STRATEGY", "NBACCEL_FSDP_AUTO_WRAP_POLICY"} <= set(ENV_VARS)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"strategy": "megatron"}, "strategy='megatron' is unknown"),
        ({"deepspeed_zero_stage": 4}, "deepspeed_zero_stage=4 is unknown; use 0, 1, 2 or 3"),
        ({"deepspeed_zero_stage": True}, "deepspeed_zero_stage=True"),
        ({"deepspeed_offload_optimizer_device": "gpu"}, "deepspeed_offload_optimizer_device="),
        ({"deepspeed_offload_param_device": "cpu"}, "needs deepspeed_zero_stage=3"),
        ({"deepspeed_gradient_clipping": -1}, "deepspeed_gradient_clipping=-1 must be"),
        ({"fsdp_auto_wrap_policy": "layer_wrap"}, "fsdp_auto_wrap_policy='layer_wrap'"),
        ({"fsdp_state_dict_type": "LOCAL_STATE_DICT"}, "fsdp_state_dict_type="),
        ({"fsdp_min_num_params": -1}, "fsdp_min_num_params=-1"),
        ({"fsdp_cpu_offload": "yes"}, "fsdp_cpu_offload='yes' must be True or False"),
        ({"fsdp_transformer_cls_names_to_wrap": 3}, "fsdp_transformer_cls_names_to_wrap=3"),
    ],
)
def test_invalid_strategy_values_name_the_field(changes, fragment):
    with pytest.raises(ConfigError, match=fragment):
        LaunchConfig(**changes)


def test_state_dict_type_is_case_insensitive_with_one_canonical_spelling():
    assert LaunchConfig(fsdp_state_dict_type="full_state_dict").fsdp_state_dict_type == (
        "FULL_STATE_DICT"
    )
    env = {"NBACCEL_STRATEGY": "FSDP", "NBACCEL_FSDP_STATE_DICT_TYPE": "sharded_state_dict"}
    cfg = resolve_launch_config(environ=env, config_file=False)
    assert (cfg.strategy, cfg.fsdp_state_dict_type) == ("fsdp", "SHARDED_STATE_DICT")


def test_worker_environment_round_trips_through_resolve():
    cfg = LaunchConfig(
        strategy="fsdp",
        fsdp_auto_wrap_policy="size_based_wrap",
        fsdp_min_num_params=1234,
        fsdp_transformer_cls_names_to_wrap=None,
        fsdp_cpu_offload=True,
        fsdp_state_dict_type="FULL_STATE_DICT",
    )
    env = strategy_environment(cfg)
    back = resolve_launch_config(environ=env, config_file=False)
    assert {n: getattr(back, n) for n in strategy_fields()} == {
        n: getattr(cfg, n) for n in strategy_fields()
    }
    deepspeed = LaunchConfig(
        strategy="deepspeed",
        deepspeed_zero_stage=3,
        deepspeed_offload_param_device="cpu",  # "none" is a choice here, not a null
        deepspeed_gradient_clipping=0.5,
    )
    back = resolve_launch_config(environ=strategy_environment(deepspeed), config_file=False)
    assert back == deepspeed and back.deepspeed_offload_optimizer_device == "none"
    # ddp is said explicitly, so a kernel's own NBACCEL_STRATEGY=fsdp cannot leak in
    assert strategy_environment(LaunchConfig()) == {"NBACCEL_STRATEGY": "ddp"}


def test_launch_plan_passes_the_strategy_to_the_workers():
    from nbaccel.launch.testing import plan_for as plan_launch

    config = LaunchConfig(strategy="fsdp", fsdp_cpu_offload=True)
    plan = plan_launch(print, num_processes=2, start_method="fork", config=config)
    # the typed object every worker installs; no NBACCEL_* text in the workers' environment
    assert plan.config.strategy == "fsdp" and plan.config.fsdp_cpu_offload is True
    assert not any(key.startswith("NBACCEL_") for key in plan.env)


def test_yaml_round_trip_of_the_strategy(tmp_path):
    cfg = LaunchConfig(
        strategy="fsdp",
        fsdp_transformer_cls_names_to_wrap="Block,Head",
        fsdp_activation_checkpointing=True,
    )
    path = save_config(cfg, tmp_path / "c.yaml")
    assert "strategy: fsdp" in path.read_text()
    assert load_config(path) == cfg


def test_yaml_round_trip_of_deepspeed_options(tmp_path):
    cfg = LaunchConfig(
        strategy="deepspeed",
        deepspeed_zero_stage=2,
        deepspeed_offload_optimizer_device="cpu",
        deepspeed_config_file="ds_config.json",
    )
    path = save_config(cfg, tmp_path / "c.yaml")
    text = path.read_text()
    assert "deepspeed_offload_optimizer_device: cpu" in text
    assert "deepspeed_offload_param_device: none" in text
    assert load_config(path) == cfg
