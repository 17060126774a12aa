"""Issue 35 in JupyterLab 4 (ipywidgets 8), headless Chromium: what a notebook user sees.

One Jupyter server, one page, one notebook (tests/browser_scenario.py: the cells and
the checks, shared with the Notebook 6.5 / ipywidgets 7 run in tests/stacks/): a failed
background run speaks in its cell with and without ``watch`` (items 1, 5), a re-run
launching cell is refused naming its run (2), one titled chart set per run and one
monitor, also for a watched pool, failed and stopped runs drawn so (3), rank 0's tqdm
bar once and never red, in the panel and a pool call's cell too (6),
the panel's starting size, return value, Stop button and the launcher's oversubscription
warning (7). Item 4 (save and reload) is tests/ui/test_browser.py's.

Needs ``bash scripts/setup_browser.sh``; skipped with the reason otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import psutil
import pytest
from browser_scenario import (
    CHROMIUM,
    LAB,
    LONG,
    NOTEBOOK,
    open_chromium,
    run_scenario,
    write_notebook,
)
from jupyter_server import get, jupyter_lab

from nbaccel.platform.environment import cpu_count

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def _kernel_idle(base: str, token: str) -> bool:
    kernels = json.loads(get(f"{base}/api/kernels", token))
    return any(kernel.get("execution_state") == "idle" for kernel in kernels)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab in a tmp root holding the scenario's notebook: (base, token, server, root)."""
    for what, ok in (
        (f"{CHROMIUM} (Debian chromium)", os.access(CHROMIUM, os.X_OK)),
        ("playwright", importlib.util.find_spec("playwright") is not None),
        ("jupyterlab>=4", importlib.util.find_spec("jupyterlab") is not None),
    ):
        if not ok:
            pytest.skip(f"{what} is missing: run `bash scripts/setup_browser.sh`")
    tmp = tmp_path_factory.mktemp("lab-user")
    root = tmp / "root"
    root.mkdir()
    write_notebook(root)
    yaml = "config_version: 1\ncompute_device: cpu\n"  # no num_processes: the panel picks
    with jupyter_lab(tmp, root, nbaccel_yaml=yaml, every_cell_in_dom=True) as server:
        yield (*server, root)


def test_what_a_notebook_user_sees_in_jupyterlab(lab, tmp_path):
    from playwright.sync_api import sync_playwright

    base, token, server, root = lab
    ARTIFACTS.mkdir(exist_ok=True)
    timings: dict[str, float] = {}
    descendants: list[psutil.Process] = []
    try:
        with sync_playwright() as pw:
            context, page = open_chromium(pw, tmp_path / "chromium-profile")
            try:
                page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}")
                page.locator(LAB.cell).first.wait_for(timeout=LONG)
                deadline = time.monotonic() + LONG / 1000
                dialog = page.locator(".jp-Dialog .jp-mod-accept")  # "Select Kernel", if asked
                while not _kernel_idle(base, token):
                    if dialog.count() and dialog.first.is_visible():
                        dialog.first.click()
                    assert time.monotonic() < deadline, "the kernel was not idle (hang guard)"
                    page.wait_for_timeout(200)
                try:
                    run_scenario(page, LAB, root, cpu_count(), timings)
                finally:
                    page.screenshot(path=str(ARTIFACTS / "user_jupyterlab.png"), full_page=True)
            finally:
                context.close()
    finally:  # the server stops its kernel (and the kernel its workers) whatever happened
        descendants = psutil.Process(server.pid).children(recursive=True)
        get(f"{base}/api/shutdown", token, method="POST")
        server.wait(180)
    alive = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left after the server stopped: {[p.pid for p in alive]}"
    start = timings.pop("start")
    print({what: round(at - start, 1) for what, at in timings.items()})
