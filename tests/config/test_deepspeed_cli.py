"""The command line offers DeepSpeed as it offers FSDP: ``nbaccel config`` flags and
questionnaire (the ``deepspeed_*`` questions only after choosing it) and ``nbaccel launch``
flags, all derived from the LaunchConfig fields. Real ``nbaccel`` subprocesses; the config
file lives in tmp_path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nbaccel.config import LaunchConfig, load_config

NBACCEL = [sys.executable, "-m", "nbaccel"]


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBACCEL_")}
    env.update(
        NBACCEL_CONFIG_FILE=str(tmp_path / "default_config.yaml"),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        PYTHONUNBUFFERED="1",
    )
    return env


def test_launch_flags_offer_deepspeed(cli_env, tmp_path):
    script = tmp_path / "show.py"
    script.write_text(
        "from nbaccel.config import launch_config\n"
        "cfg = launch_config()\n"
        "print('SEEN', cfg.strategy, cfg.deepspeed_zero_stage, cfg.deepspeed_offload_param_device)\n"
    )
    out = subprocess.run(
        [*NBACCEL, "launch", "--num_processes", "1", "--compute_device", "cpu",
         "--strategy", "deepspeed", "--deepspeed_zero_stage", "3",
         "--deepspeed_offload_param_device", "cpu", str(script)],
        env=cli_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "SEEN deepspeed 3 cpu" in out.stdout  # what the worker's Accelerator() would read
    help_text = subprocess.run(
        [*NBACCEL, "launch", "--help"], env=cli_env, capture_output=True, text=True, timeout=120
    ).stdout
    assert "{ddp,fsdp,deepspeed}" in help_text
    assert "--deepspeed_offload_optimizer_device {none,cpu,nvme}" in help_text


def test_questionnaire_asks_the_deepspeed_options_only_after_choosing_it(cli_env):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        NBACCEL[0], [*NBACCEL[1:], "config"], env=cli_env, encoding="utf-8", timeout=60
    )
    try:
        child.expect(r"compute_device \[")
        child.expect("default .*: ")
        child.sendline("cpu")
        while True:  # Enter keeps every default up to the strategy
            child.expect(r"(\w+) \[")
            field = child.match.group(1)
            child.expect("default .*: ")
            if field == "strategy":
                child.sendline("deepspeed")
                break
            child.sendline("")
        asked = []
        answers = {"deepspeed_zero_stage": "5", "deepspeed_offload_optimizer_device": "cpu"}
        while True:
            index = child.expect([r"(\w+) \[", "invalid: ", "Configuration saved to"])
            if index == 2:
                break
            if index == 1:  # stage 5 was refused: answer again
                child.expect("default .*: ")
                child.sendline("1")
                continue
            field = child.match.group(1)
            asked.append(field)
            child.expect("default .*: ")
            child.sendline(answers.get(field, ""))
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert asked == [
        "deepspeed_zero_stage",
        "deepspeed_offload_optimizer_device",
        "deepspeed_offload_param_device",
        "deepspeed_gradient_clipping",
        "deepspeed_config_file",
    ]
    cfg = load_config(cli_env["NBACCEL_CONFIG_FILE"])
    assert cfg == LaunchConfig(
        compute_device="cpu",
        num_processes=cfg.num_processes,
        strategy="deepspeed",
        deepspeed_zero_stage=1,
        deepspeed_offload_optimizer_device="cpu",
    )
