"""Fixtures shared by the whole suite.

Autouse fixtures restore the environment and working directory, destroy any
process group a test left behind, and fail a test that leaks child processes.
"""

from __future__ import annotations

import contextlib
import os
import time

import psutil
import pytest


def _children() -> dict[int, str]:
    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            out[child.pid] = " ".join(child.cmdline()[:4])
        except psutil.Error:
            continue
    return out


@pytest.fixture(autouse=True)
def _restore_process_state():
    env = dict(os.environ)
    cwd = os.getcwd()
    before = set(_children())
    yield
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    try:
        import sys

        if "torch.distributed" in sys.modules:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    except Exception:
        pass
    # Workers get a short grace period to exit; anything still alive is a leak.
    deadline = time.monotonic() + 5
    leaked = {}
    while time.monotonic() < deadline:
        leaked = {pid: cmd for pid, cmd in _children().items() if pid not in before}
        if not leaked:
            break
        time.sleep(0.1)
    if leaked:
        for pid in leaked:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        pytest.fail(f"test left child processes running: {leaked}")


# Markers whose tests must really run in the full suite: a skip there (a missing browser,
# .xla-venv, kernel) would hide that the capability is untested, so it fails instead.
_REQUIRED_MARKERS = ("browser", "xla", "kernel", "integration")


# GPU tests (tests/gpu) are skipped on machines without CUDA, which is every CI and dev
# machine, so NBACCEL_REQUIRE_ALL leaves them alone. scripts/gpu_check.sh sets
# NBACCEL_REQUIRE_GPU=1 instead: on the GPU machine a skipped GPU test fails, unless its
# reason says the machine lacks the hardware (tests/gpu/conftest.py: "[hardware] ...").
_HARDWARE_SKIP = "[hardware] "


def _skip_reason(report) -> str:
    return str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped:
        return
    if item.get_closest_marker("gpu") is not None:
        reason = _skip_reason(report)
        if os.environ.get("NBACCEL_REQUIRE_GPU") == "1" and _HARDWARE_SKIP not in reason:
            report.outcome = "failed"
            report.longrepr = (
                f"NBACCEL_REQUIRE_GPU=1 and this gpu test was skipped: {reason}. On the GPU "
                "machine every GPU test must run (scripts/gpu_check.sh installs what they need)."
            )
        return
    if os.environ.get("NBACCEL_REQUIRE_ALL") != "1":
        return
    required = [m for m in _REQUIRED_MARKERS if item.get_closest_marker(m) is not None]
    if required:
        report.outcome = "failed"
        reason = _skip_reason(report)
        report.longrepr = (
            f"NBACCEL_REQUIRE_ALL=1 and this {'/'.join(required)} test was skipped: {reason}. "
            "Run scripts/setup_browser.sh and scripts/setup_xla.sh (scripts/test.sh does)."
        )
