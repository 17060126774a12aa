"""Execute a notebook top to bottom in a real IPython kernel with nbclient.

Used by ``tests/test_notebooks.py``, ``tests/test_binder.py`` and ``scripts/demo.py``.
The kernel runs a chosen interpreter (``python=``, default: the caller's), through
a temporary kernelspec, so a notebook can be run inside another virtual
environment (the binder check) without installing a kernelspec anywhere.

Example:
    >>> from notebook_runner import execute_notebook, cell_text  # doctest: +SKIP
    >>> run = execute_notebook("notebooks/quickstart.ipynb", timeout=120)  # doctest: +SKIP
    >>> print(cell_text(run.notebook.cells[-1]))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from traitlets import default

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_KERNEL_NAME = "nbaccel-notebook-python"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@dataclass
class NotebookRun:
    """An executed notebook and how long it took (seconds, kernel start included)."""

    notebook: Any
    elapsed: float

    def code_cells(self) -> list[Any]:
        return [cell for cell in self.notebook.cells if cell.cell_type == "code"]

    def text(self) -> str:
        """Every code cell's text output, in order."""
        return "\n".join(cell_text(cell) for cell in self.code_cells())

    def mime_types(self) -> set[str]:
        """Every MIME type of every display/result output in the notebook."""
        return {
            mime
            for cell in self.code_cells()
            for out in cell.get("outputs", [])
            for mime in out.get("data", {})
        }


def cell_text(cell: Any) -> str:
    """A code cell's stream output and ``text/plain`` results, ANSI codes removed."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            data = out.get("data", {})
            if WIDGET_MIME in data:
                continue  # a live widget has no useful text form here
            if "text/plain" in data:
                parts.append(data["text/plain"] + "\n")
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback) + "\n")
    return _ANSI.sub("", "".join(parts))


def execute_notebook(
    path: str | os.PathLike[str],
    *,
    python: str | os.PathLike[str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> NotebookRun:
    """Run every cell of ``path`` in a fresh kernel; raise ``CellExecutionError`` on failure.

    Args:
        path: the ``.ipynb`` file (not modified).
        python: interpreter of the kernel; it needs ``ipykernel``.
        cwd: the kernel's working directory (default: the notebook's folder).
        timeout: seconds allowed per cell.
        env: extra environment variables for the kernel.
    """
    notebook = nbformat.read(os.fspath(path), as_version=4)
    with tempfile.TemporaryDirectory(prefix="nbaccel-nbspec-") as spec_root:
        spec_dir = Path(spec_root, _KERNEL_NAME)
        spec_dir.mkdir()
        spec = {
            "argv": [
                os.fspath(python or sys.executable),
                "-m",
                "ipykernel_launcher",
                "-f",
                "{connection_file}",
                # loopback TCP: ipykernel's "no encryption" warning is noise in a demo's output
                "--IPKernelApp.log_level=ERROR",
            ],
            "display_name": "nbaccel notebook kernel",
            "language": "python",
            "interrupt_mode": "signal",
            "env": dict(env or {}),
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        specs = KernelSpecManager(kernel_dirs=[spec_root])

        class _Manager(AsyncKernelManager):
            @default("kernel_spec_manager")
            def _only_our_spec(self) -> KernelSpecManager:
                return specs

            # IPC, not TCP: no port picked free can be taken by another process before the
            # kernel binds it (see kernel_harness.KernelSession.start)
            @default("transport")
            def _ipc(self) -> str:
                return "ipc"

            @default("ip")
            def _ipc_path(self) -> str:  # absolute: the kernel runs in the notebook's folder
                return os.path.join(spec_root, "ipc")

        client = NotebookClient(
            notebook,
            timeout=timeout,
            kernel_name=_KERNEL_NAME,
            kernel_manager_class=_Manager,
            resources={"metadata": {"path": os.fspath(cwd or Path(path).resolve().parent)}},
        )
        start = time.monotonic()
        client.execute()
        return NotebookRun(notebook, time.monotonic() - start)
