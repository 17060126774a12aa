"""The GPU benchmark's driver still runs: bench/gpu.py --smoke (tiny model, CPU, gloo).

Not a measurement; it keeps bench/gpu.py working on machines without a GPU, so that
the one run on a GPU machine (scripts/gpu_check.sh) does not fail on a typo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.kernel
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_gpu_bench_smoke_run_writes_every_row(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--out", str(tmp_path)]
    env = {**os.environ, "NBACCEL_COMMIT": "smoke-commit"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert result["errors"] == [], result["errors"]
    for key in ("raw", "raw-ddp", "nbaccel"):
        (sample,) = result["samples"][f"step-bf16/{key}"]
        assert 0 < sample["step_s"] < 10 and len(sample["windows_s"]) == 2, sample
    assert len(result["samples"]["step-no/nbaccel"]) == 1
    for key in ("launch/raw", "launch/nbaccel", "spawn/raw-spawn", "spawn/nbaccel-spawn"):
        (seconds,) = result["samples"][key]
        assert 0 < seconds < 120
    for key in ("forkserver/clean-fork", "forkserver/server"):  # issue 43: stand-in driver
        (seconds,) = result["samples"][key]
        assert 0 < seconds < 120
    assert result["forkserver"]["workers_from_server"] is True, result["forkserver"]
    for key in ("pool/fork", "pool/spawn"):
        (seconds,) = result["samples"][key]
        assert 0 < seconds < 60
    assert result["machine"]["commit"] == "smoke-commit", result["machine"]  # NBACCEL_COMMIT
    table = (tmp_path / "gpu_bench.md").read_text()
    assert "smoke run on the CPU" in table and "n/a (smoke)" in table
    assert "| bf16 throughput vs hand-written DDP (1 GPU) |" in table
    assert "fp8 (torchao) speed-up over bf16 | not run: smoke run on the CPU" in table
    assert "| Spawn launch with CUDA init vs hand-written torch.multiprocessing spawn |" in table
    assert "| Warm pool call (CUDA tensor, synced), pool started with spawn vs fork |" in table
    assert (
        "| Launch after the kernel touched CUDA (fork server) vs a clean kernel's fork |" in table
    )
