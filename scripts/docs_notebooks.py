"""Execute the example notebooks in a real kernel into docs/notebooks/, for the site.

The site shows each notebook with its outputs (mkdocs-jupyter, ``execute: false``). It renders
these executed copies instead of running the notebooks while it builds: they launch worker
processes and take minutes on two cores, against a build budget of about a minute.
``tests/docs/test_site.py`` fails when a copy's code differs from its source in notebooks/,
so a stale copy cannot reach the site; re-make them with ``bash scripts/docs.sh notebooks``.

``launch_panel.ipynb`` is copied as it is: it is committed executed, with the widget state
a static page needs to draw the panel (tests/test_notebooks.py keeps it so); a headless run
would have no widget state.

Example:
    >>> # bash scripts/docs.sh notebooks [quickstart.ipynb ...]  # doctest: +SKIP
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from notebook_runner import execute_notebook  # noqa: E402

SOURCE = ROOT / "notebooks"
TARGET = ROOT / "docs" / "notebooks"
#: committed with their outputs and widget state: copied, not executed
AS_COMMITTED = ("launch_panel.ipynb",)


def make(name: str) -> None:
    """Write ``docs/notebooks/<name>``: the executed copy (or the committed one)."""
    TARGET.mkdir(parents=True, exist_ok=True)
    if name in AS_COMMITTED:
        shutil.copyfile(SOURCE / name, TARGET / name)
        return
    with tempfile.TemporaryDirectory(prefix="nbaccel-docs-nb-") as cwd:
        run = execute_notebook(SOURCE / name, cwd=cwd, timeout=600)
    nbformat.write(run.notebook, TARGET / name)
    print(f"{name}: executed in {run.elapsed:.0f} s", flush=True)


def main(names: list[str]) -> None:
    for name in names or sorted(p.name for p in SOURCE.glob("*.ipynb")):
        make(name)


if __name__ == "__main__":
    main(sys.argv[1:])
