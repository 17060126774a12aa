"""The LaunchPanel on ipywidgets 7.7.1 in a real browser: the Colab-like stack's front end.

Colab draws widgets with its own front end, which cannot be installed here; the front end
for ipywidgets 7 that installs from PyPI is the classic Notebook 6.5 with
widgetsnbextension 3.6, which the Colab-like stack has (scripts/stacks.env). Its server,
kernel and workers run inside the stack's Debian root (Python 3.13, torch 2.11,
ipykernel 6.17.1); Debian's Chromium on this machine opens the notebook through
Playwright, runs the cell, sets 2 processes, clicks Launch and waits for both ranks'
output, rank 0's progress bar and "Finished" — the scenario tests/ui/test_browser.py runs
on ipywidgets 8 in JupyterLab 4 and Notebook 7.

Run by scripts/test_stacks.sh (NBACCEL_STACK=colab, NBACCEL_STACK_ROOT=the root).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from nbaccel.launch.testing import find_free_port

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
PANEL_CELL = """\
from nbaccel.widgets import LaunchPanel
import ipywidgets
print("ipywidgets", ipywidgets.__version__)

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


def _get(url: str, token: str, method: str = "GET") -> int:
    request = urllib.request.Request(
        url, method=method, headers={"Authorization": f"token {token}"},
        data=b"" if method == "POST" else None,
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=5) as response:
        return int(response.status)


@pytest.fixture
def notebook6():
    """The stack's classic Notebook server on 127.0.0.1 (inside the root, same network)."""
    if os.environ.get("NBACCEL_STACK") != "colab":
        pytest.skip("runs in the Colab-like stack: bash scripts/test_stacks.sh colab")
    if not os.access(CHROMIUM, os.X_OK) or importlib.util.find_spec("playwright") is None:
        pytest.skip("needs Debian's chromium and playwright: bash scripts/setup_browser.sh")
    stack_root = Path(os.environ["NBACCEL_STACK_ROOT"])
    inside = f"/tmp/nbaccel-widgets7-{secrets.token_hex(4)}"  # a folder in the root's /tmp
    work = stack_root / inside.lstrip("/")
    (work / "notebooks").mkdir(parents=True)
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.cells.append(nbformat.v4.new_code_cell(PANEL_CELL))
    nbformat.write(nb, work / "notebooks" / "panel.ipynb")
    (work / "nbaccel.yaml").write_text("config_version: 1\ncompute_device: cpu\nnum_processes: 1\n")
    port, token = find_free_port(), secrets.token_hex(16)
    log_path = ARTIFACTS / "widgets7-notebook6.log"
    ARTIFACTS.mkdir(exist_ok=True)
    log = log_path.open("w")
    server = subprocess.Popen(
        [
            "bash", str(ROOT / "scripts" / "stack_run.sh"), "colab",
            f"NBACCEL_CONFIG_FILE={inside}/nbaccel.yaml", f"JUPYTER_CONFIG_DIR={inside}/config",
            f"JUPYTER_RUNTIME_DIR={inside}/runtime", f"XDG_CACHE_HOME={inside}/cache",
            "python", "-m", "notebook", "--no-browser", "--allow-root",
            "--NotebookApp.ip=127.0.0.1", f"--NotebookApp.port={port}",
            "--NotebookApp.port_retries=0", f"--NotebookApp.token={token}",
            f"--NotebookApp.notebook_dir={inside}/notebooks",
        ],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
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
                pytest.fail(f"Notebook 6 did not start:\n{log_path.read_text()}")
            time.sleep(0.3)
        yield base, token, server
    finally:
        if server.poll() is None:  # a failed test: shut down politely (kernels too), then kill
            left = psutil.Process(server.pid).children(recursive=True)
            try:
                _get(f"{base}/api/shutdown", token, method="POST")
                server.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                pass
            for proc in [*left, psutil.Process(server.pid)]:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            server.wait(10)
        log.close()
        shutil.rmtree(work, ignore_errors=True)


def test_launch_panel_on_ipywidgets7_in_notebook6(notebook6, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    base, token, server = notebook6
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
            console: list[str] = []  # the front end's messages, saved if the panel is missing
            page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))
            page.goto(f"{base}/notebooks/panel.ipynb?token={token}")
            page.locator("#kernel_indicator_icon.kernel_idle_icon").wait_for(timeout=90_000)
            page.locator(".code_cell .CodeMirror").first.click()
            page.keyboard.press("Shift+Enter")
            panel = page.locator(".output_area .nbaccel-launch-panel")
            try:
                panel.wait_for(timeout=90_000)
            except Exception:
                page.screenshot(path=str(ARTIFACTS / "widgets7-notebook6-failed.png"))
                (ARTIFACTS / "widgets7-notebook6-failed.html").write_text(page.content())
                (ARTIFACTS / "widgets7-notebook6-console.txt").write_text("\n".join(console))
                raise
            expect(page.locator(".output_area", has_text="ipywidgets 7.7.1")).to_have_count(1)
            # Rendered by the widget manager, not the kernel's text repr "LaunchPanel(train, ...)".
            expect(page.locator(".output_area", has_text="LaunchPanel(")).to_have_count(0)
            expect(panel).to_contain_text("Hardware:")
            row = panel.locator(".widget-inline-hbox", has_text="num processes")
            processes = row.locator("input")
            expect(processes).to_have_value("1")
            processes.fill("2")
            processes.press("Enter")
            launch = panel.get_by_role("button", name="Launch")
            expect(launch).to_be_enabled()
            expect(panel.get_by_role("button", name="Save as default")).to_be_visible()
            launch.click()
            output = panel.locator(".jupyter-widgets-output-area")  # 7's Output (8: .widget-output)
            expect(output).to_contain_text("[rank0] hello from rank 0 of 2", timeout=120_000)
            expect(output).to_contain_text("[rank1] hello from rank 1 of 2", timeout=30_000)
            expect(output).to_contain_text("steps: 100%")
            expect(panel).to_contain_text("Finished", timeout=30_000)
            # the live per-rank table (the monitor's widget) shows both ranks finished
            monitor = panel.locator(".nbaccel-run-monitor")
            expect(monitor).to_contain_text("finished")
            panel.screenshot(path=str(ARTIFACTS / "widgets7-notebook6-panel.png"))
        finally:
            context.close()

    descendants = psutil.Process(server.pid).children(recursive=True)
    try:
        _get(f"{base}/api/shutdown", token, method="POST")  # stops its kernels too
    except OSError:
        server.terminate()
    server.wait(30)
    alive = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left after the server stopped: {[p.pid for p in alive]}"
