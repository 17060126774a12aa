"""The LaunchPanel in a real browser: JupyterLab and Notebook 7 on localhost, headless Chromium.

Serves Jupyter (random free port, token, tmp root dir) with a notebook whose
cell shows a LaunchPanel, opens it in Debian's /usr/bin/chromium through
Playwright (never a Playwright-downloaded browser), runs the cell, changes the
number of processes, clicks Launch, waits for both ranks' output and rank 0's
progress bar under the cell,
saves a screenshot to test-artifacts/, then stops the server and checks that no
process (server, kernel, workers) is left.

The same scenario runs in both faces of the ipywidgets 8 front-end that one
jupyter_server serves: JupyterLab (/lab/tree/<nb>) and the classic Notebook UI,
Jupyter Notebook 7 (/notebooks/<nb>).

Needs ``bash scripts/setup_browser.sh``; skipped with the reason otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest

from nbaccel.launch.testing import find_free_port

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
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


class UI(NamedTuple):
    path: str  # where the notebook opens, relative to the server
    module: str  # the Python package that serves this UI
    page_png: str  # full-page screenshot under test-artifacts/
    panel_png: str  # the panel alone


UIS = {
    "jupyterlab": UI("/lab/tree/panel.ipynb", "jupyterlab", "launch_panel_jupyterlab.png",
                     "launch_panel.png"),
    "notebook7": UI("/notebooks/panel.ipynb", "notebook", "notebook7-panel.png",
                    "notebook7-panel-widget.png"),
}  # fmt: skip

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


def _require_browser(ui: str) -> None:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing: run `bash scripts/setup_browser.sh` (Debian chromium)")
    if importlib.util.find_spec("playwright") is None:
        pytest.skip("playwright is not installed: run `bash scripts/setup_browser.sh`")
    if importlib.util.find_spec("jupyterlab") is None:
        pytest.skip("jupyterlab>=4 is not installed: run `bash scripts/setup_browser.sh`")
    if importlib.util.find_spec(UIS[ui].module) is None:
        pytest.skip(f"{UIS[ui].module} is not installed: run `bash scripts/setup_browser.sh`")


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


def _idle_kernels(base: str, token: str) -> int:
    request = urllib.request.Request(
        f"{base}/api/kernels", headers={"Authorization": f"token {token}"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        kernels = json.load(response)
    return sum(kernel.get("execution_state") == "idle" for kernel in kernels)


def _wait_for_idle_kernel(page, base: str, token: str, timeout: float = 90) -> None:
    """Wait until the notebook's kernel runs and is idle, accepting "Select Kernel" if asked.

    The dialog appears only when the notebook's kernel is unknown, and the page may show an
    idle status before it does; a kernel exists on the server only once one is chosen.
    """
    dialog = page.locator(".jp-Dialog .jp-mod-accept")
    idle = page.locator('.jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status="idle"]')
    deadline = time.monotonic() + timeout
    while True:
        if dialog.count() and dialog.first.is_visible():
            dialog.first.click()
        elif idle.count() and _idle_kernels(base, token):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the notebook's kernel was not idle within {timeout:.0f} s")
        page.wait_for_timeout(200)


@pytest.fixture
def lab(tmp_path, ui):
    """A Jupyter server (JupyterLab and, when installed, Notebook 7) in tmp_path.

    Yields (base_url, token, server process); ``ui`` is the test's parameter.
    """
    _require_browser(ui)
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


@pytest.mark.parametrize("ui", list(UIS))
def test_launch_panel_in_browser(lab, tmp_path, ui):
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
            page.goto(f"{base}{UIS[ui].path}?token={token}")
            page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=90_000)
            _wait_for_idle_kernel(page, base, token)

            page.locator(".jp-Cell .jp-InputArea-editor").first.click()
            page.keyboard.press("Shift+Enter")
            panel = page.locator(".jp-OutputArea-output .nbaccel-launch-panel")
            panel.wait_for(timeout=90_000)
            # Rendered by the widget manager, not the kernel's text repr "LaunchPanel(train, {...})".
            expect(page.locator(".jp-OutputArea-output", has_text="LaunchPanel(")).to_have_count(0)
            expect(panel).to_contain_text("Hardware:")

            processes = panel.locator(".widget-inline-hbox", has_text="num processes").locator(
                "input"
            )
            expect(processes).to_have_value("1")
            processes.fill("2")
            processes.press("Enter")
            launch = panel.get_by_role("button", name="Launch")
            expect(launch).to_be_visible()
            expect(panel.get_by_role("button", name="Save as default")).to_be_visible()
            expect(launch).to_be_enabled()
            launch.click()

            output = panel.locator(".widget-output")
            expect(output).to_contain_text("[rank0] hello from rank 0 of 2", timeout=120_000)
            expect(output).to_contain_text("[rank1] hello from rank 1 of 2", timeout=30_000)
            expect(output).to_contain_text("steps: 100%")  # rank 0 draws the progress bar
            expect(panel).to_contain_text("Finished", timeout=30_000)
            panel.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / UIS[ui].page_png), full_page=True)
            panel.screenshot(path=str(ARTIFACTS / UIS[ui].panel_png))
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
    print(f"browser test body ({ui}) took {time.monotonic() - started:.1f}s")
