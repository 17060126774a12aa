"""Issue 35 as a notebook user sees it in a browser: one notebook, one scenario, two front ends.

tests/ui/test_browser_user.py runs it in JupyterLab 4 (ipywidgets 8) and
tests/stacks/test_browser_widgets7.py in the classic Notebook 6.5 (ipywidgets 7.7.1, the
Colab-like stack); :class:`Front` holds what differs between the two pages (selectors).
Every check reads the page (DOM text and elements), never the kernel:

1. a failed ``block=False`` run shows its exception (type, message, rank 1, the user's
   frame) in the cell that launched it, with and without ``watch``; nothing in other cells;
2. running that cell again while its run is alive is refused, naming the running handle,
   and no second job starts;
3. ``watch(h)`` as a cell's last expression shows one monitor; one chart set per run,
   titled "run 1: notebook_launcher(train), started ..., <outcome>"; a failed run's and a
   stopped run's charts and bar say so (``handle.stop()`` and the panel's Stop button);
   ``watch(pool)`` through two calls: one monitor, one chart set ("run 2: ...");
5. the error outputs lead with the user's error: no nbaccel frames, a hint to
   ``debug=True`` / ``nbaccel.debug()``;
6. under ``watch``, in the panel and under ``watch(pool)``, one tqdm bar (rank 0's, the
   monitor's), not also a text bar in the output, the panel or the pool call's cell;
   never a red line;
7. the panel starts at what fits the machine, shows the return value, its Stop button
   stops a background run; ``notebook_launcher(num_processes=4)`` on 2 cores warns.

The runs hold at a flag file the test writes into the notebook's folder, so every live
state is looked at while it lasts: the checks wait for states, never for time.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
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
NOTEBOOK = "user.ipynb"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"  # screenshots of cells
#: ms: a hang guard, never a speed bound (every browser wait ends at its event: a text shown,
#: a page loaded); the slow-machine rehearsal passed 30 s and 120 s bounds (issue 49)
LONG = 600_000


def open_chromium(pw: Any, profile: Path, *, height: int = 1400) -> tuple[Any, Any]:
    """Debian's Chromium through Playwright, headless, its profile in ``profile``:
    (the browser context, its page). Close the context when done."""
    context = pw.chromium.launch_persistent_context(
        user_data_dir=str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
        viewport={"width": 1200, "height": height},
    )  # fmt: skip
    # Playwright's own defaults (30 s for a page load or an action, 5 s for expect) are the
    # same kind of fixed bound: waits given no timeout get the hang guard too
    context.set_default_timeout(LONG)
    context.set_default_navigation_timeout(LONG)
    from playwright.sync_api import expect

    expect.set_options(timeout=LONG)
    return context, context.pages[0] if context.pages else context.new_page()


SETUP = """\
import os, time
import psutil
from tqdm.auto import tqdm
from nbaccel import Accelerator, notebook_launcher
from nbaccel.monitor import watch
from nbaccel.widgets import LaunchPanel

def fails_when_told(flag):
    accelerator = Accelerator()
    while not os.path.exists(flag):           # until the test says so
        time.sleep(0.05)
    if accelerator.process_index == 1:
        raise ValueError("bad batch on purpose")
    accelerator.wait_for_everyone()           # rank 0 waits for rank 1, which is gone

def train(steps, hold=None, fail=False):
    accelerator = Accelerator()
    for step in tqdm(range(steps), desc="train"):
        if step == steps // 2 and hold:
            while not os.path.exists(hold):
                time.sleep(0.05)
            if fail and accelerator.process_index == 1:
                raise ValueError("diverged on purpose")
        accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
        time.sleep(0.02)
    accelerator.wait_for_everyone()
    print(f"training done on rank {accelerator.process_index}", flush=True)
    return f"trained {steps} steps"

def seven():
    return 7

