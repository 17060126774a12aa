"""``nbaccel launch`` and the hang watchdog: the report on the terminal (stderr) while the
job runs, which then completes; ``--debug_collectives`` prints torch's mismatch error.
The rules and the notebook side are in tests/launch/test_hang_watchdog.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPORTED = "waiting in torch.distributed.all_reduce"

SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
from nbaccel import Accelerator

accelerator = Accelerator(cpu=True)
value = torch.ones(2)
if sys.argv[1] == "mismatch":
    dist.all_reduce(value) if accelerator.process_index == 0 else dist.broadcast(value, 0)
if accelerator.process_index == 1:
    while not os.path.exists(sys.argv[1]): time.sleep(0.05)
dist.all_reduce(value)
print("total", value.sum().item(), flush=True)
"""


def _nbaccel_launch(tmp_path: Path, *args: str) -> subprocess.Popen:
    script = tmp_path / "hang.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBACCEL_")}
    env.update(NBACCEL_CONFIG_FILE=str(tmp_path / "none.yaml"), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu"]
    return subprocess.Popen(
        [*command, *args[:-1], str(script), args[-1]], env=env, cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.timeout(240)
def test_nbaccel_launch_reports_on_the_terminal_and_goes_on(tmp_path):
    flag = tmp_path / "go"
    proc = _nbaccel_launch(tmp_path, "--hang_after", "2", str(flag))
    err: list[str] = []
    try:
        assert proc.stderr is not None and proc.stdout is not None
        for line in proc.stderr:  # the report arrives while the job runs
            err.append(line)
            if REPORTED in line:
                flag.touch()
        out = proc.stdout.read()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(err)
    assert proc.returncode == 0 and out.count("total 4.0") == 2, out + text
    assert "rank 1: not in a torch.distributed call" in text and "hang.py" in text, text


@pytest.mark.timeout(240)
def test_nbaccel_launch_debug_collectives_prints_torchs_mismatch_error(tmp_path):
    proc = _nbaccel_launch(tmp_path, "--debug_collectives", "mismatch")
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out + err
    assert "Detected mismatch between collectives" in err and "BROADCAST" in err, err


def test_nbaccel_launch_on_hang_raise_exits_1_with_every_stack(tmp_path):
    proc = _nbaccel_launch(tmp_path, "--hang_after", "2", "--on_hang", "raise", "never")
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out + err
    assert "nbaccel launch: rank(s) 0, 1 appear stuck" in err and REPORTED in err, err
    assert "--- where rank 1 was ---" in err and "hang.py" in err, err
