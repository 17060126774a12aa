"""What GPUs this machine has, probed once in a subprocess (the pytest process never loads
the CUDA driver, so a fork from it stays safe). Shared by tests/gpu's conftest and tests."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from typing import Any

import pytest

HARDWARE = "[hardware] "

_PROBE = """
import json, torch
count = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(json.dumps({
    "count": count,
    "names": [torch.cuda.get_device_name(i) for i in range(count)],
    "capability": [list(torch.cuda.get_device_capability(i)) for i in range(count)],
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
}))
"""


@functools.cache
def cuda_facts() -> dict[str, Any]:
    """``count``, ``names``, ``capability``, ``torch``, ``cuda`` (or ``error``), probed once."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.SubprocessError) as err:
        return {"count": 0, "error": f"probe failed: {type(err).__name__}: {err}"}
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:  # no torch, a broken driver: say so in the skip
        return {"count": 0, "error": f"probe exited {out.returncode}: {out.stderr[-300:]}"}
    return dict(json.loads(lines[-1]))


def gpu_count() -> int:
    """Visible CUDA GPUs (0 where there are none or the probe failed)."""
    return int(cuda_facts()["count"])


def skip_for_hardware(reason: str) -> None:
    """Skip because this machine lacks the hardware (allowed under NBACCEL_REQUIRE_GPU=1)."""
    pytest.skip(HARDWARE + reason)
