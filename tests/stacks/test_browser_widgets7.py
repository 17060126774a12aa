"""Issue 35 on ipywidgets 7.7.1 in a real browser: the Colab-like stack's front end.

Colab draws widgets with its own front end, which cannot be installed here; the front end
for ipywidgets 7 that installs from PyPI is the classic Notebook 6.5 with
widgetsnbextension 3.6, which the Colab-like stack has (scripts/stacks.env). Its server,
kernel and workers run inside the stack's Debian root (Python 3.13, torch 2.11,
ipykernel 6.17.1); Debian's Chromium on this machine opens the notebook through
Playwright and runs tests/browser_scenario.py's cells and checks, as
tests/ui/test_browser_user.py does in JupyterLab 4: a failed background run speaks in
its cell, a re-run launching cell is refused, one titled chart set per run, rank 0's
tqdm bar once, and the LaunchPanel (2 processes, Launch, both ranks' output, the return
value, the monitor, the Stop button) with the launcher's oversubscription warning.
Then (item 4) the notebook is saved, its kernel deleted and the page reloaded: the
watched run's lines and charts are plain outputs, no "widget could not be displayed".

Run by scripts/test_stacks.sh (NBACCEL_STACK=colab, NBACCEL_STACK_ROOT=the root).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from browser_scenario import (
    CHROMIUM,
    LONG,
    NOTEBOOK,
    NOTEBOOK6,
    open_chromium,
    run_scenario,
    write_notebook,
)

from nbaccel.launch.testing import find_free_port
from nbaccel.platform.environment import cpu_count

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"


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
    write_notebook(work / "notebooks")
    # no num_processes: the panel starts at what fits the machine
    (work / "nbaccel.yaml").write_text("config_version: 1\ncompute_device: cpu\n")
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
        deadline = time.monotonic() + LONG / 1000
        while True:
            try:
                if _get(f"{base}/api/status", token) == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"Notebook 6 did not start:\n{log_path.read_text()}")
            time.sleep(0.3)
        yield base, token, server, work / "notebooks"
    finally:
        if server.poll() is None:  # a failed test: shut down politely (kernels too), then kill
            left = psutil.Process(server.pid).children(recursive=True)
            try:
                _get(f"{base}/api/shutdown", token, method="POST")
                server.wait(180)
            except (OSError, subprocess.TimeoutExpired):
                pass
            for proc in left:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            server.kill()  # the server exited after the shutdown: a no-op
            server.wait(10)
        log.close()
        shutil.rmtree(work, ignore_errors=True)


def _saved_and_reopened_without_the_kernel(page, base: str, token: str, folder: Path) -> None:
    """Item 4: the notebook saved, the kernel that drew the widgets gone, reopened: a watched
    run's lines and final charts are plain outputs (no widget left to fail to display)."""
    from playwright.sync_api import expect

    page.evaluate("Jupyter.notebook.save_checkpoint()")
    deadline = time.monotonic() + LONG / 1000
    while "training done on rank 1" not in (folder / NOTEBOOK).read_text():
        assert time.monotonic() < deadline, "the notebook was not saved (hang guard)"
        time.sleep(0.2)
    request = urllib.request.Request(
        f"{base}/api/kernels", headers={"Authorization": f"token {token}"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        kernels = [kernel["id"] for kernel in json.load(response)]
    for kernel in kernels:
        _get(f"{base}/api/kernels/{kernel}", token, method="DELETE")
    page.reload()  # Notebook 6 starts a fresh kernel: it knows none of the old widgets
    page.locator("#kernel_indicator_icon.kernel_idle_icon").wait_for(timeout=LONG)
    watched = NOTEBOOK6.cell_at(page, 5)  # the watched run that finished
    expect(watched).to_contain_text("training done on rank 1")
    expect(watched).to_contain_text("finished")
    assert watched.locator("svg[class*='nbaccel-charts'], img").count() >= 1
    for broken in ("Error displaying widget", "could not be displayed", "model not found"):
        expect(watched).not_to_contain_text(broken)


def test_what_a_notebook_user_sees_on_ipywidgets7_in_notebook6(notebook6, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    base, token, server, folder = notebook6
    timings: dict[str, float] = {}
    with sync_playwright() as pw:
        context, page = open_chromium(pw, tmp_path / "chromium-profile")
        try:
            console: list[str] = []  # the front end's messages, saved if a check fails
            page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))
            page.goto(f"{base}/notebooks/{NOTEBOOK}?token={token}")
            page.locator("#kernel_indicator_icon.kernel_idle_icon").wait_for(timeout=LONG)
            try:
                run_scenario(page, NOTEBOOK6, folder, cpu_count(), timings)
                expect(NOTEBOOK6.outputs(page, 0)).to_contain_text("ipywidgets 7.7.1")
                panel = page.locator(".nbaccel-launch-panel")
                expect(panel.get_by_role("button", name="Save as default")).to_be_visible()
                _saved_and_reopened_without_the_kernel(page, base, token, folder)
            except Exception:
                (ARTIFACTS / "widgets7-notebook6-failed.html").write_text(page.content())
                (ARTIFACTS / "widgets7-notebook6-console.txt").write_text("\n".join(console))
                raise
            finally:
                page.screenshot(path=str(ARTIFACTS / "widgets7-notebook6.png"), full_page=True)
        finally:
            context.close()

    descendants = psutil.Process(server.pid).children(recursive=True)
    try:
        _get(f"{base}/api/shutdown", token, method="POST")  # stops its kernels too
    except OSError:
        server.terminate()
    server.wait(180)
    alive = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left after the server stopped: {[p.pid for p in alive]}"
    start = timings.pop("start")
    print({what: round(at - start, 1) for what, at in timings.items()})
