"""A script written for Accelerate's DeepSpeed integration, ported by the import only, run by
``nbaccel launch --num_processes 2`` on CPU: a DeepSpeed JSON config with ``"auto"`` values,
its own optimizer and scheduler (``DummyOptim``/``DummyScheduler``), ZeRO-3."""

from __future__ import annotations

import importlib.util
import json

import pytest
from test_real_scripts import UNDER_ACCELERATE, launch, read

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="deepspeed is not installed (pip install --no-build-isolation deepspeed; setup.sh does)",
    ),
    # Accelerate turns DeepSpeed off on CPU (ACCELERATE_USE_CPU: state.deepspeed_plugin is
    # None), so this script has no CPU run under Accelerate to compare with
    pytest.mark.skipif(UNDER_ACCELERATE, reason="Accelerate runs DeepSpeed on GPUs only"),
]

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    # torch's AdamW: DeepSpeed's fused/CPU Adam would compile C++ first
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {"stage": "auto", "stage3_gather_16bit_weights_on_model_save": True},
}


@pytest.mark.timeout(300)
def test_accelerate_deepspeed_config_script_trains_resumes_and_exports(tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(DS_CONFIG))
    launch(
        "deepspeed_config.py",
        "--deepspeed_config",
        str(config),
        "--out",
        str(tmp_path),
        tmp_path=tmp_path,
    )
    r = read(tmp_path / "result.json")
    assert r["distributed_type"] == "DistributedType.DEEPSPEED" and r["num_processes"] == 2
    assert r["zero_stage"] == 3 and r["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    # "auto": micro-batch 4 x accumulation 2 x 2 processes; 16 steps / 2 processes
    assert r["train_batch_size"] == 16 and r["total_num_steps"] == 8
    # the engine stepped its WarmupDecayLR 8 times: lr = 0.01 * (8 - 7) / (8 - 2)
    assert r["step"] == 8 and r["lr"] == pytest.approx(0.01 / 6)
    assert r["losses"][1] < r["losses"][0] and r["eval_seen"] == 37
    assert r["resumed_exactly"] and r["unwrapped"] == "Sequential"
    assert r["weights"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    if not UNDER_ACCELERATE:  # nbaccel's durable directory around DeepSpeed's files
        assert {"nbaccel_checkpoint.json", "pytorch_model", "rank_0.pt"} <= set(r["checkpoint"])
    assert r["exported"] == ["model.safetensors"]
