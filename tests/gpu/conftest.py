"""GPU tests: every test here is marked ``gpu`` and needs a CUDA device.

Where no CUDA device is visible the tests are skipped with the reason (a CPU
machine, CI). ``scripts/gpu_check.sh`` runs them on a GPU machine with
``NBACCEL_REQUIRE_GPU=1``: there a skipped GPU test fails the run (see
``tests/conftest.py``), except a skip whose reason starts with
``gpu_facts.HARDWARE``, which says the test needs hardware this machine does not
have (a second GPU, a Hopper-class GPU for fp8).

The GPU facts are read once in a subprocess, so the pytest process itself never
loads the CUDA driver (a fork from it stays safe).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_facts import cuda_facts

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before ``-m gpu`` selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if HERE in Path(str(item.fspath)).resolve().parents]
    if not ours:
        return
    facts = cuda_facts()
    skip = None
    if not facts.get("count"):
        why = facts.get("error") or f"torch {facts.get('torch')} sees no CUDA device"
        skip = pytest.mark.skip(
            reason=f"needs a CUDA GPU ({why}); run scripts/gpu_check.sh on a GPU machine"
        )
    for item in ours:
        item.add_marker(pytest.mark.gpu)
        if skip is not None:
            item.add_marker(skip)
