"""Every notebook in notebooks/ runs top to bottom in a real kernel and proves its claims.

Each notebook is executed in a temporary working directory (a fresh IPython kernel, 2 CPU
workers launched from it), and once more over the files it left there when it leaves any
(a fresh kernel again), each run
under a timeout that only stops a stuck run (no wall-clock claim: a loaded machine is slower): a notebook must survive "Restart & Run All" any number of
times, over the files its previous run left; the quickstart runs through ``scripts/demo.py``, the README's demo. The notebooks end with ``assert`` cells for the numbers they print, so a
run that completes has met them; the tests also check the printed summary.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from notebook_runner import WIDGET_MIME, execute_notebook

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

# notebook -> (a typical run in seconds: 3x that stops a stuck run, regex its output must contain)
EXPECTED = {
    "quickstart.ipynb": (60, r"final accuracy 0\.9\d+ on 500 samples, trained on 2 processes"),
    "nlp_example.ipynb": (90, r"final eval accuracy 0\.[89]\d+, F1 0\.[89]\d+ on 600 pairs"),
    "cv_example.ipynb": (90, r"final accuracy 0\.9\d+ on 600 images"),
    "launch_panel.ipynb": (60, r"panel run: 2 processes, bf16, loss \d\.\d+ -> \d\.\d+"),
    "checkpoint_resume.ipynb": (
        120,
        r"resumed from step \d+; final weights match the uninterrupted run \(max diff [\d.e-]+\)",
    ),
}


# the notebooks whose run leaves files in its folder (checkpoints, saved models, metrics): run
# twice, the second over the first's files; the test fails when this list stops being true
LEAVES_FILES = {"checkpoint_resume.ipynb", "cv_example.ipynb", "nlp_example.ipynb"}

# committed executed, with widget state, for a static render (re-made by executing the
# notebook with nbclient's store_widget_state=True)
STATIC_SNAPSHOTS = {"launch_panel.ipynb"}


def test_every_notebook_is_listed_and_committed_without_outputs():
    found = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert found == sorted(EXPECTED)
    for name in found:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        assert nb.metadata.kernelspec.name == "python3"
        if name in STATIC_SNAPSHOTS:
            # kept executed, with the widget state, so GitHub/nbviewer render the panel
            state = nb.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"]
            views = [
                out.data[WIDGET_MIME]["model_id"]
                for cell in nb.cells
                if cell.cell_type == "code"
                for out in cell.outputs
                if WIDGET_MIME in out.get("data", {})
            ]
            assert views and all(view in state for view in views), f"{name}: stale widget state"
            continue
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, (
                    f"{name}: commit notebooks with outputs cleared"
                )


@pytest.mark.kernel
@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_runs_top_to_bottom(name, tmp_path):
    _run_once(name, tmp_path, 1)
    # The second run finds the first run's files in place ("Restart & Run All" over them);
    # a notebook that leaves none would run twice over the same empty folder, proving nothing new.
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert bool(left) == (name in LEAVES_FILES), f"{name}: files left by its run: {left}"
    if left:
        _run_once(name, tmp_path, 2)


def _run_once(name: str, tmp_path: Path, run: int) -> None:
    bound, claim = EXPECTED[name]
    if name == "quickstart.ipynb":  # through the README's demo script, which runs exactly this
        proc = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "demo.py")],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=3 * bound + 60,  # stops a stuck run; a loaded machine may be slow
        )
        text = proc.stdout
        assert proc.returncode == 0, f"demo.py failed (run {run}):\n{proc.stdout}\n{proc.stderr}"
    else:
        result = execute_notebook(NOTEBOOKS / name, cwd=tmp_path, timeout=3 * bound)
        text = result.text()
    assert re.search(claim, text), f"{name} (run {run}) did not print its claim {claim!r}:\n{text}"
    assert "Traceback" not in text, text
    if name == "checkpoint_resume.ipynb":  # pdb ran in the crashed rank, on its failing frame
        assert re.search(r"\(Pdb\) p accelerator.step, accelerator.process_index\n\(25, 1\)", text)
        assert "torch.Size([16, 10])" in text, text
    if name == "launch_panel.ipynb":
        assert WIDGET_MIME in result.mime_types()  # the panel is a live widget in the kernel
        assert "live charts: loss" in text  # the monitor's section (issue 28)
        assert "image/svg+xml" in result.mime_types()  # its final charts, kept as an image
    if name == "nlp_example.ipynb":  # the JSONL tracker wrote one row per epoch, this run only
        metrics = tmp_path / "runs" / "nlp" / "pairs" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [row["step"] for row in rows] == list(range(8)), f"run {run}: {rows}"
        assert rows[-1]["eval_accuracy"] >= 0.85
        kept = tmp_path / "runs" / "nlp" / "pairs" / "metrics.1.jsonl"
        assert kept.is_file() == (run == 2)  # the first run's metrics are kept, not mixed in
