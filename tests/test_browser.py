"""The LaunchPanel in a real browser: JupyterLab on localhost, driven in headless Chromium.

Serves JupyterLab (random free port, token, tmp root dir) with a notebook whose
cell shows a LaunchPanel, opens it in Debian's /usr/bin/chromium through
Playwright (never a Playwright-downloaded browser), runs the cell, changes the
number of processes, clicks Launch, waits for both ranks' output and rank 0's
progress bar under the cell,
saves a screenshot to test-artifacts/, then stops the server and checks that no
process (server, kernel, workers) is left.

Needs ``bash scripts/setup_browser.sh``; skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from nbaccel.testing import find_free_port

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

PANEL_CELL = """\
from nbaccel.widgets import LaunchPanel

def train(greeting):
    import time
    from nbaccel import Accelerator, tqdm
    accelerator = Accelerator()
    for _ in tqdm(range(20), desc="steps"):
        time.sleep(0.02)
    print(f"{greeting} from rank {accelerator.process_index} of {accelerator.num_processes}")
    return accelerator.process_index

panel = LaunchPanel(train, args=("hello",))
panel
"""


def _require_browser() -> None:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing: run `bash scripts/setup_browser.sh` (Debian chromium)")
    if importlib.util.find_spec("playwright") is None:
        pytest.skip("playwright is not installed: run `bash scripts/setup_browser.sh`")
    if importlib.util.find_spec("jupyterlab") is None:
        pytest.skip("jupyterlab>=4 is not installed: run `bash scripts/setup_browser.sh`")


def _write_notebook(path: Path) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.cells.append(nbformat.v4.new_code_cell(PANEL_CELL))
    nbformat.write(nb, path)


def _get(url: str, token: str, method: str = "GET", timeout: float = 5) -> int:
    request = urllib.request.Request(
        url,
        method=method,
        headers={"Authorization": f"token {token}"},
        data=b"" if method == "POST" else None,
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return int(response.status)


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server in tmp_path; yields (base_url, token, server process)."""
    _require_browser()
    root = tmp_path / "root"
    root.mkdir()
    _write_notebook(root / "panel.ipynb")
    config_dir = tmp_path / "jupyter-config"
    (config_dir / "labconfig").mkdir(parents=True)
    # No "get Jupyter news?" toast over the notebook.
    (config_dir / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    nbaccel_config = tmp_path / "nbaccel.yaml"
    nbaccel_config.write_text("config_version: 1\ncompute_device: cpu\nnum_processes: 1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBACCEL_", "JUPYTER"))}
    env.update(
        NBACCEL_CONFIG_FILE=str(nbaccel_config),
        JUPYTER_CONFIG_DIR=str(config_dir),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "jupyter-runtime"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "jupyter-workspaces"),
        JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "jupyter-settings"),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
    )
    port, token = find_free_port(), secrets.token_hex(16)
    log = (tmp_path / "lab.log").open("w")
    server = subprocess.Popen(
        [
            sys.executable, "-m", "jupyter", "lab", "--no-browser",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if _get(f"{base}/api/status", token) == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not start:\n{(tmp_path / 'lab.log').read_text()}")
            time.sleep(0.3)
        yield base, token, server
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        log.close()


def _stop_server(base: str, token: str, server: subprocess.Popen) -> None:
    """Shut JupyterLab down the polite way (it stops its kernels), then wait for it."""
    try:
        _get(f"{base}/api/shutdown", token, method="POST")
    except OSError:
        server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(10)
        pytest.fail("JupyterLab did not exit within 30 s of /api/shutdown")


def test_launch_panel_in_jupyterlab(lab, tmp_path):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import expect, sync_playwright

    base, token, server = lab
    ARTIFACTS.mkdir(exist_ok=True)
    started = time.monotonic()
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            user_data_dir=str(tmp_path / "chromium-profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1200, "height": 1100},
        )
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.goto(f"{base}/lab/tree/panel.ipynb?token={token}")
            page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=90_000)
            # "Select Kernel" appears only when the notebook's kernel is unknown
            with contextlib.suppress(PlaywrightTimeout):
                page.locator(".jp-Dialog .jp-mod-accept").click(timeout=5_000)
            idle = page.locator(
                '.jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status="idle"]'
            )
            idle.first.wait_for(timeout=90_000)

            page.locator(".jp-Cell .jp-InputArea-editor").first.click()
            page.keyboard.press("Shift+Enter")
            panel = page.locator(".nbaccel-launch-panel")
            panel.wait_for(timeout=90_000)
            expect(panel).to_contain_text("Hardware:")

            processes = panel.locator(".widget-inline-hbox", has_text="num processes").locator(
                "input"
            )
            expect(processes).to_have_value("1")
            processes.fill("2")
            processes.press("Enter")
            launch = panel.get_by_role("button", name="Launch")
            expect(launch).to_be_enabled()
            launch.click()

            output = panel.locator(".widget-output")
            expect(output).to_contain_text("[rank0] hello from rank 0 of 2", timeout=120_000)
            expect(output).to_contain_text("[rank1] hello from rank 1 of 2", timeout=30_000)
            expect(output).to_contain_text("steps: 100%")  # rank 0 draws the progress bar
            expect(panel).to_contain_text("Finished", timeout=30_000)
            panel.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "launch_panel_jupyterlab.png"), full_page=True)
            panel.screenshot(path=str(ARTIFACTS / "launch_panel.png"))
        finally:
            context.close()

    # Everything the server started (kernel; the workers are gone already) must go with it.
    descendants = psutil.Process(server.pid).children(recursive=True)
    _stop_server(base, token, server)
    leftovers = []
    for proc in descendants:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                leftovers.append(f"{proc.pid} {' '.join(proc.cmdline()[:4])}")
        except psutil.NoSuchProcess:
            pass
    assert not leftovers, f"processes left after JupyterLab stopped: {leftovers}"
    assert server.returncode is not None
    print(f"browser test body took {time.monotonic() - started:.1f}s")
