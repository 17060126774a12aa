"""The benchmark's driver still runs: bench/run.py, launch scenario, raw vs nbaccel.

Not a benchmark (3 warm launches, no peers, no cold kernels); it only keeps
bench/ from rotting. The full run is ``.venv/bin/python bench/run.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.kernel
@pytest.mark.integration
def test_bench_quick_launch_scenario(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--only", "launch"]
    cmd += ["--no-cold", "--systems", "raw,nbaccel", "--python", sys.executable]
    cmd += ["--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "latest.json").read_text())
    for system in ("raw", "nbaccel"):
        samples = result["samples"][f"warm/{system}"]
        assert len(samples) == 3 and all(0 < s < 60 for s in samples)
    table = (tmp_path / "latest.md").read_text()
    assert "| Warm launch latency |" in table and "torch 2." in table