import ipywidgets
print("ipywidgets", ipywidgets.__version__)
"""

CELLS = (
    SETUP,  # 0
    'ha = notebook_launcher(fails_when_told, args=("go-a",), num_processes=2, block=False)',  # 1
    "x = 1 + 1\nx",  # 2
    "alive = [p for p in psutil.Process().children(recursive=True) if p.status() != 'zombie']\n"
    "print('workers', len(alive))",  # 3
    'hb = notebook_launcher(train, args=(20, "go-b", True), num_processes=2, block=False)\n'
    "watch(hb)",  # 4
    'hc = notebook_launcher(train, args=(20, "go-c"), num_processes=2, block=False)\n'
    "watch(hc)",  # 5
    "panel = LaunchPanel(train, args=(6,))\npanel",  # 6
    "panel.args = (100000,)",  # 7
    "keep = os.sched_getaffinity(0)\n"
    "os.sched_setaffinity(0, sorted(keep)[:2])   # 2 cores\n"
    "try:\n"
    "    print('returned', notebook_launcher(seven, num_processes=4))\n"
    "finally:\n"
    "    os.sched_setaffinity(0, keep)",  # 8
    'notebook_launcher(fails_when_told, args=("go-a",), num_processes=2)',  # 9
    "from nbaccel import start_workers\npool = start_workers(num_processes=2)\nwatch(pool)",  # 10
    "print(pool.run(train, 20))",  # 11: run twice
    "pool.close()",  # 12
    "hd = notebook_launcher(train, args=(100000,), num_processes=2, block=False)\nwatch(hd)",  # 13
    "hd.stop()",  # 14
)

# nbaccel's own code, which a user should not have to read through in an error
OURS = ("nbaccel/launch/", "nbaccel/ui/", "launcher.py", "handle.py")

# The charts' titles in a cell: the live widget's (inline SVG) and the final image's
# (JupyterLab: an <img> with a data: URL; Notebook 6: inline SVG outside the widget).
TITLES_JS = """(cell) => {
  const live = [], final = [];
  for (const t of cell.querySelectorAll('svg.nbaccel-charts text.nbaccel-title')) {
    (t.closest('.nbaccel-run-monitor') ? live : final).push(t.textContent);
  }
  for (const img of cell.querySelectorAll('img')) {
    const src = img.getAttribute('src') || '';
    if (!src.startsWith('data:image/svg+xml')) continue;
    const body = src.slice(src.indexOf(',') + 1);
    const text = src.includes(';base64,') ? atob(body) : decodeURIComponent(body);
    const doc = new DOMParser().parseFromString(text, 'image/svg+xml');
    const t = doc.querySelector('text.nbaccel-title');
    final.push(t ? t.textContent : '');
  }
  return {live, final};
}"""


# Titles wider than their chart (cut off: "..., started 17:04:15, stopp"): each chart
# SVG of the cell (an <img>'s decoded) drawn in the page and its title's box measured.
CUT_TITLES_JS = """(cell) => {
  const svgs = [...cell.querySelectorAll('svg.nbaccel-charts')].map(s => s.outerHTML);
  for (const img of cell.querySelectorAll('img')) {
    const src = img.getAttribute('src') || '';
    if (!src.startsWith('data:image/svg+xml')) continue;
    const body = src.slice(src.indexOf(',') + 1);
    svgs.push(src.includes(';base64,') ? atob(body) : decodeURIComponent(body));
  }
  const cut = [];
  for (const text of svgs) {
    const box = document.createElement('div');
    box.style.cssText = 'position:absolute;left:0;top:0;visibility:hidden';
    box.innerHTML = text;
    document.body.appendChild(box);
    const svg = box.querySelector('svg'), title = box.querySelector('text.nbaccel-title');
    if (title && title.getBBox().x + title.getBBox().width > svg.viewBox.baseVal.width) {
      cut.push(title.textContent);
    }
    box.remove();
  }
  return cut;
}"""


def write_notebook(path: Path) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}  # fmt: skip
    nb.cells.extend(nbformat.v4.new_code_cell(cell) for cell in CELLS)
    nbformat.write(nb, path / NOTEBOOK)


@dataclass(frozen=True)
class Front:
    """What differs between JupyterLab 4 and Notebook 6.5 pages."""

    name: str
    cell: str  # a code cell
    editor: str  # its input editor, inside a cell
    output: str  # one output, inside a cell
    error: str  # an error output
    stderr: str  # a stderr stream output
    widget_output: str  # an ipywidgets Output's area
    prompt: str  # a cell's input prompt ("[ ]:", "[*]:", "[3]:")

    def cell_at(self, page: Any, index: int) -> Any:
        return page.locator(self.cell).nth(index)

    def run(self, page: Any, index: int) -> None:
        """Run the cell in place; return once the page shows it queued or run.

        The page marks a cell "[*]" the moment it sends it to the kernel; a prompt still
        unchanged 15 s after the keys means they were lost (the click landed while the page
        re-laid out): pressed once more (it happened once in ~20 runs on a loaded machine).
        """
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        cell = self.cell_at(page, index)
        prompt = cell.locator(self.prompt).first
        before = prompt.inner_text()
        changed = (
            "([el, before]) => el.innerText !== before && /\\[(\\*|\\d+)\\]/.test(el.innerText)"
        )
        busy = "*" in before  # running already: its prompt changes when this run ends
        for attempt in (1, 2):
            cell.locator(self.editor).first.click()
            page.keyboard.press("Control+Enter")  # run in place (no new cell, focus stays)
            try:
                page.wait_for_function(
                    changed, arg=[prompt.element_handle(), before],
                    timeout=LONG if busy or attempt == 2 else 15_000,
                )  # fmt: skip
                return
            except PlaywrightTimeout:
                if busy or attempt == 2 or prompt.inner_text() != before:
                    raise

    def outputs(self, page: Any, index: int) -> Any:
        return self.cell_at(page, index).locator(self.output)

    def errors(self, page: Any, index: int) -> Any:
        return self.cell_at(page, index).locator(self.error)

    def titles(self, page: Any, index: int) -> dict[str, list[str]]:
        """The chart titles in the cell, read whole; fails on one cut off by its chart."""
        cut = self.cell_at(page, index).evaluate(CUT_TITLES_JS)
        assert not cut, f"chart titles cut off at the chart's edge: {cut}"
        return self.cell_at(page, index).evaluate(TITLES_JS)  # type: ignore[no-any-return]


LAB = Front(
    name="jupyterlab",
    cell=".jp-Notebook .jp-CodeCell",
    editor=".jp-InputArea-editor",
    output=".jp-OutputArea-output",
    # an error and a stderr stream are both this mime type; an error has a traceback
    error=".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
    stderr=".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
    widget_output=".widget-output",
    prompt=".jp-InputPrompt",
)
NOTEBOOK6 = Front(
    name="notebook6",
    cell="#notebook-container .code_cell",
    editor=".input .CodeMirror",
    output=".output_area",
    error=".output_error",
    stderr=".output_stderr",
    widget_output=".jupyter-widgets-output-area",
    prompt=".input_prompt",
)


def _no_frames_of_ours(text: str) -> None:
    shown = [name for name in OURS if name in text]
    assert not shown, f"nbaccel's frames in what the user reads ({shown}):\n{text}"


def _wait_text(locator: Any, pattern: str, timeout: int = LONG) -> None:
    from playwright.sync_api import expect

    expect(locator).to_contain_text(re.compile(pattern), timeout=timeout)


def run_scenario(page: Any, front: Front, folder: Path, cores: int, timings: dict) -> None:
    """Issue 35's items 1, 2, 3, 5, 6, 7 in ``page`` (the notebook open, its kernel idle).

    ``folder``: the notebook's folder as this machine sees it (the flag files go there);
    ``cores``: the CPU cores the kernel sees (the panel's starting number of processes).
    """
    from playwright.sync_api import expect

    def mark(what: str) -> None:
        timings[what] = time.monotonic()

    mark("start")
    front.run(page, 0)
    expect(front.outputs(page, 0)).to_contain_text("ipywidgets", timeout=LONG)

    # ---- items 1, 2, 5: a failed background run without watch; its cell run again
    front.run(page, 1)
    front.run(page, 1)  # the same cell again while its run waits for go-a
    front.run(page, 2)
    front.run(page, 3)
    _wait_text(front.outputs(page, 3), r"workers \d")
    refusal = front.errors(page, 1).filter(has_text="LaunchError")
    _wait_text(refusal, r"still going")
    expect(refusal).to_contain_text("notebook_launcher(fails_when_told)")
    # one job: the first run's 2 workers only (no second job beside it)
    expect(front.outputs(page, 3)).to_contain_text("workers 2")
    (folder / "go-a").write_text("go")
    failure = front.errors(page, 1).filter(has_text="bad batch on purpose")
    expect(failure).to_have_count(1, timeout=LONG)
    text = failure.inner_text()
    assert "ValueError" in text and "rank 1" in text, text
    assert 'raise ValueError("bad batch on purpose")' in text, text  # the user's frame
    assert "debug=True" in text, text
    _no_frames_of_ours(text)
    mark("item 1/2: plain failure shown")

    # ---- items 1, 3, 6: two watched runs, held half-way: one fails, one finishes
    front.run(page, 4)
    front.run(page, 5)
    for index in (4, 5):
        cell = front.cell_at(page, index)
        monitor = cell.locator(".nbaccel-run-monitor")
        _wait_text(monitor.locator("table"), "running")
        # live: the charts drawn once, titled; rank 0's bar the only bar; no text bar
        _wait_text(monitor, r"train: \d+/20")
        expect(monitor).to_have_count(1)  # watch(h) as the last expression: shown once
        page.wait_for_function(  # the live charts, titled
            f"cell => ({TITLES_JS})(cell).live.length === 1",
            arg=cell.element_handle(),
            timeout=LONG,
        )
        titles = front.titles(page, index)
        assert titles["final"] == [], titles
        assert len(titles["live"]) == 1, titles
        assert re.match(r"run 1: notebook_launcher\(train\), started [\d:]+, running$",
                        titles["live"][0]), titles  # fmt: skip
        expect(monitor.locator(".widget-hprogress")).to_have_count(1)
        assert "train:" not in monitor.locator(".nbaccel-log").all_inner_texts().__str__()
    mark("items 3/6: live monitors")
    (folder / "go-b").write_text("go")
    (folder / "go-c").write_text("go")

    failed = front.errors(page, 4).filter(has_text="diverged on purpose")
    expect(failed).to_have_count(1, timeout=LONG)
    text = failed.inner_text()
    assert "ValueError" in text and "rank 1" in text, text
    assert 'raise ValueError("diverged on purpose")' in text, text
    _no_frames_of_ours(text)
    for index, outcome in ((4, "failed"), (5, "finished")):
        cell = front.cell_at(page, index)
        page.wait_for_function(  # the final image, titled with how the run ended
            f"cell => ({TITLES_JS})(cell).final.length === 1",
            arg=cell.element_handle(),
            timeout=LONG,
        )
        titles = front.titles(page, index)
        assert titles["live"] == [], titles
        assert re.match(rf"run 1: notebook_launcher\(train\), started [\d:]+, {outcome}$",
                        titles["final"][0]), titles  # fmt: skip
        expect(cell.locator(".nbaccel-run-monitor")).to_have_count(1)
        expect(cell.locator(".nbaccel-run-monitor table")).to_contain_text(outcome)
    finished = front.cell_at(page, 5)
    expect(finished.locator(".nbaccel-run-monitor")).to_contain_text("training done on rank 1")
    expect(finished.locator(".nbaccel-run-monitor")).to_contain_text("train: 20/20")
    bars = re.findall(r"train: \d+/20", finished.inner_text())
    assert bars == ["train: 20/20"], bars  # rank 0's bar, drawn once (no text bar)
    expect(finished.locator(front.stderr)).to_have_count(0)  # no red line
    red = finished.locator(".nbaccel-log span", has_text="train")
    expect(red).to_have_count(0)
    expect(front.errors(page, 5)).to_have_count(0)
    mark("items 1/3/6: watched runs ended")
    ARTIFACTS.mkdir(exist_ok=True)
    for index in (1, 4, 5):
        front.cell_at(page, index).screenshot(
            path=str(ARTIFACTS / f"user_{front.name}_{index}.png")
        )

    # ---- item 7: the panel
    front.run(page, 6)
    panel = front.cell_at(page, 6).locator(".nbaccel-launch-panel")
    panel.wait_for(timeout=LONG)
    expect(page.locator(front.output, has_text="LaunchPanel(")).to_have_count(0)  # the widget
    expect(panel).to_contain_text("Hardware:")
    processes = panel.locator(".widget-inline-hbox", has_text="num processes").locator("input")
    expect(processes).to_have_value(str(min(cores, 8)))  # one per core (no config value)
    if cores != 2:
        processes.fill("2")
        processes.press("Enter")
    launch = panel.get_by_role("button", name="Launch")
    stop = panel.get_by_role("button", name="Stop")
    expect(stop).to_be_hidden()
    launch.click()
    expect(panel).to_contain_text("Finished; returned 'trained 6 steps'", timeout=LONG)
    output = panel.locator(front.widget_output)
    expect(output).to_contain_text("[rank0] training done on rank 0")
    expect(output).to_contain_text("[rank1] training done on rank 1")
    expect(panel.locator(".nbaccel-run-monitor table")).to_contain_text("finished")
    mark("item 7: panel run returned")

    front.run(page, 7)  # a long run, stopped with the panel's Stop button
    expect(front.cell_at(page, 7).locator(front.prompt)).to_contain_text(
        re.compile(r"\[\d+\]"), timeout=LONG
    )
    launch.click()
    expect(stop).to_be_visible(timeout=LONG)
    _wait_text(panel.locator(".nbaccel-run-monitor"), r"train: \d+/100000")
    stop.click()
    expect(panel).to_contain_text("Stopped.", timeout=LONG)
    expect(stop).to_be_hidden()
    expect(launch).to_be_enabled()
    monitor = panel.locator(".nbaccel-run-monitor")
    expect(monitor.locator("table")).to_contain_text("stopped")
    expect(monitor).to_contain_text(re.compile(r"train: \d+/100000.*\(stopped\)"))
    expect(output).not_to_contain_text("train:")  # item 6: the monitor's bar only
    cell = front.cell_at(page, 6)
    page.wait_for_function(
        f"cell => ({TITLES_JS})(cell).final.some(t => t.endsWith(', stopped'))",
        arg=cell.element_handle(),
        timeout=LONG,
    )
    titles = front.titles(page, 6)
    assert len(titles["final"]) == 1, titles  # the second run's charts replaced the first's
    assert titles["final"][0].startswith("run 2: notebook_launcher(train), started "), titles
    mark("item 7/3: panel stopped")
    front.cell_at(page, 6).screenshot(path=str(ARTIFACTS / f"user_{front.name}_6.png"))

    front.run(page, 8)  # 4 processes on 2 cores: the panel's words, from notebook_launcher
    expect(front.outputs(page, 8).filter(has_text="returned 7")).to_have_count(1, timeout=LONG)
    expect(front.cell_at(page, 8).locator(front.stderr)).to_contain_text(
        f"4 processes on {min(cores, 2)} CPU core(s) here"
    )
    mark("item 7: oversubscription")

    # ---- item 5: a blocking launch's error leads with the user's cell and error
    front.run(page, 9)
    blocking = front.errors(page, 9).filter(has_text="bad batch on purpose")
    expect(blocking).to_have_count(1, timeout=LONG)
    text = blocking.inner_text()
    assert "ValueError" in text and "rank 1" in text, text
    assert "----> 1 notebook_launcher(" in text, text  # the user's cell
    assert "debug=True" in text and "nbaccel.debug()" in text, text
    _no_frames_of_ours(text)
    mark("item 5: blocking error")

    # ---- item 3: watch(pool): one monitor, one chart set, the last call's
    front.run(page, 10)
    _wait_text(front.cell_at(page, 10).locator(".nbaccel-run-monitor table"), "idle")
    front.run(page, 11)
    call = front.outputs(page, 11)
    expect(call.filter(has_text="trained 20 steps")).to_have_count(1, timeout=LONG)
    front.run(page, 11)
    pool_cell = front.cell_at(page, 10)
    page.wait_for_function(
        f"cell => ({TITLES_JS})(cell).final.some(t => t.startsWith('run 2: '))",
        arg=pool_cell.element_handle(),
        timeout=LONG,
    )
    titles = front.titles(page, 10)
    assert len(titles["final"]) == 1 and titles["live"] == [], titles
    assert re.match(r"run 2: .*\(train\), started [\d:]+, finished$", titles["final"][0]), titles
    expect(pool_cell.locator(".nbaccel-run-monitor")).to_have_count(1)
    expect(pool_cell.locator(".nbaccel-run-monitor")).to_contain_text("train: 20/20")
    expect(call.filter(has_text="trained 20 steps")).to_have_count(1, timeout=LONG)
    expect(call.filter(has_text="train:")).to_have_count(0)  # item 6: the monitor's bar only
    front.run(page, 12)
    expect(front.cell_at(page, 12).locator(front.prompt)).to_contain_text(
        re.compile(r"\[\d+\]"), timeout=LONG
    )
    mark("item 3: watch(pool)")
    for index in (9, 10, 11):
        front.cell_at(page, index).screenshot(
            path=str(ARTIFACTS / f"user_{front.name}_{index}.png")
        )

    # ---- item 3: a watched run stopped with handle.stop() is drawn as stopped
    front.run(page, 13)
    stopped = front.cell_at(page, 13)
    _wait_text(stopped.locator(".nbaccel-run-monitor"), r"train: \d+/100000")
    front.run(page, 14)
    page.wait_for_function(
        f"cell => ({TITLES_JS})(cell).final.some(t => t.endsWith(', stopped'))",
        arg=stopped.element_handle(),
        timeout=LONG,
    )
    monitor = stopped.locator(".nbaccel-run-monitor")
    expect(monitor.locator("table")).to_contain_text("stopped")
    expect(monitor).to_contain_text(re.compile(r"train: \d+/100000.*\(stopped\)"))
    expect(front.errors(page, 13)).to_have_count(0)  # a stop is the user's doing
    stopped.screenshot(path=str(ARTIFACTS / f"user_{front.name}_13.png"))
    mark("item 3: stopped under watch")

    # nothing of the runs in the cells run meanwhile
    expect(front.outputs(page, 2)).to_have_text(re.compile(r"^\s*(Out\[\d+\]:\s*)?2\s*$"))
    for index in (2, 3, 7, 8):
        seen = front.cell_at(page, index).inner_text()
        assert "bad batch" not in seen and "diverged" not in seen and "rank" not in seen, seen
