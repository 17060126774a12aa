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
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest
from browser_scenario import CHROMIUM, LONG, open_chromium
from jupyter_server import get, jupyter_lab

from nbaccel.platform.environment import cpu_count

pytestmark = [pytest.mark.browser, pytest.mark.slow]

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


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
    import os
    import time
    from nbaccel import Accelerator, tqdm
    accelerator = Accelerator()
    while not os.path.exists("go"):  # the test looks at the kernel while the run is held
        time.sleep(0.05)
    for _ in tqdm(range(20), desc="steps"):
        time.sleep(0.1)
    print(f"{greeting} from rank {accelerator.process_index} of {accelerator.num_processes}")
    return accelerator.process_index

panel = LaunchPanel(train, args=("hello",))
panel
"""


MONITOR_SETUP = """\
import time
import torch
from tqdm.auto import tqdm
from nbaccel import Accelerator, notebook_launcher
from nbaccel.monitor import watch

def train(steps):
    accelerator = Accelerator()
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in tqdm(range(steps), desc="train"):
        loss = (model(torch.randn(16, 8)) - 1).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step)
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
        time.sleep(0.1)
    print("training done", flush=True)
"""
MONITOR_CELLS = (
    MONITOR_SETUP,
    "handle = notebook_launcher(train, args=(80,), num_processes=2, block=False)\n"
    "monitor = watch(handle)",
    "x = 1 + 1\nx",  # run while the first launch trains
    "handle2 = notebook_launcher(train, args=(30,), num_processes=2, block=False)",  # no monitor
    "y = 40 + 2\ny",  # run while the second launch trains
)


# Visible labels whose text overflows their box, and dropdown choices wider than their
# select (text width + padding + the arrow): what a user sees cut off ("fsdp reshard
# after f...", "SHARDED_STATE_DI").
CUT_OFF_JS = """(root) => {
  const cut = [];
  for (const el of root.querySelectorAll('.widget-label, label')) {
    if (el.offsetParent === null || !el.textContent.trim()) continue;
    if (el.scrollWidth > el.clientWidth + 1) cut.push(el.textContent);
  }
  const ctx = document.createElement('canvas').getContext('2d');
  for (const sel of root.querySelectorAll('select')) {
    if (sel.offsetParent === null) continue;
    const style = getComputedStyle(sel);
    ctx.font = `${style.fontWeight} ${style.fontSize} ${style.fontFamily}`;
    const room = sel.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    for (const opt of sel.options) {
      if (ctx.measureText(opt.text).width > room) cut.push(opt.text);
    }
  }
  return cut;
}"""


def _require_browser(ui: str) -> None:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing: run `bash scripts/setup_browser.sh` (Debian chromium)")
    if importlib.util.find_spec("playwright") is None:
        pytest.skip("playwright is not installed: run `bash scripts/setup_browser.sh`")
    if importlib.util.find_spec("jupyterlab") is None:
        pytest.skip("jupyterlab>=4 is not installed: run `bash scripts/setup_browser.sh`")
    if importlib.util.find_spec(UIS[ui].module) is None:
        pytest.skip(f"{UIS[ui].module} is not installed: run `bash scripts/setup_browser.sh`")


def _write_notebook(path: Path, *cells: str) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.cells.extend(nbformat.v4.new_code_cell(cell) for cell in cells or (PANEL_CELL,))
    nbformat.write(nb, path)


def _idle_kernels(base: str, token: str) -> int:
    kernels = json.loads(get(f"{base}/api/kernels", token))
    return sum(kernel.get("execution_state") == "idle" for kernel in kernels)


def _wait_for_idle_kernel(page, base: str, token: str, timeout: float = LONG / 1000) -> None:
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
    _write_notebook(root / "monitor.ipynb", *MONITOR_CELLS)
    yaml = "config_version: 1\ncompute_device: cpu\nnum_processes: 1\n"
    with jupyter_lab(tmp_path, root, nbaccel_yaml=yaml) as server:
        yield server


def _stop_server(base: str, token: str, server: subprocess.Popen, log: Path) -> None:
    """Shut JupyterLab down the polite way (it stops its kernels), then wait for it.

    It stops every kernel first: on a loaded machine (CI at load 14) that took over 30 s,
    so the wait is generous; the test is about nothing being left, not about speed.
    """
    try:
        get(f"{base}/api/shutdown", token, method="POST")
    except OSError:
        server.terminate()
    try:
        server.wait(LONG / 1000)
    except subprocess.TimeoutExpired:
        still = [p.info for p in psutil.process_iter(["pid", "ppid", "status", "cmdline"])
                 if p.info["pid"] == server.pid or p.info["ppid"] == server.pid]  # fmt: skip
        server.kill()
        server.wait(10)
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
        pytest.fail(
            f"JupyterLab did not exit within {LONG / 1000:.0f} s of /api/shutdown; it and its "
            f"children then: {still}\nthe end of its log:\n{tail}"
        )


@pytest.mark.parametrize("ui", list(UIS))
def test_launch_panel_in_browser(lab, tmp_path, ui):
    from playwright.sync_api import expect, sync_playwright

    base, token, server = lab
    ARTIFACTS.mkdir(exist_ok=True)
    started = time.monotonic()
    with sync_playwright() as pw:
        context, page = open_chromium(pw, tmp_path / "chromium-profile", height=1100)
        try:
            page.goto(f"{base}{UIS[ui].path}?token={token}")
            page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=LONG)
            _wait_for_idle_kernel(page, base, token)

            page.locator(".jp-Cell .jp-InputArea-editor").first.click()
            page.keyboard.press("Shift+Enter")
            panel = page.locator(".jp-OutputArea-output .nbaccel-launch-panel")
            panel.wait_for(timeout=LONG)
            # Rendered by the widget manager, not the kernel's text repr "LaunchPanel(train, {...})".
            expect(page.locator(".jp-OutputArea-output", has_text="LaunchPanel(")).to_have_count(0)
            expect(panel).to_contain_text("Hardware:")

            processes = panel.locator(".widget-inline-hbox", has_text="num processes").locator(
                "input"
            )
            expect(processes).to_have_value("1")
            # more processes than cores: a warning next to the field, Launch stays possible
            cores = cpu_count()
            processes.fill(str(cores + 1))
            processes.press("Enter")
            expect(panel).to_contain_text(f"{cores + 1} processes on {cores} CPU core(s)")
            # every label and choice shows whole, FSDP's too (they were cut off)
            strategy = panel.locator(".widget-inline-hbox", has_text="strategy").locator("select")
            strategy.first.select_option("fsdp")
            expect(panel).to_contain_text("fsdp reshard after forward")
            assert panel.evaluate(CUT_OFF_JS) == []
            strategy.first.select_option("ddp")
            processes.fill("2")
            processes.press("Enter")
            launch = panel.get_by_role("button", name="Launch")
            expect(launch).to_be_visible()
            expect(panel.get_by_role("button", name="Save as default")).to_be_visible()
            expect(launch).to_be_enabled()
            launch.click()
            # in the background: the kernel is free while the workers train
            expect(panel).to_contain_text("running in the background", timeout=LONG)
            expect(panel.locator(".nbaccel-run-monitor table")).to_contain_text("running")
            # the run waits for "go": the kernel is idle while it trains (a comm message from
            # the page may keep it busy for a moment: wait for idle, not sample once)
            deadline = time.monotonic() + LONG / 1000
            while _idle_kernels(base, token) != 1 and time.monotonic() < deadline:
                page.wait_for_timeout(200)
            assert _idle_kernels(base, token) == 1
            expect(panel.locator(".nbaccel-run-monitor table")).to_contain_text("running")
            (tmp_path / "root" / "go").touch()

            output = panel.locator(".widget-output")
            expect(output).to_contain_text("[rank0] hello from rank 0 of 2", timeout=LONG)
            expect(output).to_contain_text("[rank1] hello from rank 1 of 2", timeout=LONG)
            # rank 0's progress bar, drawn by the monitor (not also as text in the output)
            expect(panel.locator(".nbaccel-run-monitor")).to_contain_text("steps: 20/20")
            expect(panel).to_contain_text("Finished", timeout=LONG)
            panel.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / UIS[ui].page_png), full_page=True)
            panel.screenshot(path=str(ARTIFACTS / UIS[ui].panel_png))
        finally:
            context.close()

    # Everything the server started (kernel; the workers are gone already) must go with it.
    descendants = psutil.Process(server.pid).children(recursive=True)
    _stop_server(base, token, server, tmp_path / "lab.log")
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


def _run_cell(page, index: int) -> None:
    page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")


def _outputs(page, index: int):
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea-output")


def _save_and_reopen_without_the_kernel(page, base: str, token: str, root: Path) -> None:
    """Issue 35: saved, its kernel gone, reopened: the watched run's lines and final charts
    are ordinary outputs (no widget state needed), with no "Error displaying widget"."""
    import nbformat
    from playwright.sync_api import expect

    page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".jp-InputArea-editor").click()
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + LONG / 1000
    while "[rank1] training done" not in (root / "monitor.ipynb").read_text():
        assert time.monotonic() < deadline, "the notebook was not saved (hang guard)"
        time.sleep(0.2)
    saved = nbformat.read(root / "monitor.ipynb", as_version=4).cells[1].outputs
    assert not [out for out in saved if WIDGET_MIME in out.get("data", {})], saved
    kernels = [kernel["id"] for kernel in json.loads(get(f"{base}/api/kernels", token))]
    for kernel in kernels:  # reopened later: the kernel that drew the widgets is gone
        get(f"{base}/api/kernels/{kernel}", token, method="DELETE")
    page.reload()
    page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=LONG)
    outputs = _outputs(page, 1)
    expect(outputs.filter(has_text="[rank1] training done")).to_have_count(1, timeout=LONG)
    expect(outputs.locator("img")).to_have_count(1)  # the final charts
    assert "Error displaying widget" not in page.locator(".jp-Notebook").inner_text()
    page.screenshot(path=str(ARTIFACTS / "monitor_jupyterlab_reopened.png"), full_page=True)
    _wait_for_idle_kernel(page, base, token)  # the reopened notebook's new kernel: stoppable


@pytest.mark.parametrize("ui", ["jupyterlab"])
def test_monitor_charts_live_and_output_stays_in_its_cell(lab, tmp_path, ui):
    """Issue 28 in JupyterLab: the live chart draws and updates; the final chart stays as an
    image; a cell run during a background launch shows none of the launch's output; the
    progress bar is never a stderr line."""
    from playwright.sync_api import expect, sync_playwright

    base, token, server = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        context, page = open_chromium(pw, tmp_path / "chromium-profile")
        try:
            page.goto(f"{base}/lab/tree/monitor.ipynb?token={token}")
            page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=LONG)
            _wait_for_idle_kernel(page, base, token)
            _run_cell(page, 0)
            _run_cell(page, 1)
            monitor = page.locator(".jp-OutputArea-output .nbaccel-run-monitor")
            line = monitor.locator("svg.nbaccel-charts polyline[data-rank='1']")
            line.wait_for(timeout=LONG)  # drawn live, from the widget
            before = line.get_attribute("points")
            page.wait_for_function(  # and redrawn as the workers log
                "before => { const p = document.querySelector("
                "\".nbaccel-run-monitor svg.nbaccel-charts polyline[data-rank='1']\");"
                " return p && p.getAttribute('points') !== before; }",
                arg=before,
                timeout=LONG,
            )
            assert monitor.locator("svg [data-metric='loss']").count() == 1
            _run_cell(page, 2)  # while the workers train
            expect(_outputs(page, 2)).to_have_text("2", timeout=LONG)
            expect(monitor.locator("table")).to_contain_text("running")  # still going
            # the end: the final chart stays in the launching cell as an image
            image = _outputs(page, 1).locator("img")
            expect(image).to_have_count(1, timeout=LONG)
            expect(monitor.locator("table")).to_contain_text("finished")
            expect(monitor.locator(".nbaccel-log")).to_contain_text("[rank1] training done")
            page.screenshot(path=str(ARTIFACTS / "monitor_jupyterlab.png"), full_page=True)

            _run_cell(page, 3)  # a background launch without a monitor
            _run_cell(page, 4)
            expect(_outputs(page, 4)).to_have_text("42", timeout=LONG)
            expect(_outputs(page, 3)).to_contain_text(["[rank0] training done"], timeout=LONG)
            expect(_outputs(page, 3).filter(has_text="train: 100%")).to_have_count(1)

            for index in (2, 4):  # none of the runs' output in the cells run meanwhile
                expect(_outputs(page, index)).to_have_count(1)
                assert "rank" not in _outputs(page, index).first.inner_text()
            stderr = page.locator(
                ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
            )
            assert stderr.filter(has_text="train:").count() == 0  # bars are not stderr lines
            page.screenshot(path=str(ARTIFACTS / "monitor_jupyterlab_end.png"), full_page=True)
            _save_and_reopen_without_the_kernel(page, base, token, tmp_path / "root")
        finally:
            context.close()
    _stop_server(base, token, server, tmp_path / "lab.log")
