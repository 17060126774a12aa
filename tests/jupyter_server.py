"""A JupyterLab server for the browser tests, in a temporary folder: started, waited for,
and stopped with everything it started (kernels and their workers).

Example:
    >>> with jupyter_lab(tmp, root, nbaccel_yaml="config_version: 1\\n") as (base, token, server):
    ...     page.goto(f"{base}/lab/tree/x.ipynb?token={token}")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from waits import HANG_GUARD_S

from nbaccel.launch.testing import find_free_port


def get(url: str, token: str, method: str = "GET", timeout: float = 5) -> bytes:
    """The body of a request to the server (a POST with an empty body)."""
    request = urllib.request.Request(
        url, method=method, headers={"Authorization": f"token {token}"},
        data=b"" if method == "POST" else None,
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return bytes(response.read())


@contextlib.contextmanager
def jupyter_lab(
    tmp: Path, root: Path, *, nbaccel_yaml: str, every_cell_in_dom: bool = False
) -> Iterator[tuple[str, str, subprocess.Popen]]:
    """JupyterLab serving ``root`` with its config, settings and caches under ``tmp`` and
    nbaccel's config file holding ``nbaccel_yaml``; yields (base url, token, server).

    ``every_cell_in_dom``: JupyterLab 4 renders only the visible cells by default.
    """
    config_dir, settings = tmp / "jupyter-config", tmp / "jupyter-settings"
    (config_dir / "labconfig").mkdir(parents=True)
    # No "get Jupyter news?" toast over the notebook.
    (config_dir / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    if every_cell_in_dom:
        tracker = settings / "@jupyterlab" / "notebook-extension"
        tracker.mkdir(parents=True)
        (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    (tmp / "nbaccel.yaml").write_text(nbaccel_yaml)
    # short: the kernels' IPC sockets live there (a socket's path holds 107 bytes at most)
    runtime = tempfile.mkdtemp(prefix="nbjr-")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBACCEL_", "JUPYTER"))}
    env.update(
        NBACCEL_CONFIG_FILE=str(tmp / "nbaccel.yaml"),
        JUPYTER_CONFIG_DIR=str(config_dir),
        JUPYTER_RUNTIME_DIR=runtime,
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "jupyter-workspaces"),
        JUPYTERLAB_SETTINGS_DIR=str(settings),
        XDG_CACHE_HOME=str(tmp / "cache"),
    )
    port, token = find_free_port(), secrets.token_hex(16)
    log = (tmp / "lab.log").open("w")
    server = subprocess.Popen(
        [
            sys.executable, "-m", "jupyter", "lab", "--no-browser",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
            # the kernels over IPC: a free TCP port can be taken before the kernel binds it
            "--KernelManager.transport=ipc",
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + HANG_GUARD_S  # its start is the event
        while True:
            with contextlib.suppress(OSError):
                get(f"{base}/api/status", token)
                break
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not start:\n{(tmp / 'lab.log').read_text()}")
            time.sleep(0.3)
        yield base, token, server
    finally:
        if server.poll() is None:  # a failed test: its kernel and workers go with the server
            left = psutil.Process(server.pid).children(recursive=True)
            try:
                get(f"{base}/api/shutdown", token, method="POST")
                server.wait(180)
            except (OSError, subprocess.TimeoutExpired):
                server.kill()
                server.wait(10)
            for proc in left:
                if proc.is_running():
                    proc.kill()
        log.close()
        shutil.rmtree(runtime, ignore_errors=True)
