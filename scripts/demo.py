"""The README's main demo: run notebooks/quickstart.ipynb in a real Jupyter kernel.

Starts an IPython kernel (jupyter_client + nbclient), executes the quickstart
notebook top to bottom -- it trains a small model on 2 CPU worker processes
launched from the kernel with ``notebook_launcher`` -- and prints every cell's
text output. Exits non-zero if any cell fails (the notebook asserts the accuracy
it reports).

Usage:
    .venv/bin/python scripts/demo.py [path/to/notebook.ipynb]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the notebook runner shared with the test suite

from nbclient.exceptions import CellExecutionError  # noqa: E402
from notebook_runner import cell_text, execute_notebook  # noqa: E402


def main(argv: list[str]) -> int:
    notebook = Path(argv[0]) if argv else ROOT / "notebooks" / "quickstart.ipynb"
    print(f"nbaccel demo: executing {notebook.relative_to(ROOT)} in a fresh IPython kernel\n")
    with tempfile.TemporaryDirectory(prefix="nbaccel-demo-") as workdir:
        try:
            run = execute_notebook(notebook, cwd=workdir, timeout=300)
        except CellExecutionError as err:
            print(f"\nFAILED: a cell raised an error\n{err}", file=sys.stderr)
            return 1
    for number, cell in enumerate(run.code_cells(), start=1):
        text = cell_text(cell).rstrip()
        if text:
            print(f"--- cell {number} ---\n{text}\n")
    print(f"Done: the notebook ran top to bottom in {run.elapsed:.1f}s and its checks passed.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
